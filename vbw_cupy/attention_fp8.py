"""FP8 attention (docs/attention.md, "FP8 attention"): `flash_attention_fp8` takes q, k, v as E4M3 (fn) codes with
float32 descales (one per tensor, or one per KV head, or one per batch and KV head), `quantize_e4m3` makes such codes
from a float16 / bfloat16 / float32 tensor (one descale, or one per group of heads) and `dequantize_e4m3` turns them
back into values.

NumPy inputs run `vbw_cupy.reference` (float64 on the decoded values); CuPy inputs on an sm_90 GPU run the
warp-specialized attention kernel with E4M3 tensor-core products (cuda_src/attention_fwd.cu, attn_fwd_wg<E4M3<O>,
...>): S = Q K^T and P V both on FP8 wgmma, P rounded to E4M3 (as 256 p), float32 softmax and accumulation.
The kernel reads V transposed with its keys permuted into the order the P fragments are packed in: each call
first writes that copy (cuda_src/attention_fp8.cu, vt_permute, about 4% of an S = 4096 call) into a buffer the
current stream keeps. Other GPUs, head dims the FP8 kernel does not run and unaligned arrays decode the codes into
the output dtype and run `flash_attention` instead (within the same bound, slower; float16 overflows past 65504
there). Nothing synchronizes the device: the descales stay on the GPU, so both functions can be captured in a
CUDA graph. A repeated call of the same signature replays its two launches from packed argument blocks (`_fast`).

Not supported: varlen / paged inputs.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _checks
from . import _device
from . import _plans
from . import _runtime as rt
from . import attention as _attn
from . import fp4
from . import reference as ref

SOURCE = "attention_fp8.cu"
_NS = "vbw_attn_fp8::"
_THREADS = 256
#: output dtypes of flash_attention_fp8
OUT_DTYPES = ("float16", "bfloat16")
#: head dims the FP8 kernel runs (the compiled width is 128; smaller ones are zero-padded): D % 16 == 0, D <= 128
FP8_HEAD_DIM = 128
# two consumer warpgroups of 64 rows, 128-key tiles (one 128-byte row of V^T), 2 stages; below 8k keys the
# persistent form (H100, graph replay, 8 interleaved pairs, median speed of wsp / ws, S = 1k / 2k / 4k / 8k / 16k
# full; causal: 1.07 1.04 1.01 1.01 1.00; 1.13 1.06 1.01 0.89 0.89; causal with attention.py's
# _persistent_schedule, next session: 1.15 1.08 1.03 0.99 0.98)
_CONFIGS = (_attn._wsp(128), _attn._ws(128))
_WSP_BELOW = 8192


def _config(Sk: int) -> dict:
    """The FP8 tile for Sk keys (its own threshold, measured on FP8: not attention.py's tiers)."""
    return _CONFIGS[0] if Sk < _WSP_BELOW else _CONFIGS[1]

_UINT8 = np.dtype(np.uint8)
_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)


def _codes(x):
    """A NumPy float8_e4m3fn array as its uint8 codes (the same bytes); anything else as it is."""
    return x.view(np.uint8) if isinstance(x, np.ndarray) and x.dtype == _E4M3FN else x


def kernel_instances(arch: int | None = None) -> list[tuple[str, str]]:
    out = [(SOURCE, f"{_NS}vt_permute")]
    out += [(SOURCE, f"{_NS}quantize_e4m3_tensor<{rt.ctype(t)}>") for t in _checks.FLOAT_DTYPES]
    out += [(SOURCE, f"{_NS}{kern}<{rt.ctype(t)}, {per}>") for kern in ("abs_max_heads", "quantize_e4m3_heads")
            for t in _checks.FLOAT_DTYPES for per in (_per_chunk(t), 1)]
    out += [(fp4._SOURCE, f"abs_max<{rt.ctype(t)}>") for t in _checks.FLOAT_DTYPES]  # quantize_e4m3's amax pass
    out += [(SOURCE, f"{_NS}decode_e4m3<{rt.ctype(t)}>") for t in _checks.FLOAT_DTYPES]
    if arch in (None, 90):
        out += [(_attn.SOURCE, _attn.instance_name(_UINT8, FP8_HEAD_DIM, c, True, True, False, t))
                for c in _CONFIGS for t in OUT_DTYPES]
    return out


def _per_chunk(dtype) -> int:
    """Elements of a 16-byte chunk of dtype (float16, bfloat16 or float32)."""
    return 4 if np.dtype(dtype).name == "float32" else 8


def _blocks(n: int) -> tuple:
    """Grid of the element-wise grid-stride kernels: enough CTAs for n elements, at most 8 an SM."""
    return (max(1, min(rt.cdiv(n, _THREADS), 8 * _device.num_sms())),)


# ------------------------------------------------------------------------------------------------ quantize
def quantize_e4m3(x, heads=None):
    """E4M3 (fn) codes of x (float16, bfloat16 or float32) with one float32 descale for the whole tensor: (codes
    uint8 of x's shape, descale float32 [1]), x ~= E4M3(codes) * descale, descale = max|x| / 448, at least 2^-149
    (1 for an all-zero x, NaN when x holds
    NaN or Inf, which then makes every code NaN: nothing downstream is silently finite). Rounds to nearest
    even. NumPy in, NumPy out (`vbw_cupy.reference.quantize_e4m3_tensor`); GPU arrays (CuPy, or anything with
    __dlpack__) in, CuPy out, bit-identical, no synchronization (max|x| is reduced on the device).

    heads = n (an int dividing H of x [..., H, D]): one descale for each of n equal groups of heads instead,
    descale float32 [n], x[..., h, :] ~= E4M3(codes[..., h, :]) * descale[h // (H / n)]. For attention, n = Hkv
    for q, k and v alike (`flash_attention_fp8` takes the three stacked: [3, Hkv]), so a head whose values are
    small keeps its precision beside one whose values are large.

    For attention under grouped-query attention use heads = Hkv for q as well, not Hq: the Hq / Hkv query heads
    of a group share one descale (there is no per-query-head form).

    >>> import cupy as cp
    >>> x = cp.random.standard_normal((2, 1024, 8, 128)).astype(cp.float16)
    >>> codes, ds = quantize_e4m3(x)             # uint8 [2, 1024, 8, 128], float32 [1]
    >>> codes, ds = quantize_e4m3(x, heads=8)    # float32 [8]: one per head
    >>> codes, ds = quantize_e4m3(x, heads=2)    # float32 [2]: one per group of 4 heads (q of 2 KV heads)
    """
    _checks.check_array_like("x", x)
    if not isinstance(x, np.ndarray):
        x = rt.as_gpu_array(x, "x")
    _checks.check_float_dtype("x", x.dtype)
    heads = _check_heads(x.shape, heads)
    if isinstance(x, np.ndarray):
        return ref.quantize_e4m3_tensor(x, heads)
    cp = rt.require_cupy()
    n_ds = 1 if heads is None else heads
    with x.device:
        x = rt.ensure_aligned16(x)
        codes = cp.empty(x.shape, dtype=cp.uint8)
        descale = cp.empty(n_ds, dtype=cp.float32)
        G = 0 if heads is None else x.shape[-2] // heads * x.shape[-1]   # a group's elements in a row (< 2^31)
        rows = 0 if heads is None or G == 0 else int(x.size) // (heads * G)
        if heads is not None and rows == 0:   # (no values: every descale 1, as for an all-zero x)
            descale.fill(1)
            return codes, descale
        # max |x| (of each group) in the stream's own bytes (no pool memory inside a call: capturable), zeroed
        # each call
        amax = _plans.scratch("quantize_e4m3 amax", 4 * n_ds)
        amax.data.memset_async(0, 4 * n_ds, cp.cuda.get_current_stream())
        if heads is None:
            n = int(x.size)
            fp4.launch_abs_max(x, amax)
            rt.launch(rt.get_kernel(SOURCE, f"{_NS}quantize_e4m3_tensor<{rt.ctype(x.dtype)}>"), _blocks(n),
                      (_THREADS,), (x, np.int64(n), amax, codes, descale))
        else:   # a CTA row per group: 16-byte chunks where a group's row is a whole number of them
            per = _per_chunk(x.dtype) if G % _per_chunk(x.dtype) == 0 else 1
            t = f"{rt.ctype(x.dtype)}, {per}"
            grid, args = _head_grid(rows, heads, G, per), (x, np.int64(rows), np.int32(heads), np.int32(G), amax)
            rt.launch(rt.get_kernel(SOURCE, f"{_NS}abs_max_heads<{t}>"), grid, (_THREADS,), args)
            rt.launch(rt.get_kernel(SOURCE, f"{_NS}quantize_e4m3_heads<{t}>"), grid, (_THREADS,),
                      args + (codes, descale))
    return codes, descale


def _check_heads(shape, heads):
    """heads (None, or an int n >= 1 dividing the head axis H of x [..., H, D]) checked against x's shape."""
    if heads is None:
        return None
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)):
        raise TypeError(f"heads: expected None or an int, got {type(heads).__name__}")
    heads = int(heads)
    if len(shape) < 2:
        raise ValueError(f"heads: needs x with a head axis ([..., H, D]), got x of shape {tuple(shape)}")
    H = shape[-2]
    if heads < 1 or heads > max(H, 1) or (H and H % heads):
        divisors = [n for n in range(1, H + 1) if H % n == 0] if 0 < H <= 4096 else None
        raise ValueError(f"heads: expected a positive divisor of the {H} heads of x (axis -2 of {tuple(shape)})"
                         f"{f', one of {divisors}' if divisors and len(divisors) <= 16 else ''}, got {heads}")
    # (the GPU kernels' grid: a row of CTAs a group; a group's row indexed in int32. The same limit for NumPy.)
    if heads > 65535 or H // heads * shape[-1] >= 2**31:
        raise ValueError(f"heads: at most 65535 groups of fewer than 2^31 elements a row, got {heads} groups of "
                         f"{H // heads * shape[-1]} (x of shape {tuple(shape)})")
    return heads


def _head_grid(rows: int, groups: int, G: int, per: int) -> tuple:
    """Grid of the per-group kernels (attention_fp8.cu for_group_chunks): enough CTAs along x for the rows,
    `groups` along y, at most 8 CTAs an SM in all."""
    rows_per_cta = max(1, _THREADS // max(1, G // per))
    return (max(1, min(rt.cdiv(rows, rows_per_cta), max(1, 8 * _device.num_sms() // groups))), groups)


def dequantize_e4m3(codes, descale=None, dtype=np.float32):
    """The values of E4M3 (fn) codes: E4M3(codes) * descale, computed in float32 and rounded to dtype (float16,
    bfloat16 or float32), so `dequantize_e4m3(*quantize_e4m3(x))` is x to E4M3's precision. codes: uint8 of any
    shape (or a NumPy ml_dtypes.float8_e4m3fn array, read as its codes); descale: None (1), one float32 value, as
    quantize_e4m3 returns it ([1]), or n values for n groups of heads (quantize_e4m3's heads=n: codes [..., H, D],
    n dividing H). Codes 0x7F / 0xFF are NaN; values past the dtype's range become +-Inf.
    NumPy in, NumPy out; GPU codes (CuPy, or anything with __dlpack__) in, CuPy out, bit-identical, no
    synchronization (a GPU descale stays on the GPU).

    >>> codes, ds = quantize_e4m3(x)
    >>> y = dequantize_e4m3(codes, ds, x.dtype)         # x to within E4M3's rounding
    """
    codes = _codes(codes)
    _checks.check_array_like("codes", codes)
    if not isinstance(codes, np.ndarray):
        codes = rt.as_gpu_array(codes, "codes")
    if np.dtype(codes.dtype) != _UINT8:
        raise TypeError(f"codes: expected uint8 E4M3 codes, got {codes.dtype}")
    dt = _checks.check_float_dtype("dtype", dtype)
    host = isinstance(codes, np.ndarray)
    heads = None
    if descale is not None:
        if host:
            if not isinstance(descale, (np.ndarray, np.generic, float, int)) or isinstance(descale, bool):
                raise TypeError(f"descale: expected float32 values (quantize_e4m3's [1] or [heads]) or None, got "
                                f"{type(descale).__name__}")
            d = np.asarray(descale)
            if d.dtype.kind not in "fiu" or d.ndim > 1 or d.size == 0:
                raise ValueError(f"descale: expected one value (shape () or (1,)) or one per group of heads (n,), "
                                 f"got shape {d.shape} {d.dtype}")
            descale = d.astype(np.float32).reshape(-1)
        else:
            descale = rt.as_gpu_array(descale, "descale")
            if descale.dtype != np.float32 or descale.ndim > 1 or descale.size == 0 or \
                    not descale.flags.c_contiguous:
                raise ValueError(f"descale: expected a contiguous float32 GPU array of one value (quantize_e4m3's "
                                 f"[1]) or one per group of heads (n,), got shape {tuple(descale.shape)} "
                                 f"{descale.dtype}")
            rt.check_same_device(codes=codes, descale=descale)
        if descale.size > 1:
            heads = descale.size
            if codes.ndim < 2 or codes.shape[-2] % heads:
                H = codes.shape[-2] if codes.ndim >= 2 else None
                raise ValueError(f"descale: {heads} values (one per group of heads) need codes [..., H, D] with H a "
                                 f"multiple of {heads}; got codes of shape {tuple(codes.shape)}"
                                 f"{f' (H = {H})' if H is not None else ''}")
    if host:
        with np.errstate(over="ignore", invalid="ignore"):   # past the dtype's range: Inf, as on the GPU
            v = ref.e4m3_decode(codes)
            if descale is not None:
                v = v * (descale[0] if heads is None else np.repeat(descale, codes.shape[-2] // heads)[:, None])
            return v.astype(dt)
    cp = rt.require_cupy()
    with codes.device:
        codes = rt.ensure_contiguous(codes)
        out = cp.empty(codes.shape, dtype=dt)
        grp = 1 if heads is None else codes.shape[-2] // heads * codes.shape[-1]
        _launch_decode(codes, descale, 0, heads or 1, grp, 0 if heads is None else 1, out)
    return out


def _launch_decode(codes, descale, bsz, row_groups, grp, ds_hs, out, ds_bs=0):
    """decode_e4m3 (attention_fp8.cu) of codes into out: element i takes descale[(i / bsz) * ds_bs + ((i % row)
    / grp) * ds_hs], row = row_groups * grp (descale None: 1)."""
    n = int(codes.size)
    if n:
        rt.launch(rt.get_kernel(SOURCE, f"{_NS}decode_e4m3<{rt.ctype(out.dtype)}>"), _blocks(n), (_THREADS,),
                  (codes, np.int64(n), rt.NULL if descale is None else descale, np.int64(max(bsz, 1)),
                   np.int64(max(row_groups * grp, 1)), np.int64(max(grp, 1)), np.int32(ds_bs), np.int32(ds_hs),
                   out))


# ------------------------------------------------------------------------------------------------ attention
def _check_descale(descale, host: bool, B: int, Hkv: int, Hq: int):
    """descale (None, or float32 q, k, v descales: [3] one per tensor, [3, Hkv] one per KV head, [3, B, Hkv] one a
    batch and KV head) checked; returns it (NumPy float32 on the host) and its element strides (tensor, batch,
    KV head), which the kernels index it by (a stride 0 where the values do not vary)."""
    if descale is None:
        return None, (1, 0, 0)
    forms = (f"(3,), (3, Hkv={Hkv}) or (3, B={B}, Hkv={Hkv}) (q, k, v: one per tensor, one per KV head, one per "
             f"batch and KV head)")
    if host:
        try:
            d = np.asarray(descale)
        except ValueError as e:   # a ragged list
            raise ValueError(f"descale: expected shape {forms}, got an irregular sequence ({e})") from None
        if d.dtype.kind not in "fiu":
            raise TypeError(f"descale: expected float32 numbers (q, k, v), got {d.dtype}")
    else:
        d = rt.as_gpu_array(descale, "descale")
        if d.dtype != np.float32:
            raise TypeError(f"descale: expected a float32 GPU array (q, k, v), got {d.dtype}")
        if not d.flags.c_contiguous:
            raise ValueError(f"descale: expected a contiguous GPU array of shape {forms}, got a strided one")
    strides = {(3,): (1, 0, 0), (3, Hkv): (Hkv, 0, 1), (3, B, Hkv): (B * Hkv, Hkv, 1)}.get(tuple(d.shape))
    if strides is None:
        hint = (f"; descales per query head are not supported: quantize q with heads={Hkv} (Hkv), as k and v"
                if d.ndim >= 2 and d.shape[-1] == Hq != Hkv else "")
        raise ValueError(f"descale: expected shape {forms}, got {tuple(d.shape)} (quantize_e4m3's descales are [1] "
                         f"each, [Hkv] with heads=Hkv: concatenate or stack the three){hint}")
    return (d.astype(np.float32) if host else d), strides


def _fp8_kernel_runs(q, k, v, D: int) -> bool:
    """Whether the FP8 kernel can run this call (else the codes are decoded and flash_attention runs): sm_90,
    D % 16 == 0 and D <= 128, 16-byte aligned arrays (TMA and the V transpose's 16-byte loads)."""
    return (_device.device_arch(q.data.device_id) == 90 and D % 16 == 0 and D <= FP8_HEAD_DIM
            and all(a.data.ptr % 16 == 0 for a in (q, k, v)) and rt.have_tensor_maps())


def flash_attention_fp8(q, k, v, descale=None, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                        return_lse=False, out_dtype=np.float16):
    """Attention on E4M3 (fn) inputs (docs/attention.md, "FP8 attention").

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]: uint8 E4M3 codes (from `quantize_e4m3`, or any FP8 producer;
    NumPy ml_dtypes.float8_e4m3fn arrays are read as their codes);
    descale: None (all 1) or float32 descales of q, k, v: the inputs are E4M3(code) * descale, [3] one per tensor
    (e.g. `cupy.concatenate([dq, dk, dv])` of quantize_e4m3's descales), [3, Hkv] one per KV head (`cupy.stack` of
    quantize_e4m3(t, heads=Hkv)'s; query head h takes that of its KV head h // (Hq / Hkv), as FlashAttention-3
    does) or [3, B, Hkv] one per batch and KV head; a CuPy array for GPU inputs, a NumPy array or sequence for
    NumPy inputs. causal, softmax_scale (applied to the decoded values' scores), window,
    softcap, return_lse: as in `flash_attention`. Returns o [B, Sq, Hq, D] in out_dtype (float16 or bfloat16)
    and with return_lse also lse float32 [B, Hq, Sq].

    On an sm_90 GPU with D % 16 == 0 and D <= 128 (16-byte aligned arrays) both products run on FP8 tensor
    cores; its error against the float64 reference is within twice that of the same computation in float32 with
    P rounded to E4M3 (tests/test_attention_fp8.py). Elsewhere the codes are decoded into out_dtype and
    `flash_attention` runs (with float16, decoded magnitudes past 65504 overflow: use bfloat16 for such data).
    Descales may be any float (<= 0 too); a NaN descale gives NaN output.

    >>> import cupy as cp
    >>> x = [cp.random.standard_normal((2, 4096, 16, 128)).astype(cp.float16) for _ in range(3)]
    >>> (q, dq), (k, dk), (v, dv) = (quantize_e4m3(t) for t in x)
    >>> o = flash_attention_fp8(q, k, v, cp.concatenate([dq, dk, dv]), causal=True)
    >>> # one descale per KV head (GQA: 32 query heads, 8 KV heads; q takes heads=8 too)
    >>> q, k, v = (cp.random.standard_normal((2, 4096, h, 128)).astype(cp.float16) for h in (32, 8, 8))
    >>> (q8, dq), (k8, dk), (v8, dv) = (quantize_e4m3(t, heads=8) for t in (q, k, v))
    >>> o = flash_attention_fp8(q8, k8, v8, cp.stack([dq, dk, dv]), causal=True)    # descale [3, 8]
    >>> # one per batch and KV head: each request quantized alone, descale [3, 2, 8]
    >>> per = [[quantize_e4m3(t[b], heads=8) for b in range(2)] for t in (q, k, v)]
    >>> codes = [cp.stack([c for c, _ in p]) for p in per]
    >>> o = flash_attention_fp8(*codes, cp.stack([cp.stack([d for _, d in p]) for p in per]), causal=True)
    """
    cp = rt.cupy
    key = None
    q, k, v = _codes(q), _codes(k), _codes(v)
    if cp is not None and type(q) is cp.ndarray and type(k) is cp.ndarray and type(v) is cp.ndarray and \
            (descale is None or type(descale) is cp.ndarray):
        key = _fast_key(q, k, v, descale, causal, softmax_scale, window, softcap, return_lse, out_dtype)
        res = None if key is None else _fast(key, q, k, v, descale, return_lse)
        if res is not None:
            return res
    host = _checks.split_host_device(q=q, k=k, v=v)
    if not host:
        q, k, v = _attn._prepare_gpu(q, k, v)
    shape = _checks.check_attention_args(q, k, v, window, softcap, causal=causal, softmax_scale=softmax_scale,
                                         dtypes=(_UINT8,))
    try:
        if out_dtype is None:
            raise TypeError
        out_dtype = np.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"out_dtype: expected float16 or bfloat16, got {out_dtype!r}") from None
    if out_dtype.name not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected float16 or bfloat16, got {out_dtype}")
    return_lse = _checks.check_flag("return_lse", return_lse)
    ds, ds_strides = _check_descale(descale, host, shape[0], shape[4], shape[3])
    if host:
        return ref.flash_attention_fp8(q, k, v, ds, causal=causal, softmax_scale=softmax_scale, window=window,
                                       softcap=softcap, return_lse=return_lse, out_dtype=out_dtype)
    cp = rt.require_cupy()
    B, Sq, Sk, Hq, Hkv, D = shape
    _attn._check_seqlen("q", Sq)
    _attn._check_seqlen("k", Sk)
    _attn._check_grid(B, Hq, Sq)
    if Hkv > 65535:  # (V's transpose runs a grid row a KV head)
        raise ValueError(f"k: {Hkv} KV heads, more than the 65535 the GPU kernel takes")
    rt.check_same_device(q=q, k=k, v=v, **({} if ds is None else {"descale": ds}))
    left, right = _checks.effective_window(window, causal)
    scale = _checks.effective_scale(softmax_scale, D)
    with q.device:
        q, k, v = rt.ensure_contiguous(q), rt.ensure_contiguous(k), rt.ensure_contiguous(v)
        if not _fp8_kernel_runs(q, k, v, D):
            return _decoded(q, k, v, ds, ds_strides, out_dtype, causal=causal, softmax_scale=softmax_scale, window=window,
                            softcap=softcap, return_lse=return_lse)
        Skp = rt.cdiv(Sk, 128) * 128
        vt = _plans.scratch("flash_attention_fp8 v^T", B * Hkv * D * Skp)[:B * Hkv * D * Skp].reshape(B, Hkv, D, Skp)
        vt_kern, vt_grid = rt.get_kernel(SOURCE, f"{_NS}vt_permute"), (Skp // 64 * B, Hkv)
        vt_args = (v, vt, np.int32(Sk), np.int32(Skp), np.int32(Hkv), np.int32(D))
        rt.launch(vt_kern, vt_grid, (_THREADS,), vt_args)
        o = cp.empty(q.shape, dtype=out_dtype)
        lse = cp.empty((B, Hq, Sq), dtype=cp.float32) if return_lse else None
        launch = _attn._Launch(q, k, vt, o, lse, None, None, B, Sq, Sk, Sq, Sk, Hq, Hkv, D, scale, left, right,
                               _checks.check_softcap(softcap), Sq, descale=ds, ds_strides=ds_strides)
        kern, grid, block, smem, scalars, _, boxes = launch.run(_config(Sk))
    # (a call made on another device than q's is not replayed: the fast path allocates and launches on the
    # current one)
    if key is not None and q.size and _plans.kernel_ptr(kern) is not None and \
            _plans.kernel_ptr(vt_kern) is not None and q.data.device_id == cp.cuda.runtime.getDevice():
        _fast_plans.put(key, (_plans.Launch(vt_kern, vt_grid, (_THREADS,), vt_args, (0,)), kern, grid, block, smem,
                              scalars, vt, q.data.device_id, out_dtype, boxes,
                              _plans.PlanCache(_LAUNCHES_PER_PLAN)))
    return (o, lse) if return_lse else o


# A GPU call whose shapes, dtypes, options, device and stream match an earlier one that took the FP8 kernel
# replays that call's two launches (V's transpose into the same buffer, then the attention) from argument blocks
# packed once (_plans.Launch); only what can differ between such calls -- contiguity, 16-byte alignment, device,
# descale's form -- is checked again, and anything unusual takes the full path. (As flash_attention's fast path.)
_fast_plans = _plans.PlanCache()
_LAUNCHES_PER_PLAN = 64  # packed attention launches a plan keeps, one per (q, k) addresses (their tensor maps)


def _fast_key(q, k, v, descale, causal, softmax_scale, window, softcap, return_lse, out_dtype):
    cp = rt.cupy
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, None if descale is None else descale.shape,
               type(causal), causal,
               type(softmax_scale), softmax_scale, type(window), window,
               tuple(map(type, window)) if type(window) is tuple else None, type(softcap), softcap,
               type(return_lse), return_lse, out_dtype, cp.cuda.runtime.getDevice(), _plans.stream_key(),
               _attn._variant())
        hash(key)
    except TypeError:  # a list window, an odd scalar: the full path
        return None
    return key


def _fast(key, q, k, v, descale, return_lse):
    """The replayed call, or None when this call must take the full path."""
    plan = _fast_plans.get(key)
    if plan is None:
        return None
    vt_launch, kern, grid, block, smem, scalars, vt, dev, out_dtype, boxes, launches = plan
    arrays = (q, k, v) if descale is None else (q, k, v, descale)
    if not all(a.flags.c_contiguous and a.data.device_id == dev for a in arrays) or \
            (q.data.ptr | k.data.ptr | v.data.ptr) % 16 or \
            (descale is not None and (descale.dtype != np.float32 or not descale.flags.c_contiguous)):
        return None
    cp = rt.cupy
    ptrs = (q.data.ptr, k.data.ptr)
    launch = launches.get(ptrs)
    if launch is None:
        maps = _attn._map_args_fp8(q, k, vt, boxes)  # (the tile the plan's kernel was built for)
        if maps is None:
            return None
    o = cp.empty(q.shape, dtype=out_dtype)
    lse = cp.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=cp.float32) if return_lse else None
    if launch is None:
        args = (q, k, vt, o, rt.NULL if lse is None else lse, rt.NULL, rt.NULL) + scalars + maps
        dynamic = (3,) + ((4,) if lse is not None else ()) + \
            ((7 + len(scalars) - 4,) if descale is not None else ())   # descale: before its three strides
        launch = _plans.Launch(kern, grid, block, args, dynamic, smem)
        launches.put(ptrs, launch)
    stream = cp.cuda.get_current_stream().ptr
    vt_launch((v.data.ptr,), stream)
    launch((o.data.ptr,) + ((lse.data.ptr,) if lse is not None else ()) +
           ((descale.data.ptr,) if descale is not None else ()), stream)
    return (o, lse) if lse is not None else o


def _decoded(q, k, v, ds, ds_strides, out_dtype, **kw):
    """The fallback: E4M3(codes) * descale in out_dtype (into the stream's buffers, not the pool: capturable),
    then flash_attention. Per-head descales are per KV head: a query head takes its group's."""
    ts, bs, hs = ds_strides
    Hkv = k.shape[2]
    dec = []
    for i, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        n = int(x.size)
        buf = _plans.scratch(f"flash_attention_fp8 decoded {name}", 2 * n).view(out_dtype)[:n].reshape(x.shape)
        B, S, H, D = x.shape
        _launch_decode(x, None if ds is None else ds.ravel()[i * ts:], S * H * D, Hkv, H // Hkv * D, hs, buf,
                       ds_bs=bs)
        dec.append(buf)
    return _attn.flash_attention(*dec, **kw)


def _selftest_case(B, S, H, D, causal):
    def case():
        cp = rt.require_cupy()
        from . import _timing
        rng = np.random.default_rng(4321)
        xs = [cp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float16)) for _ in range(3)]
        (q, dq), (k, dk), (v, dv) = (quantize_e4m3(x) for x in xs)
        ds = cp.concatenate([dq, dk, dv])
        o = flash_attention_fp8(q, k, v, ds, causal=causal)
        qh, kh, vh, dh = (cp.asnumpy(a) for a in (q, k, v, ds))
        o64 = ref.flash_attention_fp8(qh, kh, vh, dh, causal=causal, out_dtype=np.float32)
        err = ref.rel_error(cp.asnumpy(o).astype(np.float32), o64)
        base = ref.rel_error(_emulated(qh, kh, vh, dh, causal).astype(np.float16).astype(np.float32), o64)
        bound = 2 * base
        ms = _timing.time_ms(lambda: flash_attention_fp8(q, k, v, ds, causal=causal), warmup=3, rep=10)
        ms16 = _timing.time_ms(lambda: _attn.flash_attention(*xs, causal=causal), warmup=3, rep=10)
        flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
        return {"op": "flash_attention_fp8", "shape": f"B{B} S{S} H{H} D{D} e4m3{' causal' if causal else ''} "
                f"({flops / ms / 1e9:.0f} TFLOP/s)", "error": err, "bound": bound, "ok": bool(err <= bound),
                "time_ms": ms, "peer": "flash_attention fp16", "peer_ms": ms16, "peer_naive": False}
    case.__qualname__ = f"flash_attention_fp8[D{D},{'causal' if causal else 'full'}]"
    return case


def _emulated(q, k, v, descale, causal, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """The bound's baseline (NumPy): the FP8 computation in float32 -- decoded inputs, float32 scores and
    softmax, P rounded to E4M3 as 256 p (the kernel's rounding), float32 P V -- for [B, S, H, D] codes with
    Hq == Hkv (repeat k / v heads first for GQA), masks as `reference.flash_attention`'s. A row that sees no
    key gets 0. Returns float32 o."""
    ds = np.ones(3, np.float32) if descale is None else np.asarray(descale, np.float32)
    dq, dk, dv = (ref.e4m3_decode(c) * ref.fp8_head_descale(d, c.shape).astype(np.float32) for c, d in zip((q, k, v), ds))
    B, Sq, H, D = dq.shape
    Sk = dk.shape[1]
    scale = np.float32(1.0 / np.sqrt(D) if softmax_scale is None else softmax_scale)
    s = np.einsum("bqhd,bkhd->bhqk", dq, dk, dtype=np.float32) * scale
    if softcap > 0:
        s = (np.float32(softcap) * np.tanh(s / np.float32(softcap))).astype(np.float32)
    left, right = ref._window(window, causal)
    rel = np.arange(Sk)[None, :] - (np.arange(Sq)[:, None] + Sk - Sq)   # key j minus query i's diagonal
    seen = np.ones((Sq, Sk), bool)
    if left >= 0:
        seen &= rel >= -left
    if right >= 0:
        seen &= rel <= right
    s = np.where(seen, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    p = np.exp2((s - m) * np.float32(np.log2(np.e)) + 8).astype(np.float32)
    l = p.sum(axis=-1, keepdims=True)
    p8 = ref.e4m3_decode(ref.e4m3_codes(p))
    o = np.einsum("bhqk,bkhd->bqhd", p8, dv, dtype=np.float32)
    l = np.moveaxis(l, 1, 2)
    return np.where(l > 0, o / np.where(l > 0, l, 1), 0).astype(np.float32)


def selftest_cases() -> list:
    """FP8 attention at D = 128: error against the float64 reference on the decoded inputs (bound: twice the
    float32 emulation's), time against flash_attention on the same data in float16."""
    return [_selftest_case(1, 4096, 16, 128, False), _selftest_case(1, 4096, 16, 128, True)]
