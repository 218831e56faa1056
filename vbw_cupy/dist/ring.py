"""Ring attention: prefill attention over a sequence split across the ranks of a `Comm`.

Layout (zigzag, as in striped / zigzag ring attention): the S positions are cut into 2N chunks as even as can be
(the first S % 2N one longer) and rank r holds chunks r and 2N-1-r, in that order, of q, k and v. Under a causal
mask every rank then does the same work: an early chunk (little to see) is paired with a late one (much to see).

The K/V block of each rank travels the ring: at step s, rank r holds rank (r - s)'s K and V and already sends
them on to rank r + 1 (`Comm.sendrecv`, on a side stream under NCCL) while it runs `flash_attention` on them.
Per (query chunk i, key chunk j) the causal mask reduces to whole blocks: j < i all keys seen (non-causal call),
j == i the diagonal (a causal call, Sq == Sk), j > i nothing. The partial outputs are merged with their
log-sum-exp: o = sum_b exp(lse_b - lse) o_b, lse = log sum_b exp(lse_b).
"""
from __future__ import annotations

import numpy as np

from .. import _runtime as rt
from ..attention import flash_attention
from .comm import Comm

_SOURCE = "lse_merge.cu"
_T = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def zigzag_bounds(seq_len: int, size: int) -> np.ndarray:
    """Boundaries [2 size + 1] of the 2 size chunks of `seq_len` positions (the first seq_len % (2 size) chunks
    one longer)."""
    base, extra = divmod(int(seq_len), 2 * size)
    sizes = np.full(2 * size, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def zigzag_positions(seq_len: int, rank: int, size: int) -> np.ndarray:
    """The sequence positions rank `rank` holds, in its local order (for RoPE and for checks)."""
    b = zigzag_bounds(seq_len, size)
    return np.concatenate([np.arange(b[c], b[c + 1]) for c in (rank, 2 * size - 1 - rank)])


def zigzag_split(x, size: int, axis: int = 1) -> list:
    """Rank r's part of `x` (the sequence along `axis`) for r in 0..size-1: chunks r and 2 size-1-r."""
    xp = _xp(x)
    return [xp.take(x, xp.asarray(zigzag_positions(x.shape[axis], r, size)), axis=axis) for r in range(size)]


def zigzag_merge(parts, axis: int = 1):
    """The inverse of `zigzag_split`: the whole sequence from the ranks' parts (in rank order)."""
    xp = _xp(parts[0])
    size, seq_len = len(parts), sum(p.shape[axis] for p in parts)
    order = np.concatenate([zigzag_positions(seq_len, r, size) for r in range(size)])
    return xp.take(xp.concatenate(parts, axis=axis), xp.asarray(np.argsort(order)), axis=axis)


def ring_attention(q, k, v, comm: Comm, *, seq_len: int | None = None, causal: bool = False,
                   softmax_scale=None, return_lse: bool = False):
    """`flash_attention` over a sequence of `seq_len` positions split across `comm`'s ranks (zigzag layout,
    see the module docstring); every rank calls it with its own part.

    q [B, L, Hq, D], k and v [B, L, Hkv, D]: this rank's positions `zigzag_positions(seq_len, rank, size)`
    (L = seq_len / size when 2 size divides seq_len; seq_len defaults to the sum of the ranks' L, one small
    all-reduce that synchronizes on the GPU: give it to skip that). NumPy arrays run the reference
    per block; CuPy arrays the GPU kernel (float16 / bfloat16) with NCCL. The merge is in float64 on NumPy,
    float32 on the GPU (one kernel a block, cuda_src/lse_merge.cu). causal=True is the usual mask over the whole
    sequence (Sq == Sk). Returns o [B, L, Hq, D] in q's dtype and, with return_lse=True, lse float32 [B, Hq, L],
    this rank's rows of the unsplit result.

    >>> qs, ks, vs = (zigzag_split(a, 2) for a in (q, k, v))                           # doctest: +SKIP
    >>> run = lambda c: ring_attention(qs[c.rank], ks[c.rank], vs[c.rank], c, causal=True)  # doctest: +SKIP
    >>> o = zigzag_merge(SimGroup(2).run(run))      # == flash_attention(q, k, v, causal=True)  # doctest: +SKIP
    """
    xp = _xp(q)
    N, r = comm.size, comm.rank
    if seq_len is None:   # (L * N only where 2 N divides the sequence: ranks of an uneven split would disagree)
        total = xp.full(1, q.shape[1], dtype=np.int64)
        comm.all_reduce(total)
        seq_len = int(total[0])
    seq_len = int(seq_len)
    bounds = zigzag_bounds(seq_len, N)

    def chunks(rank):
        """(chunk index, first local row, rows) of the chunks rank `rank` holds."""
        out, row = [], 0
        for c in (rank, 2 * N - 1 - rank):
            out.append((c, row, int(bounds[c + 1] - bounds[c])))
            row += out[-1][2]
        return out

    L = sum(n for _, _, n in chunks(r))
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4 or a.shape[1] != L:
            raise ValueError(f"{name}: expected [B, {L}, H, D] (rank {r}'s {L} of {seq_len} positions over {N} "
                             f"ranks), got {tuple(a.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")

    B, _, Hq, D = q.shape
    acc_dtype = np.float64 if xp is np else np.float32
    out = xp.zeros(q.shape, dtype=acc_dtype)
    lse = xp.full((B, Hq, L), -np.inf, dtype=acc_dtype)
    kv = xp.stack([k, v])     # one message a step: [2, B, L_src, Hkv, D]
    for step in range(N):
        src = (r - step) % N
        pending = None
        if step + 1 < N:      # start passing this block on before computing with it
            after = (r - step - 1) % N
            rows = sum(n for _, _, n in chunks(after))
            pending = comm.sendrecv(kv, comm.next, xp.empty((2, B, rows, *kv.shape[3:]), dtype=kv.dtype), comm.prev)
        for qc, q0, qn in chunks(r):
            for kc, k0, kn in chunks(src):
                if qn == 0 or kn == 0 or (causal and kc > qc):
                    continue
                o_b, lse_b = flash_attention(xp.ascontiguousarray(q[:, q0:q0 + qn]),
                                             xp.ascontiguousarray(kv[0, :, k0:k0 + kn]),
                                             xp.ascontiguousarray(kv[1, :, k0:k0 + kn]),
                                             causal=causal and kc == qc, softmax_scale=softmax_scale, return_lse=True)
                _merge(xp, out, lse, q0, o_b, lse_b)
        if pending is not None:
            kv = pending.wait()
    o = out.astype(q.dtype)
    return (o, lse.astype(np.float32)) if return_lse else o


def kernel_instances() -> list[tuple[str, str]]:
    return [(_SOURCE, f"vbw_ring::lse_merge<{t}>") for t in ("__half", "__nv_bfloat16")]


def _merge(xp, out, lse, row0, o_b, lse_b):
    """Rows row0 .. row0 + n of the running result out [B, L, H, D], lse [B, H, L] <- their log-sum-exp merge
    with a block's o_b [B, n, H, D], lse_b [B, H, n]; rows that have seen no key yet stay 0 / -inf. On the GPU
    one kernel (cuda_src/lse_merge.cu); on NumPy the same maths in float64."""
    B, n, H, D = o_b.shape
    if xp is not np:
        if o_b.dtype.name not in _T:
            raise TypeError(f"o_b: expected float16 or bfloat16, got {o_b.dtype}")
        L = out.shape[1]
        if out.dtype != xp.float32 or lse.dtype != xp.float32 or not out.flags.c_contiguous \
                or not lse.flags.c_contiguous or out.shape != (B, L, H, D) or lse.shape != (B, H, L) \
                or lse_b.shape != (B, H, n) or not 0 <= row0 <= L - n:
            raise ValueError(f"_merge: expected contiguous float32 out [B, L, H, D] and lse [B, H, L] with rows "
                             f"{row0}..{row0 + n} inside L, got {out.shape} {out.dtype}, {lse.shape} {lse.dtype}")
        o_b, lse_b = xp.ascontiguousarray(o_b), xp.ascontiguousarray(lse_b, dtype=xp.float32)
        rows = B * n * H
        rt.launch(rt.get_kernel(_SOURCE, f"vbw_ring::lse_merge<{_T[o_b.dtype.name]}>"),
                  (max(1, min(-(-rows // 8), 65535)),), (256,),
                  (out, lse, o_b, lse_b, np.int32(B), np.int32(L), np.int32(row0), np.int32(n),
                   np.int32(H), np.int32(D)))
        return
    out, lse = out[:, row0:row0 + n], lse[:, :, row0:row0 + n]
    new = xp.logaddexp(lse, lse_b)
    safe = xp.where(xp.isfinite(new), new, 0.0)
    w_old = xp.exp(lse - safe).transpose(0, 2, 1)[..., None]
    w_new = xp.exp(lse_b - safe).transpose(0, 2, 1)[..., None]
    out[...] = out * w_old + o_b.astype(out.dtype) * w_new
    lse[...] = new


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy.get_array_module(x)


def selftest_cases():
    def case():
        from .. import _timing, reference
        cp = rt.require_cupy()
        rng = np.random.default_rng(7)
        q, k, v = (rng.standard_normal((1, n, h, 128)).astype(np.float16) for n, h in ((2048, 8), (3000, 2), (3000, 2)))
        want = reference.flash_attention(q, k, v)
        dq, dk, dv = (cp.asarray(a) for a in (q, k, v))
        out, lse = cp.zeros(q.shape, cp.float32), cp.full((1, 8, 2048), -np.inf, cp.float32)
        parts = [flash_attention(dq, dk[:, a:a + 1000], dv[:, a:a + 1000], return_lse=True) for a in (0, 1000, 2000)]
        for o_b, lse_b in parts:
            _merge(cp, out, lse, 0, o_b, lse_b)
        got = out.get().astype(np.float64)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        t = _timing.time_ms(lambda: _merge(cp, out, lse, 0, *parts[0]), warmup=3, rep=20)
        return {"op": "ring lse_merge", "shape": "3 key blocks of 1000, q 2048 x 8/2 heads D=128 float16",
                "error": err, "bound": 2e-3, "ok": bool(err <= 2e-3), "time_ms": t,
                "peer": "copy of the out bytes", "peer_ms": _timing.copy_time_ms(out.nbytes)}
    case.__qualname__ = "ring_attention merge[3 key blocks vs one call]"
    return [case]
