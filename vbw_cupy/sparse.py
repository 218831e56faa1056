"""Block-sparse attention: `block_sparse_attention` over a BSR pattern of kept key blocks, and `bsr_from_mask`.

Layout is flash_attention's (q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], grouped-query heads); the pattern is
FlashInfer's BSR convention: query block qb (rows qb * block_q .. qb * block_q + block_q - 1) attends to the key
blocks indices[indptr[qb]:indptr[qb + 1]] (key block j = keys j * block_k .. j * block_k + block_k - 1). Two
pattern layouts:

- shared: indptr int32 [n_q_blocks + 1], indices int32 [nnz]: one pattern for every (batch, head);
- per (batch, KV head): indptr int32 [B, Hkv, n_q_blocks + 1], indices int32 [B, Hkv, nnz]: each pattern's
  offsets index its own row of indices, so rows of different lengths are padded to the longest (entries past
  a pattern's last offset are never read). Query head h of batch b uses pattern (b, h // (Hq // Hkv)).

NumPy inputs run `vbw_cupy.reference` (float64); GPU inputs run ``attn_sparse_fwd`` of
``cuda_src/attention_sparse.cu`` (mma.sync m16n8k16, sm_80+: one CTA per (query block, head, batch) that
streams only its listed key blocks through double-buffered cp.async tiles, online softmax in fp32). On sm_90
with 16-byte aligned inputs, head dims 64 / 128 / 256 and a block shape that is one of flash_attention's wgmma
tiles (`_WG_TILES`), the SPARSE instance of flash_attention's wgmma + TMA kernel runs instead (the same kernel
as the dense op, iterating the listed key tiles). Work is proportional to the kept blocks.

Index safety without a sync (``check="device"``, the default for GPU patterns): every CTA checks the offsets and
block ids it reads; a query block with a bad one gets NaN rows (and NaN lse) and a flag that
`vbw_cupy.check_errors()` raises as ValueError; nothing is read out of bounds. ``check="host"`` (and NumPy
patterns) read and check the pattern on the host first (a sync for GPU arrays), which also rejects a block
listed twice in a row (the GPU kernels do not look for duplicates: the mma.sync kernel counts a repeated
block twice; the sm_90 kernel refuses a row longer than the number of key blocks, which must repeat one).

Extra device memory beyond q, k, v, o (and lse): none, except contiguous copies of non-contiguous inputs.
"""
from __future__ import annotations

import math

import numpy as np

from . import _checks
from . import _device
from . import _errors
from . import _runtime as rt
from . import _timing
from . import attention as _attn
from . import reference as ref

__all__ = ["block_sparse_attention", "bsr_from_mask", "kernel_instances", "selftest_cases"]

SOURCE = "attention_sparse.cu"
HEAD_DIMS = (64, 128, 256)     # compiled head dims; a real D runs the next one up (columns past D zero-filled)
BLOCK_Q = _checks.SPARSE_BLOCK_Q
BLOCK_K = _checks.SPARSE_BLOCK_K
_BLOCK_N = (64, 32, 16)        # KV tile: the largest whose shared memory fits the device
_SMEM_LIMITS = (232448, 166912, 101376)  # opt-in shared memory per block: sm_90, sm_80, sm_86 / sm_89
# sm_90a: the (block_q, block_k) shapes the wgmma kernel runs, per head dim, as flash_attention configs. D = 128,
# 128 x 128 blocks: the warp-specialized tile (H100, S = 16k, B = 2, H = 16, one run, time / dense
# flash_attention's: 10% kept 0.125 vs 0.143 with the lock-step tile, 100% 1.047 vs 1.126).
_WG_TILES = {64: (_attn._wg(128, 1), _attn._wg(64, 1), _attn._wg(64)), 128: (_attn._ws(128), _attn._wg(64)),
             256: (_attn._wg(64),)}


def head_dim_bucket(D: int) -> int:
    for hd in HEAD_DIMS:
        if D <= hd:
            return hd
    raise ValueError(f"q: expected a head dimension D from 1 to 256, got {D}")


def warps(block_q: int) -> int:
    # one m16 row tile a warp: four warps of two tiles each spill at D = 128 (255 registers)
    return block_q // 16


def smem_bytes(head_dim: int, block_q: int, block_n: int, itemsize: int = 2) -> int:
    """Q [block_q] + K, V [2 stages][block_n] rows of head_dim + 8 elements."""
    return (block_q + 4 * block_n) * (head_dim + 8) * itemsize


def block_n(head_dim: int, block_q: int, smem_limit: int) -> int:
    """The KV tile of a launch: the largest of 64 / 32 / 16 keys whose shared memory fits smem_limit."""
    for n in _BLOCK_N:
        if smem_bytes(head_dim, block_q, n) <= smem_limit:
            return n
    raise ValueError(f"block_q: {block_q} query rows at head dim {head_dim} need more shared memory than the "
                     f"device has ({smem_limit} bytes a block)")


def instance_name(dtype, head_dim: int, block_q: int, bn: int, vec: bool) -> str:
    return (f"attn_sparse_fwd<{rt.ctype(dtype)}, {head_dim}, {block_q}, {bn}, {warps(block_q)}, "
            f"{'true' if vec else 'false'}>")


def kernel_instances(arch: int | None = None) -> list[tuple[str, str]]:
    """Every (file, template instance) this module can launch (fp16 and bf16, the KV tiles of sm_80 / 86 / 90);
    with `arch`, those it can launch on that architecture (its KV tile, the wgmma kernel on sm_90 only)."""
    limits = _SMEM_LIMITS if arch is None else (_SMEM_LIMITS[{90: 0, 80: 1}.get(arch, 2)],)
    out = []
    for dt in ("float16", "bfloat16"):
        for hd in HEAD_DIMS:
            for bq in BLOCK_Q:
                for bn in sorted({block_n(hd, bq, lim) for lim in limits}, reverse=True):
                    for vec in (True, False):
                        out.append((SOURCE, instance_name(dt, hd, bq, bn, vec)))
        if arch in (None, 90):
            out += [(_attn.SOURCE, _attn.instance_name(dt, hd, c, True, True, True))
                    for hd, cs in _WG_TILES.items() for c in cs]
    return out


def _wg_config(q, k, v, o, block_q, block_k, causal, Sq, Sk, n_k_blocks):
    """The wgmma config for this call, or None when the mma.sync kernel runs (not sm_90a, unaligned, another
    head dim or block shape, TMA maps unavailable, or causal with Sq != Sk: the wgmma kernel aligns the
    diagonal bottom-right, this op top-left)."""
    hd = _attn.head_dim_bucket(q.shape[-1])   # the mma.sync bucket: only those of _WG_TILES have wgmma tiles
    if _device.device_arch() != 90 or hd not in _WG_TILES or (causal and Sq != Sk) or not rt.have_tensor_maps():
        return None
    if q.shape[-1] % 8 or any(a.data.ptr % 16 for a in (q, k, v, o)):
        return None
    limit = _device.query_device()["limits"]["smem_optin"]
    for c in _WG_TILES[hd]:
        # the CTA stages its block ids (n_k_blocks ints) in shared memory after the K/V ring
        if (c["BLOCK_M"], c["BLOCK_N"]) == (block_q, block_k) and \
                _attn.smem_bytes(hd, c) + 4 * n_k_blocks + _attn.static_smem_bytes(c) <= limit:
            return c
    return None


# ---------------------------------------------------------------------------------------------- patterns
def bsr_from_mask(mask):
    """A dense boolean block mask as a BSR pattern (indptr, indices) for `block_sparse_attention`.

    mask [n_q_blocks, n_k_blocks] (one shared pattern) or [B, Hkv, n_q_blocks, n_k_blocks] (one per batch and
    KV head); True keeps a block. Returns int32 indptr [n_q_blocks + 1] / [B, Hkv, n_q_blocks + 1] and indices
    [n_q_blocks * n_k_blocks] / [B, Hkv, n_q_blocks * n_k_blocks]: each row's kept block ids in ascending
    order, the tail past indptr[-1] zero padding. NumPy masks give NumPy arrays; CuPy masks give CuPy arrays
    computed with CuPy ops on the device, with no host sync (hence the padded length).

    >>> bsr_from_mask(np.array([[1, 0], [1, 1]], bool))
    (array([0, 1, 3], dtype=int32), array([0, 0, 1, 0], dtype=int32))
    """
    if not isinstance(mask, np.ndarray):
        mask = rt.as_gpu_array(mask, "mask")  # (a TypeError naming `mask` for what is no array, CuPy or not)
    xp = np if isinstance(mask, np.ndarray) else rt.require_cupy()
    if mask.ndim not in (2, 4):
        raise ValueError(f"mask: expected a 2-d [n_q_blocks, n_k_blocks] or 4-d [B, Hkv, n_q_blocks, n_k_blocks] "
                         f"array, got shape {tuple(mask.shape)}")
    if mask.dtype != np.bool_:
        raise TypeError(f"mask: expected a boolean array, got dtype {mask.dtype}")
    nqb, nkb = int(mask.shape[-2]), int(mask.shape[-1])
    if 0 in mask.shape:
        raise ValueError(f"mask: expected at least one query block, key block (and pattern), got shape "
                         f"{tuple(mask.shape)}")
    lead = tuple(int(n) for n in mask.shape[:-2])
    m = mask.reshape(-1, nqb * nkb)
    P = m.shape[0]
    counts = m.reshape(P, nqb, nkb).sum(axis=-1, dtype=xp.int32)
    indptr = xp.zeros((P, nqb + 1), dtype=xp.int32)
    indptr[:, 1:] = xp.cumsum(counts, axis=-1, dtype=xp.int32)
    # kept element -> its rank among the pattern's kept elements (row-major = by row, then ascending block);
    # the others go to a spare last slot, cut off below (no nonzero(), so no sync on the GPU)
    rank = xp.cumsum(m, axis=-1, dtype=xp.int32) - 1
    dest = xp.where(m, rank, nqb * nkb)
    cols = xp.broadcast_to(xp.tile(xp.arange(nkb, dtype=xp.int32), nqb)[None, :], m.shape)
    indices = xp.zeros((P, nqb * nkb + 1), dtype=xp.int32)
    indices[xp.arange(P)[:, None], dest] = xp.where(m, cols, 0)
    indices = xp.ascontiguousarray(indices[:, :-1])
    return indptr.reshape(lead + (nqb + 1,)), indices.reshape(lead + (nqb * nkb,))


# ---------------------------------------------------------------------------------------------- launch
def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


def _sparse_gpu(q, k, v, indptr, indices, *, block_q, block_k, causal, softmax_scale, softcap, return_lse,
                check="device", out=None, lse_out=None):
    cp = rt.require_cupy()
    q, k, v = rt.as_gpu_array(q, "q"), rt.as_gpu_array(k, "k"), rt.as_gpu_array(v, "v")
    ptr = indptr if _is_host(indptr) else rt.as_gpu_array(indptr, "indptr")
    idx = indices if _is_host(indices) else rt.as_gpu_array(indices, "indices")
    host = _checks.check_mode(check) == "host"
    if host:
        _errors.check_errors(op="block_sparse_attention")
    read = host or _is_host(ptr) or _is_host(idx)
    shape = _checks.check_sparse_args(q, k, v, ptr, idx, block_q=block_q, block_k=block_k, causal=causal,
                                      softmax_scale=softmax_scale, softcap=softcap,
                                      dtypes=_checks.GPU_ATTENTION_DTYPES, check_values=read)
    return_lse = _checks.check_flag("return_lse", return_lse)
    causal = _checks.check_flag("causal", causal)
    scale = _checks.effective_scale(softmax_scale, shape.D)
    softcap = _checks.check_softcap(softcap)
    rt.check_same_device(q=q, k=k, v=v, **{n: a for n, a in (("indptr", ptr), ("indices", idx)) if not _is_host(a)})
    B, Sq, Sk, Hq, Hkv, D = shape[:6]
    with q.device:
        q, k, v = rt.ensure_contiguous(q), rt.ensure_contiguous(k), rt.ensure_contiguous(v)
        ptr_d = cp.ascontiguousarray(cp.asarray(ptr, dtype=cp.int32))
        idx_d = cp.ascontiguousarray(cp.asarray(idx, dtype=cp.int32))
        o = _check_out(out, q.shape, q.dtype, "out") if out is not None else cp.empty(q.shape, dtype=q.dtype)
        lse = None
        if return_lse:
            lse = (_check_out(lse_out, (B, Hq, Sq), np.float32, "lse_out") if lse_out is not None
                   else cp.empty((B, Hq, Sq), dtype=cp.float32))
        hd = head_dim_bucket(D)
        wg = _wg_config(q, k, v, o, shape.block_q, shape.block_k, causal, Sq, Sk, shape.n_k_blocks)
        if wg is not None:
            per = shape.patterns > 1
            sp = (ptr_d, idx_d if idx_d.size else rt.NULL, np.int64(shape.n_q_blocks + 1 if per else 0),
                  np.int64(shape.nnz if per else 0), np.int32(shape.nnz), np.int32(shape.n_k_blocks))
            launch = _attn._Launch(q, k, v, o, lse, None, None, B, Sq, Sk, Sq, Sk, Hq, Hkv, D, scale, -1,
                                   0 if causal else -1, softcap, Sq, sparse=sp)
            launch.run(wg)
            return (o, lse) if return_lse else o
        vec = bool(D % 8 == 0 and all(a.data.ptr % 16 == 0 for a in (q, k, v, o)))
        limits = _device.query_device()["limits"]
        bn = block_n(hd, shape.block_q, limits["smem_optin"])
        kern = rt.get_kernel(SOURCE, instance_name(q.dtype, hd, shape.block_q, bn, vec))
        mode, scale_log2, pre = _attn.score_transform(scale, softcap)
        i32 = np.int32
        args = (q, k, v, o, rt.NULL if lse is None else lse, ptr_d, idx_d if idx_d.size else rt.NULL,
                i32(Sq), i32(Sk), i32(Hq), i32(Hq // Hkv), i32(Hkv), i32(D), i32(shape.n_q_blocks),
                i32(shape.n_k_blocks), i32(shape.nnz), i32(shape.patterns > 1), i32(int(math.log2(shape.block_k))),
                i32(causal), np.float32(scale_log2), i32(mode), np.float32(pre), np.int64(Hq * D), np.int64(Hkv * D),
                _errors.buffer(q.data.device_id))
        rt.launch(kern, (shape.n_q_blocks * B * Hq,), (warps(shape.block_q) * 32,), args,
                  shared_mem=smem_bytes(hd, shape.block_q, bn))
    return (o, lse) if return_lse else o


def _check_out(buf, shape, dtype, name):
    cp = rt.require_cupy()
    if not isinstance(buf, cp.ndarray) or tuple(buf.shape) != tuple(shape) or buf.dtype != np.dtype(dtype) \
            or not buf.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous CuPy array of shape {tuple(shape)} and dtype "
                         f"{np.dtype(dtype)}, got {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}")
    return buf


# ---------------------------------------------------------------------------------------------- public
def block_sparse_attention(q, k, v, indptr, indices, *, block_q, block_k, causal=False, softmax_scale=None,
                           softcap=0.0, return_lse=False, check="device"):
    """Attention restricted to a block-sparse pattern (BSR, FlashInfer's convention); see the module docs.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D], float16 or bfloat16 (NumPy inputs: also float32, via the float64
    reference), Hq % Hkv == 0, 1 <= D <= 256. block_q in (16, 64, 128), block_k in (16, 64, 128); n_q_blocks =
    ceil(Sq / block_q), n_k_blocks = ceil(Sk / block_k) (the last blocks may be partial: keys past Sk are never
    seen, rows past Sq never written). Pattern: indptr int32 [n_q_blocks + 1] with indices int32 [nnz] (shared),
    or [B, Hkv, n_q_blocks + 1] with [B, Hkv, nnz] (one per batch and KV head); `bsr_from_mask` builds either
    from a boolean block mask. Query row i of block qb sees key j iff j's block is listed for qb, j < Sk, and,
    with causal=True, j <= i (positions aligned at 0: flash_attention's causal when Sq == Sk). Scores are
    softmax_scale * q.k (default 1/sqrt(D)), then softcap * tanh(s / softcap) when softcap > 0; softmax and
    accumulation in float32. A row that sees no key (an empty row of the pattern, or causal) gets 0 and lse -inf.

    `check`: "device" (default: GPU patterns are checked by the kernel, no sync; see the module docs) or "host".

    Returns o [B, Sq, Hq, D] in q's dtype and, with return_lse=True, lse float32 [B, Hq, Sq] (natural log).

    >>> import cupy as cp
    >>> q = k = v = cp.random.standard_normal((1, 4096, 8, 128)).astype(cp.float16)
    >>> mask = cp.random.random((32, 32)) < 0.1
    >>> indptr, indices = bsr_from_mask(mask)
    >>> o = block_sparse_attention(q, k, v, indptr, indices, block_q=128, block_k=128)
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        _checks.check_array_like(name, a)
    if all(_is_host(a) for a in (q, k, v)):
        for name, a in (("indptr", indptr), ("indices", indices)):
            if not _is_host(a):
                raise TypeError(f"{name}: expected a NumPy array with NumPy q, k, v (NumPy and GPU inputs cannot "
                                f"be mixed), got {type(a).__name__}")
        _checks.check_mode(check)
        _checks.check_sparse_args(q, k, v, indptr, indices, block_q=block_q, block_k=block_k, causal=causal,
                                  softmax_scale=softmax_scale, softcap=softcap)
        return_lse = _checks.check_flag("return_lse", return_lse)
        return ref.block_sparse_attention(q, k, v, indptr, indices, block_q=int(block_q), block_k=int(block_k),
                                          causal=bool(causal), softmax_scale=softmax_scale, softcap=softcap,
                                          return_lse=return_lse)
    if any(_is_host(a) for a in (q, k, v)):
        bad = next(n for n, a in (("q", q), ("k", k), ("v", v)) if _is_host(a))
        raise TypeError(f"{bad}: expected a GPU array like the others (NumPy and GPU inputs cannot be mixed), "
                        "got numpy.ndarray")
    return _sparse_gpu(q, k, v, indptr, indices, block_q=block_q, block_k=block_k, causal=causal,
                       softmax_scale=softmax_scale, softcap=softcap, return_lse=return_lse, check=check)


# ---------------------------------------------------------------------------------------------- selftest
def random_mask(rng, n_q_blocks, n_k_blocks, density, *, causal=False, lead=()):
    """A random boolean block mask with about `density` of the blocks kept (of those on or below the block
    diagonal when causal: blocks right of it would be fully masked), the diagonal block always kept."""
    m = rng.random(lead + (n_q_blocks, n_k_blocks)) < density
    i = np.arange(n_q_blocks)[:, None]
    j = np.arange(n_k_blocks)[None, :]
    if causal:
        m &= j * n_q_blocks < (i + 1) * n_k_blocks  # blocks that start before the query block ends
    m |= (j == np.minimum(i * n_k_blocks // max(n_q_blocks, 1), n_k_blocks - 1))
    return m


def _selftest_case(B, S, Hq, Hkv, D, dtype, density, causal, block=128):
    def case():
        import ml_dtypes
        from .attention import flash_attention
        cp = rt.require_cupy()
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
        rng = np.random.default_rng(7)
        qh = rng.standard_normal((B, S, Hq, D)).astype(dt)
        kh = rng.standard_normal((B, S, Hkv, D)).astype(dt)
        vh = rng.standard_normal((B, S, Hkv, D)).astype(dt)
        n = -(-S // block)
        ptr, idx = bsr_from_mask(random_mask(rng, n, n, density, causal=causal))
        q, k, v = cp.asarray(qh), cp.asarray(kh), cp.asarray(vh)
        pd, id_ = cp.asarray(ptr), cp.asarray(idx)
        kw = dict(block_q=block, block_k=block, causal=causal)
        o = block_sparse_attention(q, k, v, pd, id_, **kw)
        f32 = lambda x: x.astype(np.float32)
        o64 = ref.block_sparse_attention(f32(qh), f32(kh), f32(vh), ptr, idx, **kw)
        low = ref.block_sparse_attention(qh, kh, vh, ptr, idx, lowp=True, **kw)
        err = ref.rel_error(cp.asnumpy(o).astype(np.float32), o64)
        base = ref.rel_error(low.astype(np.float32), o64)
        cap = 2e-3 if dtype == "float16" else 1e-2
        bound = min(2 * base, cap) + 1e-7
        _errors.check_errors(op="block_sparse_attention")
        ms = _timing.time_ms(lambda: block_sparse_attention(q, k, v, pd, id_, **kw), warmup=3, rep=10)
        peer_ms = _timing.time_ms(lambda: flash_attention(q, k, v, causal=causal), warmup=3, rep=10)
        kept = int(ptr[-1]) / (n * n)
        return {"op": "block_sparse_attention", "shape": f"B{B} S{S} H{Hq}/{Hkv} D{D} {dtype} {block}x{block} "
                f"{100 * kept:.0f}% kept{' causal' if causal else ''}", "error": err, "bound": bound,
                "ok": bool(err <= bound), "time_ms": ms, "peer": "flash_attention (dense)", "peer_ms": peer_ms}
    case.__qualname__ = f"block_sparse_attention[S{S},D{D},{dtype},{density:.0%}]"
    return case


def selftest_cases() -> list:
    """Selftest rows: error against the float64 reference, time against dense flash_attention."""
    return [_selftest_case(1, 8192, 8, 2, 128, "float16", 0.1, False),
            _selftest_case(1, 4096, 8, 8, 64, "bfloat16", 0.3, True)]
