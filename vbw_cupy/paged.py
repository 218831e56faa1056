"""Paged-KV decode attention (flash-decoding) and a small paged KV cache to feed it.

`paged_attention` (docs/attention.md) attends one query token per sequence over a KV cache stored in fixed-size
blocks ("pages"). NumPy inputs run `vbw_cupy.reference.paged_attention` (float64); CuPy inputs (or DLPack /
CUDA-array-interface objects) run ``cuda_src/attention_decode.cu``: one CTA per (KV head, sequence, split)
that serves all the query heads of the KV head's group from each K/V load, the KV range of long sequences
split across CTAs when the batch alone does not fill the GPU, and the splits merged by a small second kernel.

`PagedKVCache` holds the caches, a block table, the sequence lengths and a free list of blocks, so a decode
loop needs no index arithmetic (see its docstring).

Tuning: the kernel's (WARPS, STAGES, SPLITS) config is a `vbw_cupy.autotune` Tunable named
``"paged_decode"``. SPLITS = 0 is the built-in heuristic (`heuristic_splits`: the fewest splits within 5%
of the best wave efficiency on the device's CTA slots, at least WARPS 16-token tiles per split); other
values cap the splits of every sequence. Each sequence then splits its own KV range on the device, so short
sequences in a ragged batch use fewer splits. The shape bucket is
(pow2(B), Hkv, Hq / Hkv, padded head dim, pow2(longest sequence, >= 512), block_size); the longest sequence is
read from seq_lens when values are checked, else `max_seqlen`, else max_blocks * block_size.
"""
from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from . import _checks
from . import _device
from . import _errors
from . import _plans
from . import _runtime as rt
from . import _timing
from . import autotune
from . import reference as ref

_SOURCE = "attention_decode.cu"
_STORE_SOURCE = "paged_store.cu"
_DPS = (64, 128, 256)
_CONFIGS = ((4, 2), (4, 3), (2, 3), (8, 2), (2, 2))  # (WARPS, STAGES) the kernel is instantiated for
_EXPLORE_CONFIGS = ((2, 4), (4, 4), (8, 3))          # benchmark sweeps only (not in kernel_instances)
_SPLIT_CHOICES = (0, 1, 2, 4, 8, 16, 32, 64)        # 0 = heuristic
MAX_SPLITS = 256                                     # paged_decode_combine's limit
_TILE = 16
# the fewest 16-token tiles a split gives each warp. 1 (was 2): the 7B decode step (B = 1, 32 / 32 heads, 513-763
# tokens) 2.250-2.255 vs 2.271-2.274 ms in graph replay, three alternations on one H100; alone, in back-to-back
# graph replays, mixed: B = 1 x 512 32 / 8 9.2 vs 10.1 us, 32 / 32 x 640 11.6 vs 11.2, B = 8 x 512 14.6 vs 14.2,
# longer or fuller shapes equal (notes/session-2026-11-26d.md)
_TILES_PER_WARP = 1
_LOG2E = 1.4426950408889634


def _dp(D: int) -> int:
    return 64 if D <= 64 else 128 if D <= 128 else 256


def _smem_bytes(dp: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of paged_decode: the Q tile plus each warp's K and V stages."""
    return _TILE * dp * 2 + warps * stages * 2 * _TILE * dp * 2


def _kernel_name(T: str, dp: int, warps: int, stages: int) -> str:
    return f"paged_decode<{T}, {dp}, {warps}, {stages}>"


def _combine_name(T: str) -> str:
    return f"paged_decode_combine<{T}>"


def _bucket(s: dict) -> tuple:
    return (autotune.pow2_bucket(s["B"]), s["Hkv"], s["G"], s["DP"],
            autotune.pow2_bucket(s["ctx"], lo=512), s["block_size"])


def _fits(cfg: dict, lim: dict) -> bool:
    # the smallest head dim must fit; a larger one that does not is refused by _Launch (ValueError)
    return _smem_bytes(64, cfg["WARPS"], cfg["STAGES"]) <= lim["smem_optin"] and cfg["WARPS"] * 32 <= lim["max_threads"]


def _bench(shape: dict, dtype):
    """Inputs for `vbw-cupy tune`: random cache, shuffled block table, every sequence at ctx tokens."""
    cp = rt.require_cupy()
    B, Hkv, G, D, ctx, bs = (shape[k] for k in ("B", "Hkv", "G", "DP", "ctx", "block_size"))
    nblk = rt.cdiv(ctx, bs)
    rng = np.random.default_rng(0)
    kc = (cp.random.standard_normal((B * nblk, bs, Hkv, D), dtype=cp.float32)).astype(dtype)
    vc = (cp.random.standard_normal((B * nblk, bs, Hkv, D), dtype=cp.float32)).astype(dtype)
    table = cp.asarray(rng.permutation(B * nblk).astype(np.int32).reshape(B, nblk))
    lens = cp.full((B,), ctx, dtype=cp.int32)
    q = cp.random.standard_normal((B, Hkv * G, D), dtype=cp.float32).astype(dtype)
    out = cp.empty_like(q)
    return lambda cfg: _Launch(cfg, q, kc, vc, table, lens, out, 1 / math.sqrt(D), 0.0, -1, ctx).run()


TUNABLE = autotune.register(autotune.Tunable(
    name="paged_decode",
    params=("WARPS", "STAGES", "SPLITS"),
    candidates=tuple(dict(WARPS=w, STAGES=s, SPLITS=n) for (w, s) in _CONFIGS for n in _SPLIT_CHOICES),
    # A100 (164 KB smem / SM): 2 CTAs of 4 warps x 2 stages at D=128; consumer Ampere/Ada (100 KB): 2 warps;
    # Hopper (228 KB): 4 warps x 2 stages, 3 CTAs per SM at D=128, was the best all-round config on H200
    # (bench_decode.py --sweep: B=1 x 32k and B=8 x 4k; B=64 x 4k within 2% of the best with 3 splits).
    defaults={80: dict(WARPS=4, STAGES=2, SPLITS=0), 86: dict(WARPS=2, STAGES=2, SPLITS=0),
              89: dict(WARPS=2, STAGES=2, SPLITS=0), 90: dict(WARPS=4, STAGES=2, SPLITS=0)},
    bucket=_bucket,
    fits=_fits,
    source=_SOURCE,
    standard_shapes=tuple(({"B": b, "Hkv": 8, "G": 4, "DP": 128, "ctx": c, "block_size": 16}, "float16")
                          for b, c in ((1, 32768), (8, 4096), (64, 4096))),
    bench=_bench,
    settled=(90,),  # tuned 0.98-1.03x the defaults on an H100 (notes/autotune.md)
))


def kernel_instances(head_dims=None) -> list[tuple[str, str]]:
    """Every (file, instance) paged_attention and PagedKVCache can launch; with `head_dims` (real D values), those
    of their buckets."""
    dps = _DPS if head_dims is None else sorted({_dp(int(d)) for d in head_dims})
    out = []
    for T in ("__half", "__nv_bfloat16"):
        out += [(_SOURCE, _kernel_name(T, dp, w, s)) for dp in dps for (w, s) in _CONFIGS]
        out.append((_SOURCE, _combine_name(T)))
    out += [(_STORE_SOURCE, f"vbw_store::paged_append<{e}>") for e in ("unsigned short", "float")]
    return out + [(_STORE_SOURCE, "vbw_store::advance_lens")]


# ------------------------------------------------------------------------------------------- the launch
def _occupancy(kernel, threads: int, smem: int) -> int:
    """CTAs per SM from shared memory, registers and threads (an estimate; never below 1)."""
    a = _device.device_attributes()
    smem_sm = int(a.get("MaxSharedMemoryPerMultiprocessor", 228 * 1024))
    at = kernel.attributes
    static = int(at.get("shared_size_bytes", 0))
    regs = max(1, int(at.get("num_regs", 128)))
    by_smem = smem_sm // (smem + static + 1024)
    by_regs = int(a.get("MaxRegistersPerMultiprocessor", 65536)) // (((regs + 7) // 8 * 8) * threads)
    by_threads = int(a.get("MaxThreadsPerMultiProcessor", 2048)) // threads
    return max(1, min(by_smem, by_regs, by_threads, 32))


def _splits_by_len(max_len: int, warps: int) -> int:
    """The most splits that still give each warp _TILES_PER_WARP 16-token tiles of a max_len sequence."""
    return max(1, min(MAX_SPLITS, rt.cdiv(max_len, _TILE) // (_TILES_PER_WARP * warps)))


@functools.lru_cache(maxsize=4096)  # pure in its ints; a new sequence length per decode step otherwise re-scans
def heuristic_splits(ctas: int, slots: int, max_len: int, warps: int) -> int:
    """Split count for `ctas` (sequence, KV head, head tile) CTAs on `slots` resident CTAs (SMs x CTAs per SM).

    Equal CTAs run in ceil(n / slots) waves, so n = ctas * s uses the GPU with efficiency
    n / (ceil(n / slots) * slots). Take the smallest s within 5% of the best efficiency (every split costs a
    partial write and a merge), s <= MAX_SPLITS, and at least _TILES_PER_WARP * warps 16-token tiles of the
    longest sequence per split."""
    by_len = _splits_by_len(max_len, warps)
    ctas, slots = max(1, ctas), max(1, slots)
    eff = [ctas * s / (rt.cdiv(ctas * s, slots) * slots) for s in range(1, by_len + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= 0.95 * best)


class _Launch:
    """Everything one paged_decode call needs (kernels, grid, scratch), so it can be replayed (tuning,
    benchmarks, CUDA graphs) without re-checking arguments."""

    def __init__(self, cfg, q, k_cache, v_cache, block_table, seq_lens, out, scale, softcap, left, max_len,
                 explore=False):
        cp = rt.require_cupy()
        B, Hq, D = (int(n) for n in q.shape)
        _, bs, Hkv, _ = (int(n) for n in k_cache.shape)
        G = Hq // Hkv
        HT = rt.cdiv(G, 16)
        dp = _dp(D)
        W, S = int(cfg["WARPS"]), int(cfg["STAGES"])
        if (W, S) not in _CONFIGS + (_EXPLORE_CONFIGS if explore else ()):
            raise ValueError(f"paged_decode: no instance for WARPS={W}, STAGES={S} (have {_CONFIGS})")
        smem = _smem_bytes(dp, W, S)
        optin = int(_device.device_attributes().get("MaxSharedMemoryPerBlockOptin", 48 * 1024))
        if smem > optin:
            raise ValueError(f"paged_decode: WARPS={W}, STAGES={S} at head dim {dp} needs {smem} bytes of shared "
                             f"memory, the device allows {optin}")
        T = rt.ctype(q.dtype)
        self.kernel = rt.get_kernel(_SOURCE, _kernel_name(T, dp, W, S))
        ctas = B * Hkv * HT
        splits = int(cfg.get("SPLITS", 0))
        if splits <= 0:
            slots = _device.num_sms() * _occupancy(self.kernel, W * 32, smem)
            splits = heuristic_splits(ctas, slots, max_len, W)
        splits = max(1, min(splits, _splits_by_len(max_len, W)))
        self.splits = splits
        vec16 = (D % 8 == 0 and k_cache.data.ptr % 16 == 0 and v_cache.data.ptr % 16 == 0)
        if softcap > 0:
            qk_scale, cap2 = scale / softcap, softcap * _LOG2E
        else:
            qk_scale, cap2 = scale * _LOG2E, 0.0
        Dp = rt.cdiv(D, 4) * 4        # partial rows padded for the combine kernel's 16-byte loads
        if splits > 1:  # the stream's scratch (never the pool inside a call: graphs keep these addresses)
            n_o, n_lse = B * Hq * splits * Dp, B * Hq * splits
            buf = _plans.scratch("paged_attention partials", 4 * (n_o + n_lse)).view(cp.float32)
            self.o_part, self.lse_part = buf[:n_o], buf[n_o:n_o + n_lse]
            self.combine = rt.get_kernel(_SOURCE, _combine_name(T))
        else:  # the kernel writes `out` directly and never touches these
            self.o_part = self.lse_part = _plans.scratch("paged_attention partials", 4).view(cp.float32)[:1]
            self.combine = None
        capacity = min(int(block_table.shape[1]) * bs, 2**31 - 1)
        if left >= capacity:  # no sequence is that long: unbounded, and the kernel's int32 stays in range
            left = -1
        err = _errors.buffer(q.data.device_id)
        min_tiles = _TILES_PER_WARP * W
        self.grid = (splits, Hkv * HT, B)
        self.block = (W * 32,)
        self.smem = smem
        self.args = (q, k_cache, v_cache, block_table, seq_lens, out, self.o_part, self.lse_part,
                     np.int32(Hq), np.int32(Hkv), np.int32(G), np.int32(D), np.int32(block_table.shape[1]),
                     np.int32(int(bs).bit_length() - 1), np.float32(qk_scale), np.float32(cap2), np.int32(left),
                     np.int32(splits), np.int32(min_tiles), np.int32(1 if vec16 else 0), np.int32(Dp),
                     np.int32(k_cache.shape[0]), err)
        self.cargs = (self.o_part, self.lse_part, seq_lens, out, np.int32(Hq), np.int32(D), np.int32(Dp),
                      np.int32(left), np.int32(splits), np.int32(min_tiles), np.int32(W), np.int32(capacity))
        self.cgrid = (Hq, B)
        self.kv_bytes = None

    def run(self):
        rt.launch(self.kernel, self.grid, self.block, self.args, shared_mem=self.smem)
        if self.combine is not None:
            rt.launch(self.combine, self.cgrid, (128,), self.cargs)


# ------------------------------------------------------------------------------------- the public call
def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                    window=(-1, -1), check="device", max_seqlen=None, out=None):
    """Decode attention over a paged KV cache: one query token per sequence (docs/attention.md).

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table int32 [B, max_blocks];
    seq_lens int32 [B]. float16 or bfloat16 (NumPy inputs also float32), Hq % Hkv == 0 (query head h reads
    KV head h // (Hq // Hkv)), 1 <= D <= 256, block_size a power of two from 1 to 256. Token t of sequence
    b is k_cache[block_table[b, t // block_size], t % block_size]. The query is the sequence's last token and
    sees keys [max(0, seq_lens[b] - 1 - left), seq_lens[b]) with (left, right) = window (-1: unbounded;
    right cannot reach past the query). Scores are softmax_scale * q.k (default 1/sqrt(D)), then
    softcap * tanh(s / softcap) when softcap > 0 (|softmax_scale| <= 2^64, softcap 0 or in [2^-32, 2^64], as in
    flash_attention; a left window past every sequence is unbounded). Accumulation in float32. Returns
    [B, Hq, D] in q's dtype (written into `out` when given: a C-contiguous GPU array of that shape and dtype).

    Checks: dtypes, ranks, shapes (q against the caches and tables), window, softcap and scale are checked from
    the shapes on the host at no cost. The VALUES of seq_lens (each in [1, max_blocks * block_size]) and of the
    block_table entries in use (each in [0, num_blocks)):
    - ``check="device"`` (default): checked by the kernel as it reads them; the call copies nothing to the host
      and does not synchronize. A sequence with a bad value gets NaN output rows, nothing out of bounds is
      read, and `vbw_cupy.check_errors()` (or a later ``check="host"`` call) raises ValueError naming it.
    - ``check="host"``: both arrays are copied to the host and checked before the launch (a GPU array's copy
      synchronizes the stream); ValueError at once. ``True`` / ``False`` mean "host" / "device".

    `max_seqlen` (optional, host int) bounds seq_lens; it picks the split count when values are not read on the
    host (default bound max_blocks * block_size). Where the values are read (check="host", NumPy inputs) a
    max_seqlen below the longest sequence raises ValueError; otherwise a longer sequence is still computed
    correctly, only with fewer splits than it could use. Launch shapes never depend on seq_lens' values, so a
    check="device" call can be captured in a CUDA graph and replayed as the sequences grow.

    Host cost: a call whose shapes, dtypes, options, device, stream and tuning state match an earlier checked
    call reuses that call's launch plan, re-checking only array types, contiguity, devices, the caches'
    alignment and (check="host") the values.

    >>> import cupy as cp
    >>> q = cp.random.standard_normal((2, 32, 128), dtype=cp.float32).astype(cp.float16)
    >>> kc = cp.random.standard_normal((64, 16, 8, 128), dtype=cp.float32).astype(cp.float16)
    >>> table = cp.arange(64, dtype=cp.int32).reshape(2, 32)[:, ::-1].copy()   # any block order
    >>> o = paged_attention(q, kc, kc, table, cp.asarray([300, 17], dtype=cp.int32))  # o.shape == (2, 32, 128)
    """
    # Fast path: GPU arrays whose shapes, dtypes, options (types and values), device, stream and autotune state
    # match an earlier call that was checked in full below reuse its launch plan; only what can differ between
    # such calls is checked again: array types, contiguity, devices, the caches' 16-byte alignment, and with
    # check="host" the values of seq_lens and block_table.
    cp = rt.cupy
    fkey = None
    if cp is not None and type(q) is cp.ndarray:
        try:
            fkey = _fast_key(cp, q, k_cache, v_cache, block_table, seq_lens, softmax_scale, softcap, window, check,
                             max_seqlen, out)
            sig = _sigs.get(fkey)
        except (TypeError, AttributeError):  # unhashable or array-less arguments: the full path says what is wrong
            fkey = sig = None
        if sig is not None:
            nd, dev = cp.ndarray, sig.dev
            if (type(k_cache) is nd and type(v_cache) is nd and type(block_table) is nd and type(seq_lens) is nd
                    and (out is None or type(out) is nd and out.flags.c_contiguous and out.data.device_id == dev)
                    and q.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
                    and block_table.flags.c_contiguous and seq_lens.flags.c_contiguous
                    and q.data.device_id == dev and k_cache.data.device_id == dev
                    and v_cache.data.device_id == dev and block_table.data.device_id == dev
                    and seq_lens.data.device_id == dev and (k_cache.data.ptr | v_cache.data.ptr) % 16 == 0):
                plan = sig.plan
                if plan is None:  # check="host": the values, then the plan of the longest sequence
                    _errors.check_errors(op="paged_attention")
                    _, lens = _checks.check_paged_values(block_table, seq_lens, sig.num_blocks, sig.block_size)
                    _check_max_seqlen(max_seqlen, lens)
                    max_len = int(lens.max())
                    plan = sig.plans.get(max_len)
                    if plan is None:
                        plan, out = _plan(sig.cfg_args, q, k_cache, v_cache, block_table, seq_lens, out, max_len)
                        sig.plans.put(max_len, plan)
                        return out
                return plan.run(q, k_cache, v_cache, block_table, seq_lens, out)
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    if _checks.split_host_device(**arrays):
        if out is not None:
            raise TypeError("out: only supported for GPU arrays (the reference path allocates its result)")
        _checks.check_mode(check)
        _check_max_seqlen(max_seqlen, seq_lens)
        _checks.check_paged_args(q, k_cache, v_cache, block_table, seq_lens, window, softcap,
                                 softmax_scale=softmax_scale)
        return ref.paged_attention(q, k_cache, v_cache, block_table, seq_lens, softmax_scale=softmax_scale,
                                   softcap=softcap, window=window)
    cp = rt.require_cupy()
    given = (q, k_cache, v_cache, block_table, seq_lens)
    arrays = {n: rt.as_gpu_array(a, n) for n, a in arrays.items()}
    rt.check_same_device(**arrays)
    q, k_cache, v_cache, block_table, seq_lens = arrays.values()
    check = _checks.check_mode(check) == "host"
    if check:
        _errors.check_errors(op="paged_attention")
    shape = _checks.check_paged_args(q, k_cache, v_cache, block_table, seq_lens, window, softcap,
                                     softmax_scale=softmax_scale, dtypes=_checks.GPU_ATTENTION_DTYPES,
                                     check_values=check)
    left, _ = _checks.check_window(window)
    scale = _checks.effective_scale(softmax_scale, shape.D)
    softcap_f = _checks.check_softcap(softcap)
    B, Hq, Hkv, D = shape.B, shape.Hq, shape.Hkv, shape.D
    if shape.num_blocks * shape.block_size * Hkv >= 2 ** 31:
        raise ValueError(f"k_cache: expected fewer than 2^31 token-head rows (num_blocks * block_size * Hkv), "
                         f"got {shape.num_blocks} * {shape.block_size} * {Hkv}")
    if B > 65535 or Hkv * rt.cdiv(Hq // Hkv, 16) > 65535:
        raise ValueError(f"q: expected B <= 65535 and Hkv * ceil(Hq / Hkv / 16) <= 65535, got B={B}, Hq={Hq}, "
                         f"Hkv={Hkv}")
    capacity = shape.max_blocks * shape.block_size
    _check_max_seqlen(max_seqlen, shape.seq_lens)
    if shape.seq_lens is not None:
        max_len = int(shape.seq_lens.max())
    elif max_seqlen is not None:
        max_len = min(int(max_seqlen), capacity)
    else:
        max_len = capacity
    dev = q.device.id
    # the fast path may replay this call if the arrays were used as given (no copies) on the current device
    key = None
    if fkey is not None and all(a is b for a, b in zip(given, arrays.values())) and \
            all(a.flags.c_contiguous for a in given) and (k_cache.data.ptr | v_cache.data.ptr) % 16 == 0 and \
            cp.cuda.runtime.getDevice() == dev:
        key = fkey
    with cp.cuda.Device(dev):
        q, k_cache, v_cache = (rt.ensure_contiguous(a) for a in (q, k_cache, v_cache))
        block_table, seq_lens = rt.ensure_contiguous(block_table), rt.ensure_contiguous(seq_lens)
        if out is not None:
            if not rt.is_gpu_array(out) or tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype \
                    or not out.flags.c_contiguous:
                raise ValueError(f"out: expected a C-contiguous CuPy array of shape {tuple(q.shape)} and dtype "
                                 f"{q.dtype}, got {type(out).__name__} {getattr(out, 'shape', None)} "
                                 f"{getattr(out, 'dtype', None)}")
            rt.check_same_device(q=q, out=out)
        cfg_args = (scale, softcap_f, left, B, Hkv, Hq // Hkv, _dp(D), shape.block_size)
        plan, out = _plan(cfg_args, q, k_cache, v_cache, block_table, seq_lens, out, max_len)
        if key is not None and not cp.cuda.get_current_stream().is_capturing():
            plans = None
            if check:
                plans = _plans.PlanCache()  # one per longest sequence length
                plans.put(max_len, plan)
            _sigs.put(key, _Signature(dev, shape.num_blocks, shape.block_size, cfg_args,
                                      None if check else plan, plans))
    return out


# ------------------------------------------------------------------------------------------- launch plans
_sigs = _plans.PlanCache()  # _fast_key(...) -> _Signature


def _check_max_seqlen(max_seqlen, lens=None) -> None:
    """max_seqlen, when given, is a positive int; where seq_lens' values are read (lens), it must bound them."""
    if max_seqlen is None:
        return
    if not _checks._is_int(max_seqlen) or int(max_seqlen) < 1:
        raise ValueError(f"max_seqlen: expected a positive int, got {max_seqlen!r}")
    if lens is None:
        return
    lens = np.asarray(lens)
    if lens.ndim == 1 and lens.size and lens.dtype.kind in "iu" and int(lens.max()) > int(max_seqlen):
        raise ValueError(f"max_seqlen: {int(max_seqlen)} is below the longest sequence in seq_lens "
                         f"({int(lens.max())})")


def _fast_key(cp, q, k_cache, v_cache, block_table, seq_lens, softmax_scale, softcap, window, check, max_seqlen,
              out):
    """What a checked call's outcome depends on besides the per-call checks of the fast path. Options go in
    with their types: True == 1 and 1 == 1.0, but they do not pass the same checks."""
    return (q.shape, q.dtype, k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype, block_table.shape,
            block_table.dtype, seq_lens.shape, seq_lens.dtype, type(softmax_scale), softmax_scale,
            type(softcap), softcap, type(window), window, tuple(map(type, window)), type(check), check,
            type(max_seqlen), max_seqlen, None if out is None else (type(out), out.shape, out.dtype),
            cp.cuda.runtime.getDevice(), _plans.stream_key(), autotune.mode(),
            autotune.generation(TUNABLE.name), _FAST_LAUNCH)


class _Signature:
    """A fully checked call signature: its device, what the value checks need, and its launch plan
    (check="device": one; check="host": one per longest sequence length, in `plans`)."""
    __slots__ = ("dev", "num_blocks", "block_size", "cfg_args", "plan", "plans")

    def __init__(self, dev, num_blocks, block_size, cfg_args, plan, plans):
        self.dev, self.num_blocks, self.block_size = dev, num_blocks, block_size
        self.cfg_args, self.plan, self.plans = cfg_args, plan, plans


class _Plan:
    """One call's launches (from its _Launch) with the arrays left out, to replay on same-signature arrays.
    The split-K partials are the stream's scratch, fixed when the plan is made (the plan is per stream).
    Replays go through `_plans.Launch` (arguments packed once) where the kernel exposes its driver handle."""
    __slots__ = ("kernel", "grid", "block", "smem", "tail", "combine", "cgrid", "ctail", "o_part", "lse_part",
                 "fast", "cfast")

    def __init__(self, launch):
        self.kernel, self.grid, self.block, self.smem = launch.kernel, launch.grid, launch.block, launch.smem
        self.tail, self.combine, self.cgrid, self.ctail = launch.args[8:], launch.combine, launch.cgrid, \
            launch.cargs[4:]
        self.o_part, self.lse_part = launch.o_part, launch.lse_part
        self.fast = self.cfast = None
        if _FAST_LAUNCH and _plans.kernel_ptr(self.kernel) is not None:
            self.fast = _plans.Launch(self.kernel, self.grid, self.block, launch.args, range(6), self.smem)
            if self.combine is not None:
                self.cfast = _plans.Launch(self.combine, self.cgrid, (128,), launch.cargs, (2, 3))

    def run(self, q, k_cache, v_cache, block_table, seq_lens, out):
        cp = rt.cupy
        if out is None:
            out = cp.empty(q.shape, dtype=q.dtype)
        if self.fast is not None:
            stream = cp.cuda.get_current_stream().ptr
            self.fast((q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, block_table.data.ptr, seq_lens.data.ptr,
                       out.data.ptr), stream)
            if self.cfast is not None:
                self.cfast((seq_lens.data.ptr, out.data.ptr), stream)
            return out
        self.kernel(self.grid, self.block, (q, k_cache, v_cache, block_table, seq_lens, out, self.o_part,
                                            self.lse_part) + self.tail, shared_mem=self.smem)
        if self.combine is not None:
            self.combine(self.cgrid, (128,), (self.o_part, self.lse_part, seq_lens, out) + self.ctail)
        return out


_FAST_LAUNCH = True  # replay plans through _plans.Launch (False: CuPy's kernel call, for A/B runs)


def _plan(cfg_args, q, k_cache, v_cache, block_table, seq_lens, out, max_len):
    """Pick the config (autotune), build the _Launch and launch it once into `out` (allocated if None): returns
    (its _Plan, out). The arrays are checked, contiguous and on the current device."""
    cp = rt.cupy
    scale, softcap, left, B, Hkv, G, dp, bs = cfg_args
    if out is None:
        out = cp.empty(q.shape, dtype=q.dtype)
    args = (q, k_cache, v_cache, block_table, seq_lens, out, scale, softcap, left, max_len)
    key_shape = {"B": B, "Hkv": Hkv, "G": G, "DP": dp, "ctx": max_len, "block_size": bs}
    cfg = autotune.pick(TUNABLE.name, key_shape, q.dtype, lambda c: _Launch(c, *args).run())
    try:
        launch = _Launch(cfg, *args)
    except ValueError:  # a tuned/default config that does not fit this head dim: the smallest one
        launch = _Launch(dict(WARPS=2, STAGES=2, SPLITS=cfg.get("SPLITS", 0)), *args)
    launch.run()
    return _Plan(launch), out


def _launch_for(q, k_cache, v_cache, block_table, seq_lens, out, cfg=None, *, softmax_scale=None, softcap=0.0,
                window=(-1, -1), max_seqlen=None, explore=False):
    """A replayable _Launch for already-valid CuPy arguments (benchmarks, tests of every config)."""
    D = int(q.shape[-1])
    scale = _checks.effective_scale(softmax_scale, D)
    left, _ = _checks.check_window(window)
    max_len = max_seqlen or int(block_table.shape[1]) * int(k_cache.shape[1])
    if cfg is None:
        cfg = autotune.default_config(TUNABLE.name)
    return _Launch(cfg, q, k_cache, v_cache, block_table, seq_lens, out, scale, float(softcap), left, max_len,
                   explore=explore)


# ------------------------------------------------------------------------------------------ the KV cache
_DEVICES = {"cpu": "numpy", "gpu": "cupy"}


def _array_module(device, xp):
    """PagedKVCache's array module from `device` ("cpu" / "gpu") or `xp` (a module or its name); neither given:
    CuPy when a GPU is visible, else NumPy (so a CPU-only machine never touches CUDA)."""
    if device is not None and xp is not None:
        raise ValueError(f"device={device!r}, xp={xp!r}: give one of the two")
    if device is not None:
        if device not in _DEVICES:
            raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
        xp = _DEVICES[device]
        if device == "gpu" and not rt.gpu_available():
            if not rt.have_cupy():
                rt.require_cupy()   # (says what to install)
            raise RuntimeError("device='gpu': no usable CUDA device is visible (CuPy installed with a GPU and driver "
                               "is needed; device='cpu' runs the NumPy reference)")
    elif xp is None:
        xp = "cupy" if rt.gpu_available() else "numpy"
    if isinstance(xp, str):
        if xp not in ("numpy", "cupy"):
            raise ValueError(f"xp: expected numpy, cupy, 'numpy' or 'cupy', got {xp!r}")
        return np if xp == "numpy" else rt.require_cupy()
    if xp is np or (rt.have_cupy() and xp is rt.cupy):
        return xp
    raise ValueError(f"xp: expected numpy, cupy, 'numpy' or 'cupy', got {xp!r}")


def _on_cache_device(method):
    """Run a PagedKVCache method with the cache's GPU current (its launches, index arrays and gathers go to the
    device that holds the cache, whatever device the caller has current)."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        if self.xp is np or rt.cupy.cuda.runtime.getDevice() == self.k_cache.data.device_id:
            return method(self, *args, **kw)   # (the usual case: no device switch on a decode step's host path)
        with rt.cupy.cuda.Device(self.k_cache.data.device_id):
            return method(self, *args, **kw)
    return run


class PagedKVCache:
    """A paged KV cache for decoding: plain arrays inside, block allocation and index arithmetic done for you.

    Where it lives: ``device="gpu"`` (CuPy arrays, the CUDA kernels) or ``"cpu"`` (NumPy arrays, the float64
    reference); the default is "gpu" when CuPy sees a GPU, else "cpu". ``xp`` (the module ``numpy`` / ``cupy``
    or the string "numpy" / "cupy") says the same thing the older way; give one of the two.

    Arrays (NumPy or CuPy; read them freely, write them only through the methods):
      k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim] of `dtype`
      block_table       int32 [max_batch, max_blocks_per_seq]: block ids of each sequence slot, in order
      seq_lens          int32 [max_batch]: tokens stored per sequence slot (0 = free slot)
    and a host-side free list of blocks. Sequence slots are the rows 0..max_batch-1.

    - ``append(k_new, v_new, seqs=None)``: adds one token (k_new [B, Hkv, D]) or T tokens (k_new [B, T, Hkv, D])
      to each of the sequences `seqs` (default 0..B-1), allocating blocks as they fill. Raises MemoryError,
      changing nothing, when the free blocks or a sequence's table row would run out.
    - ``attention(q, seqs=None, **kw)``: `paged_attention` of q [B, Hq, D] over those sequences (no
      device-to-host copy: the kernel checks the values it reads).
    - ``free(seq)``: returns a sequence's blocks to the free list and empties its slot.
    - CUDA graphs: on the GPU, ``append`` writes at the lengths held on the device and advances them there, and
      ``attention`` allocates nothing on a repeated call but its result, so both can be captured (keep the
      captured result alive: the graph writes to that address on every replay). A replay cannot allocate
      blocks: call ``reserve(tokens, seqs)`` before capturing (table entries not yet allocated hold -1, so a
      replay past the reservation is flagged, not written anywhere), and ``sync_lengths()`` after replays to
      bring the host's copy of the lengths up to date.

    Example, a greedy decode loop over a batch of 8 (``model`` is yours)::

        cache = PagedKVCache(num_blocks=8 * 256, block_size=16, num_kv_heads=8, head_dim=128,
                             dtype=cupy.float16, max_batch=8, max_blocks_per_seq=256)
        cache.append(k_prompt, v_prompt)              # [8, T, 8, 128]: the prompts, T tokens each
        for step in range(max_new_tokens):
            q, k, v = model.qkv(tokens)                # [8, 32, 128], [8, 8, 128], [8, 8, 128]
            cache.append(k, v)                         # every sequence grows by one token
            o = cache.attention(q)                     # [8, 32, 128]
            tokens = model.next(o)
        cache.free(3)                                  # sequence 3 finished: its blocks are reusable
    """

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=np.float16, *, max_batch,
                 max_blocks_per_seq, device=None, xp=None):
        xp = _array_module(device, xp)
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("max_batch", max_batch), ("max_blocks_per_seq", max_blocks_per_seq)):
            if not _checks._is_int(v) or not 1 <= int(v) < 2**31:  # block ids and lengths are int32
                raise ValueError(f"{name}: expected a positive int below 2^31, got {v!r}")
        if int(max_blocks_per_seq) * int(block_size) >= 2**31:
            raise ValueError(f"max_blocks_per_seq: {max_blocks_per_seq} blocks of {block_size} tokens pass int32 "
                             "seq_lens (2^31 - 1 tokens)")
        if block_size > _checks.MAX_BLOCK_SIZE or block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two from 1 to {_checks.MAX_BLOCK_SIZE}, "
                             f"got {block_size}")
        if not 1 <= head_dim <= _checks.MAX_HEAD_DIM:
            raise ValueError(f"head_dim: expected 1 to {_checks.MAX_HEAD_DIM}, got {head_dim}")
        dtype = _checks.check_float_dtype("dtype", dtype)
        self.xp = xp
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        shape = (int(num_blocks), int(block_size), int(num_kv_heads), int(head_dim))
        self.k_cache = xp.zeros(shape, dtype=dtype)
        self.v_cache = xp.zeros(shape, dtype=dtype)
        self.block_table = xp.full((int(max_batch), int(max_blocks_per_seq)), -1, dtype=np.int32)  # -1: none yet
        self.seq_lens = xp.zeros((int(max_batch),), dtype=np.int32)
        self._lens = np.zeros(int(max_batch), dtype=np.int64)
        self._table = np.zeros((int(max_batch), int(max_blocks_per_seq)), dtype=np.int64)
        self._nblk = np.zeros(int(max_batch), dtype=np.int64)           # blocks owned per slot
        self._free = list(range(int(num_blocks) - 1, -1, -1))           # pop() hands out block 0 first
        self._slot_arrays: dict = {}   # slot list -> device int32 array (see _device_slots)
        self._gathers: dict = {}       # slot list -> (block_table rows, seq_lens) buffers (see attention)
        self._retired: list = []       # evicted buffers of those two: kept for graphs captured over them

    # -- bookkeeping
    @property
    def max_batch(self) -> int:
        return int(self._lens.shape[0])

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def lengths(self, seqs=None) -> np.ndarray:
        """Host copy of the sequence lengths (no device access)."""
        if seqs is None:
            return self._lens.copy()
        return self._lens[self._slots(seqs, len(np.atleast_1d(seqs)))].copy()

    def _slots(self, seqs, B, name="seqs"):
        """Slot ids of `seqs` (default 0..B-1); `name` is the argument whose batch size B is."""
        if seqs is None:
            if B > self.max_batch:
                raise ValueError(f"{name}: {B} sequences but the cache has max_batch={self.max_batch} slots")
            return np.arange(B)
        items = seqs.tolist() if hasattr(seqs, "tolist") else seqs
        items = items if isinstance(items, (list, tuple)) else [items]
        if not all(_checks._is_int(i) for i in items):
            raise TypeError(f"seqs: expected None or a list of {B} slot ids (ints), got {seqs!r}")
        s = np.asarray(items, dtype=np.int64).reshape(-1) if items else np.zeros(0, np.int64)
        if s.size != B or (s.size and (s.min() < 0 or s.max() >= self.max_batch)) or np.unique(s).size != s.size:
            raise ValueError(f"seqs: expected {B} distinct slots in [0, {self.max_batch}) ({name} has {B} rows), "
                             f"got {s.tolist()}")
        return s

    @_on_cache_device
    def append(self, k_new, v_new, seqs=None) -> None:
        """Append one token per sequence (k_new, v_new [B, Hkv, D]) or T tokens each ([B, T, Hkv, D])."""
        xp = self.xp
        _, bs, Hkv, D = self.k_cache.shape
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if not hasattr(x, "shape") or x.ndim not in (3, 4) or tuple(x.shape[-2:]) != (Hkv, D):
                raise ValueError(f"{name}: expected shape [B, {Hkv}, {D}] or [B, T, {Hkv}, {D}], "
                                 f"got {getattr(x, 'shape', type(x).__name__)}")
            if np.dtype(x.dtype) != self.k_cache.dtype:
                raise TypeError(f"{name}: expected dtype {self.k_cache.dtype}, got {x.dtype}")
            if (xp is np) != _is_numpy(x):
                raise TypeError(f"{name}: expected a {'NumPy' if xp is np else 'GPU'} array like the cache, "
                                f"got {type(x).__name__}")
        if tuple(k_new.shape) != tuple(v_new.shape):
            raise ValueError(f"v_new: expected the shape of k_new {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
        if xp is not np:
            rt.check_same_device(k_cache=self.k_cache, k_new=k_new, v_new=v_new)
        if k_new.ndim == 3:
            k_new, v_new = k_new[:, None], v_new[:, None]
        B, T = int(k_new.shape[0]), int(k_new.shape[1])
        if xp is not np and B > 65535:  # (the store's grid has a row a sequence; CUDA grids: 65535)
            raise ValueError(f"k_new: at most 65535 sequences a call on the GPU, got {B}")
        slots = self._slots(seqs, B, "k_new")
        if T == 0 or B == 0:
            return
        # plan every allocation before changing anything
        new_len = self._lens[slots] + T
        need_blocks = -(-new_len // bs)
        if (need_blocks > self._table.shape[1]).any():
            i = int(np.argmax(need_blocks > self._table.shape[1]))
            raise MemoryError(f"sequence {int(slots[i])} would reach {int(new_len[i])} tokens, over max_blocks_per_seq "
                              f"* block_size = {self._table.shape[1] * bs}")
        extra = np.maximum(need_blocks - self._nblk[slots], 0)   # reserve() may have allocated ahead
        if int(extra.sum()) > len(self._free):
            raise MemoryError(f"PagedKVCache: {int(extra.sum())} new blocks needed, {len(self._free)} free")
        if xp is not np and extra.any() and rt.cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError("PagedKVCache.append: new blocks are needed while a CUDA graph is being captured; "
                               "call reserve(tokens, seqs) before capturing")
        self._allocate(slots, extra)
        if xp is np:
            pos = self._lens[slots][:, None] + np.arange(T)[None, :]                     # [B, T]
            flat = self._table[slots[:, None], pos // bs] * bs + pos % bs               # row in [num_blocks * bs]
            self.k_cache.reshape(-1, Hkv, D)[flat.reshape(-1)] = k_new.reshape(-1, Hkv, D)
            self.v_cache.reshape(-1, Hkv, D)[flat.reshape(-1)] = v_new.reshape(-1, Hkv, D)
            self.seq_lens[slots] = new_len
        else:  # positions from the device lengths: no host values, so a captured append replays step after step
            k_new, v_new = rt.ensure_contiguous(k_new), rt.ensure_contiguous(v_new)
            dev = self._device_slots(slots)
            elem = "float" if self.k_cache.dtype == np.float32 else "unsigned short"
            err = _errors.buffer(self.k_cache.data.device_id)
            rt.launch(rt.get_kernel(_STORE_SOURCE, f"vbw_store::paged_append<{elem}>"), (T, B), (128,),
                      (k_new, v_new, dev, self.seq_lens, self.block_table, np.int32(self.max_batch),
                       np.int32(self._table.shape[1]), np.int32(self.num_blocks), np.int32(bs), self.k_cache,
                       self.v_cache, np.int32(T), np.int32(Hkv * D), err))
            rt.launch(rt.get_kernel(_STORE_SOURCE, "vbw_store::advance_lens"), (-(-B // 128),), (128,),
                      (self.seq_lens, dev, np.int32(B), np.int32(self.max_batch), np.int32(T)))
        self._lens[slots] = new_len

    @_on_cache_device
    def reserve(self, tokens: int, seqs=None) -> None:
        """Allocate now the blocks that `tokens` more tokens of each sequence `seqs` (default: every slot that
        holds tokens) will need, so that appends of up to that many tokens allocate nothing: what a CUDA graph
        that captures `append` needs (its replays write at the device lengths and cannot allocate)."""
        if not _checks._is_int(tokens) or int(tokens) < 0:
            raise (ValueError if _checks._is_int(tokens) else TypeError)(
                f"tokens: expected an int >= 0, got {tokens!r}")
        self._not_capturing("reserve")
        slots = np.flatnonzero(self._lens > 0) if seqs is None else self._slots(seqs, len(np.atleast_1d(seqs)))
        cap = self._table.shape[1] * self.block_size
        more = min(int(tokens), cap + 1)  # (past any sequence's capacity either way; int64 arithmetic below)
        need = -(-(self._lens[slots] + more) // self.block_size)
        if (need > self._table.shape[1]).any():
            raise MemoryError(f"reserve: {int(tokens)} more tokens pass max_blocks_per_seq * block_size = {cap} "
                              f"for some sequence of {list(slots)}")
        extra = np.maximum(need - self._nblk[slots], 0)
        if int(extra.sum()) > len(self._free):
            raise MemoryError(f"PagedKVCache: {int(extra.sum())} new blocks needed, {len(self._free)} free")
        self._allocate(slots, extra)

    def sync_lengths(self) -> np.ndarray:
        """Read the device lengths into the host mirror (a sync) after replaying a captured append, which
        advances only the device's seq_lens; returns them."""
        self._lens = np.asarray(self.seq_lens.get() if self.xp is not np else self.seq_lens, dtype=np.int64)
        return self._lens.copy()

    def _allocate(self, slots, extra) -> None:
        """Give slot slots[i] extra[i] more blocks from the free list (checked by the caller)."""
        rows, cols, ids = [], [], []
        for s, e in zip(slots, extra):
            for _ in range(int(e)):
                c = int(self._nblk[s])
                self._table[s, c] = self._free.pop()
                self._nblk[s] += 1
                rows.append(s), cols.append(c), ids.append(self._table[s, c])
        if not rows:
            return
        if self.xp is np:
            self.block_table[np.array(rows), np.array(cols)] = np.array(ids, dtype=np.int32)
        else:
            xp = self.xp
            self.block_table[xp.asarray(np.array(rows)), xp.asarray(np.array(cols))] = \
                xp.asarray(np.array(ids, dtype=np.int32))

    def _device_slots(self, slots):
        """int32 device array of `slots`, kept per distinct slot list (no host-to-device copy on a repeated
        call, so the call can be captured)."""
        key = slots.tobytes()
        a = self._slot_arrays.get(key)
        if a is None:
            if len(self._slot_arrays) >= 64:   # a captured graph may still use them: retire, never free
                self._retired.extend(self._slot_arrays.values())
                self._slot_arrays.clear()
            a = self._slot_arrays[key] = self.xp.asarray(slots.astype(np.int32))
        return a

    def _not_capturing(self, what: str) -> None:
        """RuntimeError while the current stream captures a CUDA graph: `what` changes the host's bookkeeping at
        once, while its device writes would only run at a replay."""
        if self.xp is not np and rt.cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError(f"PagedKVCache.{what}: not while a CUDA graph is being captured (it changes the "
                               "host's block bookkeeping now; call it before capturing or after replaying)")

    @_on_cache_device
    def free(self, seq) -> None:
        """Return sequence slot `seq`'s blocks to the free list; its length becomes 0."""
        if not _checks._is_int(seq) or not 0 <= int(seq) < self.max_batch:
            raise ValueError(f"seq: expected a slot in [0, {self.max_batch}), got {seq!r}")
        self._not_capturing("free")
        s = int(seq)
        n = int(self._nblk[s])
        self._free.extend(int(b) for b in self._table[s, :n][::-1])
        self._table[s, :n] = 0
        self._nblk[s] = 0
        self._lens[s] = 0
        self.block_table[s, :n] = -1
        self.seq_lens[s] = 0

    @_on_cache_device
    def attention(self, q, seqs=None, **kw):
        """`paged_attention(q, ...)` over sequences `seqs` (default 0..B-1), each with at least one token."""
        _checks.check_array_like("q", q)
        if q.ndim != 3:
            raise ValueError(f"q: expected a 3-d array [B, Hq, D], got shape {tuple(q.shape)}")
        if np.dtype(q.dtype) != np.dtype(self.k_cache.dtype):
            raise TypeError(f"q: expected the cache's dtype {np.dtype(self.k_cache.dtype)}, got {np.dtype(q.dtype)}")
        B = int(q.shape[0])
        slots = self._slots(seqs, B, "q")
        if (self._lens[slots] < 1).any():
            i = int(np.argmax(self._lens[slots] < 1))
            raise ValueError(f"seqs: sequence slot {int(slots[i])} is empty; append a token first")
        if seqs is None:
            table, lens = self.block_table[:B], self.seq_lens[:B]
        elif self.xp is np:
            table, lens = self.block_table[slots], self.seq_lens[slots]
        else:  # gathered into buffers kept per slot list: nothing allocated, so the call can be captured
            idx = self._device_slots(slots)
            key = slots.tobytes()
            bufs = self._gathers.get(key)
            if bufs is None:
                if len(self._gathers) >= 64:
                    self._retired.extend(self._gathers.values())
                    self._gathers.clear()
                bufs = self._gathers[key] = (self.xp.empty((B, self.block_table.shape[1]), dtype=np.int32),
                                             self.xp.empty((B,), dtype=np.int32))
            table, lens = bufs
            self.xp.take(self.block_table, idx, axis=0, out=table)
            self.xp.take(self.seq_lens, idx, out=lens)
        if self.xp is np:
            return paged_attention(q, self.k_cache, self.v_cache, table, lens, **kw)
        # a power-of-two bound (within the table): one launch plan serves many steps of a growing sequence
        longest = int(self._lens[slots].max())
        kw.setdefault("max_seqlen", min(1 << (longest - 1).bit_length(), self.block_table.shape[1] * self.block_size))
        return paged_attention(q, self.k_cache, self.v_cache, table, lens, **kw)


# ------------------------------------------------------------------------------------ error and selftest
def reference_bound(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                    window=(-1, -1)):
    """(ref, base, bound) for host inputs: ref = the float64 reference (float64 array), base = relative
    Frobenius error of `reference.sdpa_lowp` (same-dtype computation with float32 softmax) against it, and
    bound = min(2 * base, 2e-3 for float16 / 1e-2 for bfloat16) (docs/accuracy.md)."""
    dt = np.dtype(q.dtype)
    f32 = lambda a: np.asarray(a).astype(np.float32)
    r = ref.paged_attention(f32(q), f32(k_cache), f32(v_cache), block_table, seq_lens,
                            softmax_scale=softmax_scale, softcap=softcap, window=window).astype(np.float64)
    bs = k_cache.shape[1]
    low = np.empty(q.shape, dtype=dt)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        blocks = block_table[b, :-(-n // bs)]
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n]
        low[b] = ref.sdpa_lowp(q[b][None, None], k[None], v[None], softmax_scale=softmax_scale,
                               softcap=softcap, window=window)[0, 0]
    base = ref.rel_error(low, r)
    cap = 2e-3 if dt == np.float16 else 1e-2
    return r, base, min(2 * base, cap)


def reference_errors(q, k_cache, v_cache, block_table, seq_lens, out, **kw):
    """(err, base, bound): `out`'s relative error against the float64 reference, and `reference_bound`'s
    base and bound (host arrays in)."""
    r, base, bound = reference_bound(q, k_cache, v_cache, block_table, seq_lens, **kw)
    return ref.rel_error(out, r), base, bound


def make_case(rng, B, lens, Hq, Hkv, D, block_size, dtype, *, spare_blocks=3, xp=np):
    """Random inputs with a shuffled block table: (q, k_cache, v_cache, block_table, seq_lens) on the host."""
    lens = np.broadcast_to(np.asarray(lens, dtype=np.int64), (B,))
    nb = -(-lens // block_size)
    total = int(nb.sum()) + spare_blocks
    perm = rng.permutation(total).astype(np.int32)
    mb = int(nb.max())
    table = np.full((B, mb), -1, dtype=np.int32)   # entries past a sequence's blocks are never read
    o = 0
    for b in range(B):
        table[b, :nb[b]] = perm[o:o + nb[b]]
        o += nb[b]
    q = rng.standard_normal((B, Hq, D), dtype=np.float32).astype(dtype)
    kc = rng.standard_normal((total, block_size, Hkv, D), dtype=np.float32).astype(dtype)
    vc = rng.standard_normal((total, block_size, Hkv, D), dtype=np.float32).astype(dtype)
    return q, kc, vc, table, lens.astype(np.int32)


def _selftest_case(B, ctx, Hq, Hkv, D, bs, dtype, **kw):
    def case():
        cp = rt.require_cupy()
        rng = np.random.default_rng(1)
        lens = ctx if not kw.get("mixed") else rng.integers(1, ctx + 1, size=B)
        opts = {k: v for k, v in kw.items() if k != "mixed"}
        h = make_case(rng, B, lens, Hq, Hkv, D, bs, dtype)
        d = [cp.asarray(a) for a in h]
        o = paged_attention(*d, **opts)
        err, base, bound = reference_errors(*h, o.get(), **opts)
        out = cp.empty_like(d[0])
        launch = _launch_for(*d, out, cfg=None, max_seqlen=int(np.max(lens)), **opts)
        t = _timing.time_ms(launch.run, warmup=3, rep=20)
        tokens = int(np.sum(lens)) if kw.get("mixed") else B * ctx
        kv = tokens * Hkv * D * 2 * np.dtype(dtype).itemsize
        extra = " ".join(f"{k}={v}" for k, v in opts.items())
        return {"op": "paged_attention", "shape": f"B={B} ctx={ctx}{'(mixed)' if kw.get('mixed') else ''} "
                f"{Hq}/{Hkv} D={D} bs={bs} {np.dtype(dtype).name} {extra}".strip(),
                "error": err, "bound": bound, "ok": bool(err <= bound), "time_ms": t,
                "peer": "copy of the K+V bytes", "peer_ms": _timing.copy_time_ms(kv)}
    case.__qualname__ = f"paged_attention[B{B} ctx{ctx} {Hq}/{Hkv} D{D} bs{bs}]"
    return case


def selftest_cases():
    bf16 = ml_dtypes.bfloat16
    return [_selftest_case(1, 32768, 32, 8, 128, 16, np.float16),
            _selftest_case(64, 4096, 32, 8, 128, 16, bf16),
            _selftest_case(16, 3000, 32, 32, 80, 128, np.float16, mixed=True, window=(1000, 0), softcap=30.0)]
