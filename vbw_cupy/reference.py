"""NumPy float64 ground truth for every public operation of vbw_cupy.

Obviously correct rather than fast. FP4 quantization follows docs/formats.md exactly, including its
float32 rounding steps for NVFP4, so the GPU kernels can be compared bit for bit. Attention works
in float64 one block of queries at a time, so 8k tokens never build an 8k x 8k x heads array.
"""
from __future__ import annotations

import ml_dtypes as _ml_dtypes
import numpy as np


def rel_error(got, want) -> float:
    """Relative Frobenius error ||got - want|| / ||want|| in float64 (||got|| when want is all zeros; NaN
    when got holds NaN): the accuracy measure of docs/accuracy.md."""
    got, want = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / den) if den > 0 else float(np.linalg.norm(got))


# ----------------------------------------------------------------------------------------------
# FP4 (owned by the FP4 section; attention helpers below must not depend on it)
# ----------------------------------------------------------------------------------------------

FORMATS = {"mxfp4": 32, "nvfp4": 16}  # format -> block size along K
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
E4M3_MAX = 448.0


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8, 0..15) for float values: round to nearest, ties to even, saturate at +-6.

    The thresholds are the midpoints between neighbouring values; a tie goes to the even code, so
    0.25, 1.25, 2.5 and 5 round down while 0.75, 1.75 and 3.5 round up. NaN encodes as a signed zero.
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    code = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def e2m1_decode(code: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(code) & 15]


def e4m3_encode(s: np.ndarray) -> np.ndarray:
    """E4M3 (fn) codes for positive float32 values already clamped to [2^-9, 448]; RNE."""
    s = np.asarray(s, dtype=np.float64)
    m, e = np.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    E = e - 1
    normal = E >= -6
    q = np.where(normal, np.rint((m * 2 - 1) * 8), np.rint(s * 512.0))  # np.rint is ties-to-even
    carry = normal & (q == 8)
    E = np.where(carry, E + 1, E)
    q = np.where(carry, 0, q)
    code = np.where(normal, ((E + 7) << 3) | q.astype(np.int64), q.astype(np.int64))
    return code.astype(np.uint8)


def e4m3_codes(v: np.ndarray) -> np.ndarray:
    """E4M3 (fn) codes of values v (any float dtype): magnitudes clamped to 448, rounded to nearest even, the
    sign kept (-0 -> 0x80), NaN -> 0x7F."""
    v = np.asarray(v)
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    live = a > 0
    mag = np.where(live, e4m3_encode(np.where(live, a, 1.0)), 0)  # e4m3_encode wants a > 0
    codes = mag.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 7)
    return np.where(np.isnan(v), np.uint8(0x7F), codes).astype(np.uint8)


def e4m3_decode(code: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 (fn) codes: 0x7F and 0xFF are NaN (ml_dtypes.float8_e4m3fn decodes them)."""
    return np.asarray(code).astype(np.uint8).view(_ml_dtypes.float8_e4m3fn).astype(np.float32)


def e8m0_decode(code: np.ndarray) -> np.ndarray:
    """float32 values 2^(code - 127) of E8M0 codes, 255 NaN (ml_dtypes.float8_e8m0fnu decodes them)."""
    return np.asarray(code).astype(np.uint8).view(_ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """[..., K] -> [..., nblocks, block] float32, zero-padded; returns it with K."""
    K = x.shape[-1]
    nb = -(-K // block)
    xp = np.zeros(x.shape[:-1] + (nb * block,), dtype=np.float32)
    xp[..., :K] = x.astype(np.float32)
    return xp.reshape(x.shape[:-1] + (nb, block)), K


def _pack(codes: np.ndarray) -> np.ndarray:
    """[..., Kp] codes -> [..., Kp/2] bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _unpack(data: np.ndarray) -> np.ndarray:
    out = np.empty(data.shape[:-1] + (data.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = data & 15
    out[..., 1::2] = data >> 4
    return out


def nvfp4_global_scale(x: np.ndarray) -> np.float32:
    """docs/formats.md: float32(amax_tensor) / float32(448 * 6); 1.0 when the tensor is all zeros."""
    amax = np.float32(np.max(np.abs(x.astype(np.float32)))) if x.size else np.float32(0)
    return nvfp4_global_scale_of_amax(amax)


def nvfp4_global_scale_of_amax(amax) -> np.float32:
    """float32(amax) / float32(448 * 6), or 1.0 where that is 0: an all-zero tensor, or one whose amax is below
    448 * 6 half subnormal steps (~1.9e-42), where the quotient underflows (its elements all quantize to 0 anyway)."""
    with np.errstate(under="ignore"):
        gs = np.float32(np.float32(amax) / np.float32(448.0 * 6.0))
    return np.float32(1.0) if gs == 0 else gs


def quantize_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(data, scales) for MXFP4: e = floor(log2(amax)) - 2 clamped to [-127, 127]; NaN/Inf block -> 255."""
    blk, _ = _blocks(x, 32)
    amax = np.max(np.abs(blk), axis=-1)
    bad = ~np.all(np.isfinite(blk), axis=-1)
    safe = np.where(bad | (amax == 0), np.float32(1), amax)
    e = np.frexp(safe)[1].astype(np.int64) - 1 - 2  # floor(log2(amax)) - 2, exact via frexp
    e = np.where(amax == 0, -127, np.clip(e, -127, 127))
    scaled = blk.astype(np.float64) * np.ldexp(1.0, -e)[..., None]  # exact power-of-two scaling
    codes = np.where(bad[..., None], np.uint8(0), e2m1_encode(np.where(bad[..., None], 0, scaled)))
    scales = np.where(bad, 255, e + 127).astype(np.uint8)
    return _pack(codes.reshape(codes.shape[:-2] + (-1,))), scales


def quantize_nvfp4(x: np.ndarray, global_scale) -> tuple[np.ndarray, np.ndarray]:
    """(data, scales) for NVFP4 with the float32 steps of docs/formats.md, each rounded to nearest even."""
    gs = np.float32(global_scale)
    blk, _ = _blocks(x, 16)
    amax = np.max(np.abs(blk), axis=-1)
    with np.errstate(under="ignore", divide="ignore", invalid="ignore"):
        s = (amax / np.float32(6.0)).astype(np.float32) / gs
        s = np.clip(s, np.float32(2.0 ** -9), np.float32(E4M3_MAX)).astype(np.float32)
        codes_s = e4m3_encode(s)
        denom = (e4m3_decode(codes_s) * gs).astype(np.float32)
        # a zero stays zero where denom underflows to 0 (global_scale below ~2^-140; others saturate there)
        q = np.where(blk == 0, blk, blk / denom[..., None]).astype(np.float32)
    codes = e2m1_encode(q)
    return _pack(codes.reshape(codes.shape[:-2] + (-1,))), codes_s


def dequantize_codes(data: np.ndarray, scales: np.ndarray, fmt: str, global_scale, K: int) -> np.ndarray:
    """float32 values [..., K]: (e2m1 * scale) * global_scale, each product rounded to float32."""
    block = FORMATS[fmt]
    vals = e2m1_decode(_unpack(data)).reshape(data.shape[:-1] + (-1, block))
    sc = e8m0_decode(scales) if fmt == "mxfp4" else e4m3_decode(scales)
    with np.errstate(over="ignore", invalid="ignore"):
        out = (vals * sc[..., None]).astype(np.float32)
        if fmt == "nvfp4":
            out = (out * np.float32(global_scale)).astype(np.float32)
    return out.reshape(data.shape[:-1] + (-1,))[..., :K]


def dequantize(t, dtype=np.float32):
    """Reference dequantize of an FP4Tensor held in NumPy arrays."""
    out = dequantize_codes(np.asarray(t.data), np.asarray(t.scales), t.format, t.global_scale, t.shape[-1])
    return out.astype(dtype)


# FP8 rows: E4M3 values with a power-of-two float32 scale per row (the activations of W4A8 GEMMs).
FP8_MIN_EXP = -126  # the smallest row scale, 2^-126 (rows with a smaller max|x| use it)


def quantize_fp8(x: np.ndarray):
    """E4M3 (fn) codes [..., K] and float32 scales [...] of x along its last axis: scale = 2^e, e the least
    integer with max|row| <= 448 * 2^e (at least -126; 0 for a row of zeros), codes = E4M3(x * 2^-e) rounded to
    nearest even (exact scaling: E4M3's rounding is the only one). A row holding NaN or Inf gets scale NaN and
    codes 0x7F (NaN)."""
    x32 = np.asarray(x).astype(np.float32)
    amax = np.max(np.abs(x32), axis=-1)  # NaN wins
    live = np.isfinite(amax) & (amax > 0)
    m, E = np.frexp(np.where(live, amax, 1.0).astype(np.float64))  # amax = 2m * 2^(E - 1), 2m in [1, 2)
    e = np.where(2 * m <= 1.75, E - 9, E - 8)  # 448 = 1.75 * 2^8
    e = np.where(live, np.maximum(e, FP8_MIN_EXP), 0)
    finite = np.isfinite(amax)
    v = np.where(finite[..., None], x32, 0).astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]
    codes = np.where(finite[..., None], e4m3_codes(v), np.uint8(0x7F)).astype(np.uint8)
    scales = np.where(finite, np.exp2(e.astype(np.float64)), np.nan).astype(np.float32)
    return codes, scales


def dequantize_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values [..., K]: E4M3(code) * the row's scale (exact: the scales are powers of two)."""
    return (e4m3_decode(codes) * np.asarray(scales, dtype=np.float32)[..., None]).astype(np.float32)


def quantize_e4m3_tensor(x: np.ndarray, heads: int | None = None):
    """E4M3 (fn) codes of x (any shape) with one float32 descale for the whole tensor: descale = amax / 448 in
    float32, at least 2^-149 (float32's smallest denormal: amax / 448 of a float32 amax below ~3e-43 would be 0);
    1 when x is all zero, NaN when amax is not finite; codes = E4M3(x / descale) (float32 division,
    then round to nearest even, magnitudes clamped to 448; NaN -> 0x7F). Returns (codes uint8, descale float32
    array of shape (1,)); x ~= E4M3(codes) * descale. heads = n: the same for each of n equal groups of the
    head axis (axis -2: x [..., H, D], n dividing H), descale [n]; x ~= E4M3(codes) * descale[h // (H / n)]."""
    x32 = np.asarray(x).astype(np.float32)
    n = 1 if heads is None else heads
    if x32.size == 0:
        return np.zeros(x32.shape, np.uint8), np.ones(n, np.float32)
    # [rows, groups, elements of a group in a row]
    groups = x32.reshape(1, 1, -1) if heads is None else x32.reshape(-1, n, x32.shape[-2] // n * x32.shape[-1])
    amax = np.abs(groups).max(axis=(0, 2)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ds = np.where(amax == 0, np.float32(1),
                      np.where(np.isfinite(amax), np.maximum(amax / np.float32(448), np.float32(2.0 ** -149)),
                               np.float32(np.nan))).astype(np.float32)
        v = (groups / ds[None, :, None]).astype(np.float32).reshape(x32.shape)
    return e4m3_codes(v), ds


_ACTIVATIONS = {
    None: lambda z: z,
    "relu": lambda z: np.maximum(z, 0.0),
    "gelu": lambda z: 0.5 * z * (1.0 + _erf(z / np.sqrt(2.0))),
    "gelu_tanh": lambda z: 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z ** 3))),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
}


def _erf(z):
    try:
        from scipy.special import erf
        return erf(z)
    except ImportError:  # math.erf, vectorised: exact to double precision, fine for a reference
        import math
        return np.vectorize(math.erf, otypes=[np.float64])(z)


def apply_activation(z: np.ndarray, name) -> np.ndarray:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(k for k in _ACTIVATIONS if k)} or None, got {name!r}")
    with np.errstate(over="ignore"):
        return _ACTIVATIONS[name](z)


def fp4_matmul(a, w, bias=None, activation=None, out_dtype=None):
    """activation(a @ dequantize(w).T + bias) in float64, cast to out_dtype (default: a's dtype, or
    float16 when `a` is itself an FP4Tensor, W4A4, or an FP8Tensor, W4A8)."""
    if getattr(a, "format", None) == "fp8":  # FP8Tensor (W4A8)
        a64 = dequantize_fp8(np.asarray(a.data), np.asarray(a.scales)).astype(np.float64)
        default_dtype = np.float16
    elif hasattr(a, "format"):  # FP4Tensor
        a64 = dequantize(a).astype(np.float64)
        default_dtype = np.float16
    else:
        a64 = np.asarray(a).astype(np.float64)
        default_dtype = np.asarray(a).dtype
    w64 = dequantize(w).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / Inf inputs give NaN / Inf outputs (docs/nan.md)
        z = a64 @ w64.T
    if bias is not None:
        z = z + np.asarray(bias).astype(np.float64)
    return _round_from_f64(apply_activation(z, activation), np.dtype(out_dtype or default_dtype))


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

# Attention follows docs/attention.md. Every function works on one sequence at a time, one KV head at a
# time, and a block of query rows at a time, so the largest temporary is about _BLOCK_ELEMS float64
# scores (16 MiB) whatever the sequence length. Arguments are assumed valid: the public functions run
# vbw_cupy._checks on them first.

import math as _math

_BLOCK_ROWS = 256            # query rows per block, at most
_BLOCK_ELEMS = 1 << 21       # score elements per block, at most (rows shrink when Sk * group is large)


# ---- the computation ------------------------------------------------------------------------

def _scale(softmax_scale, D):
    """`softmax_scale`, or 1/sqrt(D) when it is None, as a float."""
    return 1.0 / _math.sqrt(D) if softmax_scale is None else float(softmax_scale)


def _window(window, causal):
    """(left, right) as ints, right = 0 when `causal` (docs/attention.md; any left window is kept)."""
    left, right = int(window[0]), int(window[1])
    return (left, 0) if causal else (left, right)


def flash_attention_fp8(q, k, v, descale=None, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                        return_lse=False, out_dtype=np.float16):
    """FP8 attention: `flash_attention` in float64 on the inputs E4M3(q) * descale[0], E4M3(k) * descale[1],
    E4M3(v) * descale[2] (q, k, v uint8 E4M3 codes [B, S, H, D]; descale None = ones), o rounded once to
    out_dtype. descale [3] (one per tensor), [3, Hkv] (one per KV head: query head h takes that of KV head h // (Hq /
    Hkv)) or [3, B, Hkv] (one per batch and KV head)."""
    ds = np.ones(3) if descale is None else np.asarray(descale, dtype=np.float32).astype(np.float64)
    dq, dk, dv = (e4m3_decode(c).astype(np.float64) * fp8_head_descale(ds[i], c.shape)
                  for i, c in enumerate((q, k, v)))
    o, lse = flash_attention(dq, dk, dv, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                             return_lse=True)
    o = _round_from_f64(o, out_dtype)
    return (o, lse) if return_lse else o


def fp8_head_descale(ds, shape):
    """One tensor's descales (a scalar, [Hkv] or [B, Hkv]) as an array that broadcasts over its values [B, S, H,
    D]: H may be a multiple of Hkv (query heads share their KV head's)."""
    ds = np.asarray(ds)
    if ds.ndim == 0:
        return ds
    per = np.repeat(ds, shape[2] // ds.shape[-1], axis=-1)   # [H] or [B, H]
    return per[None, None, :, None] if per.ndim == 1 else per[:, None, :, None]


def _round_from_f64(x, dtype):
    """Round float64 `x` to `dtype` once (round-to-nearest-even).

    NumPy rounds float64 -> float16 / float32 directly, but ml_dtypes casts float64 -> bfloat16 through
    float32, which rounds twice. Rounding to float32 with round-to-odd first (truncate, then set the last
    bit when inexact) keeps the information a second rounding needs, so float32 -> bfloat16 is then exact.
    """
    dtype = np.dtype(dtype)
    if dtype != np.dtype(_ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):  # past the dtype's range: +-Inf, as the GPU kernels round
            return x.astype(dtype)
    y = x.astype(np.float32)
    back = y.astype(np.float64)
    y = np.where(np.abs(back) > np.abs(x), np.nextafter(y, np.float32(0)), y)   # truncate toward zero
    bits = y.view(np.uint32) | (y.astype(np.float64) != x).astype(np.uint32)     # sticky bit
    return bits.view(np.float32).astype(dtype)


def _query_blocks(Sq, Sk, group, left, right):
    """Yield (i0, i1, j0, j1, mask): query rows [i0, i1), the keys [j0, j1) any of them may see, and
    mask[r, c] True iff query i0 + r sees key j0 + c (bottom-right aligned, docs/attention.md)."""
    offset = Sk - Sq
    left, right = (-1 if w > Sq + Sk else w for w in (left, right))  # wider than any distance: unbounded
    rows = max(1, min(_BLOCK_ROWS, _BLOCK_ELEMS // (group * max(Sk, 1))))
    for i0 in range(0, Sq, rows):
        i1 = min(Sq, i0 + rows)
        j0 = 0 if left < 0 else min(Sk, max(0, i0 + offset - left))
        j1 = Sk if right < 0 else min(Sk, max(0, i1 - 1 + offset + right + 1))
        j1 = max(j0, j1)
        diag = np.arange(i0, i1)[:, None] + offset            # key index aligned with each query
        j = np.arange(j0, j1)[None, :]
        mask = np.ones((i1 - i0, j1 - j0), dtype=bool)
        if left >= 0:
            mask &= j >= diag - left
        if right >= 0:
            mask &= j <= diag + right
        yield i0, i1, j0, j1, mask


def _masked_pv(p, v, mask):
    """p @ v over the keys each row sees: p [group, rows, keys] (0 where masked), v [keys, D], mask [rows, keys].
    A NaN / Inf in v reaches only the rows that see its key (a plain p @ v would spread 0 * NaN to every row)."""
    bad = ~np.isfinite(v)
    pv = p @ np.where(bad, 0.0, v)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in np.flatnonzero(bad.any(axis=1)):    # the few keys holding NaN / Inf: added where seen
            pv += np.where(mask[:, j, None], p[..., j, None] * v[j], 0.0)
    return pv


def _softmax_pv(qb, kb, vb, mask, scale, softcap, p_dtype=None):
    """Masked attention of one block in qb's float dtype: qb [group, rows, D], kb and vb [keys, D], mask [rows,
    keys]. Returns (o = softmax(s) V, the row max m of s, the row sum l of exp(s - m), seen: the row sees a
    key), m, l and seen [group, rows, 1]; a row that sees no key has o 0. `p_dtype`: P rounded to it (after l)
    before P V.

    NaN / Inf in an input reach exactly the outputs that depend on them: masked keys are dropped before any
    product, so a bad key or value only affects the rows that see it, and a NaN query row is NaN."""
    ft = qb.dtype.type
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / Inf inputs propagate, quietly
        s = (qb @ kb.T) * scale                                              # [group, rows, keys]
        if softcap > 0:
            cap = ft(softcap)
            s = cap * np.tanh(s / cap)
        s = np.where(mask, s, ft(-np.inf))
        m = s.max(axis=-1, keepdims=True, initial=ft(-np.inf))              # NaN if a seen score is NaN
        p = np.exp(s - np.where(m == -np.inf, ft(0), m))                    # 0 where masked
        l = p.sum(axis=-1, keepdims=True, dtype=qb.dtype)      # >= 1 where a key is seen (finite inputs)
        if p_dtype is not None:
            p = p.astype(p_dtype).astype(qb.dtype)
        seen = np.broadcast_to(mask.any(axis=-1)[:, None], l.shape)
        o = np.divide(_masked_pv(p, vb, mask), l, out=np.zeros(qb.shape, dtype=qb.dtype), where=seen)
    return o, m, l, seen


def _attend(q, k, v, out, lse, scale, left, right, softcap):
    """One sequence in float64: q [Sq, Hq, D], k and v [Sk, Hkv, D] (any float dtype, Sk may be 0).
    Writes out [Sq, Hq, D] (rounded to out's dtype) and, when lse is not None, lse [Hq, Sq].

    NaN / Inf in an input reach exactly the outputs that depend on them: masked keys are dropped before any
    product, so a bad key or value only affects the rows that see it, and a NaN query row is NaN (lse NaN).
    A row that sees no key is 0 with lse -inf."""
    Sq, Hq, _ = q.shape
    Sk, Hkv, _ = k.shape
    group = Hq // Hkv
    for h in range(Hkv):
        heads = slice(h * group, (h + 1) * group)        # query heads that share KV head h
        kh = k[:, h, :].astype(np.float64)
        vh = v[:, h, :].astype(np.float64)
        for i0, i1, j0, j1, mask in _query_blocks(Sq, Sk, group, left, right):
            qb = q[i0:i1, heads, :].astype(np.float64).transpose(1, 0, 2)      # [group, rows, D]
            o, m, l, seen = _softmax_pv(qb, kh[j0:j1], vh[j0:j1], mask, scale, softcap)
            out[i0:i1, heads, :] = _round_from_f64(o.transpose(1, 0, 2), out.dtype)
            if lse is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    lse[heads, i0:i1] = np.where(seen, m + np.log(l), -np.inf)[..., 0]


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                    return_lse=False):
    """Attention in float64 (docs/attention.md), the ground truth for the GPU kernel.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]: float16, bfloat16 or float32 NumPy arrays of one dtype,
    Hq % Hkv == 0 (query head h reads KV head h // (Hq // Hkv)), 1 <= D <= 256.
    Scores are `softmax_scale * q.k` (default 1/sqrt(D)), then `softcap * tanh(s / softcap)` when
    softcap > 0. Query i sees key j iff `i + Sk - Sq - left <= j <= i + Sk - Sq + right` with
    (left, right) = window (-1 unbounded); `causal=True` sets right = 0 (bottom-right aligned). A query
    that sees no key gets output 0 and lse -inf.

    Returns o [B, Sq, Hq, D] in q's dtype (rounded once from float64), and with `return_lse=True` also
    lse float32 [B, Hq, Sq], the natural log of each row's softmax denominator.

    >>> q = np.random.default_rng(0).standard_normal((1, 5, 4, 8)).astype(np.float16)
    >>> kv = np.random.default_rng(1).standard_normal((1, 7, 2, 8)).astype(np.float16)
    >>> flash_attention(q, kv, kv, causal=True).shape
    (1, 5, 4, 8)
    """
    B, Sq, Hq, D = q.shape
    left, right = _window(window, causal)
    scale, softcap = _scale(softmax_scale, D), float(softcap)
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty((B, Hq, Sq), dtype=np.float32) if return_lse else None
    for b in range(B):
        _attend(q[b], k[b], v[b], out[b], None if lse is None else lse[b], scale, left, right, softcap)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False):
    """`flash_attention` over packed sequences of different lengths, in float64.

    q [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence b holds q rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and k, v rows cu_seqlens_k[b]:cu_seqlens_k[b+1] (int32 [B + 1],
    starting at 0, non-decreasing, ending at total_q / total_k). Each sequence is attended on its own
    with the rules of `flash_attention` (causal aligned bottom-right within the sequence); a sequence with
    no keys gives output 0 and lse -inf for its queries. `max_seqlen_q` / `max_seqlen_k` are unused here
    (`vbw_cupy.flash_attention_varlen` checks them).

    Returns o [total_q, Hq, D] in q's dtype, and with `return_lse=True` lse float32 [Hq, total_q].
    """
    total_q, Hq, D = q.shape
    left, right = _window(window, causal)
    scale, softcap = _scale(softmax_scale, D), float(softcap)
    cu_q, cu_k = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    out = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty((Hq, total_q), dtype=np.float32) if return_lse else None
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qe > qs:
            _attend(q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], None if lse is None else lse[:, qs:qe],
                    scale, left, right, softcap)
    return (out, lse) if return_lse else out


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, softcap=0.0,
                    window=(-1, -1)):
    """Decode attention over a paged KV cache, in float64: one query token per sequence.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table int32 [B, max_blocks];
    seq_lens int32 [B]. Token t of sequence b lives at k_cache[block_table[b, t // block_size],
    t % block_size]. The query is the sequence's last token (position seq_lens[b] - 1) and sees its
    seq_lens[b] keys, limited by `window` exactly as `flash_attention` with Sq = 1, Sk = seq_lens[b]
    (so only `left` matters). Returns [B, Hq, D] in q's dtype.
    """
    B, _, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    left, right = _window(window, False)
    scale, softcap = _scale(softmax_scale, D), float(softcap)
    table, lens = np.asarray(block_table, np.int64), np.asarray(seq_lens, np.int64)
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(B):
        n = int(lens[b])
        blocks = table[b, :-(-n // bs)]
        k = k_cache[blocks].reshape(-1, Hkv, D)[:n]
        v = v_cache[blocks].reshape(-1, Hkv, D)[:n]
        _attend(q[b][None], k, v, out[b][None], None, scale, left, right, softcap)
    return out


def block_sparse_attention(q, k, v, indptr, indices, *, block_q, block_k, causal=False, softmax_scale=None,
                           softcap=0.0, return_lse=False, lowp=False):
    """Block-sparse attention in float64: query block qb (rows qb * block_q ..) sees the keys of the key blocks
    its pattern lists, indices[indptr[qb]:indptr[qb + 1]] (key block j holds keys j * block_k ..), limited to
    keys j <= i when `causal` (positions aligned at 0) and to j < Sk.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]; indptr [n_q_blocks + 1] and indices [nnz] (one pattern for all
    (batch, head)), or indptr [B, Hkv, n_q_blocks + 1] and indices [B, Hkv, nnz] (query head h of batch b uses
    pattern (b, h // (Hq // Hkv))). Scores, softcap and the empty-row rule are `flash_attention`'s (a row that
    sees no key gets 0 and lse -inf). `lowp=True` computes docs/accuracy.md's same-dtype baseline instead
    (`sdpa_lowp`'s steps). Returns o [B, Sq, Hq, D] in q's dtype (and lse float32 [B, Hq, Sq]).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    ft = np.float32 if lowp else np.float64
    scale = ft(_scale(softmax_scale, D))
    cap = ft(float(softcap))
    ptr = np.asarray(indptr, np.int64).reshape(-1, np.shape(indptr)[-1])
    idx = np.asarray(indices, np.int64).reshape(ptr.shape[0], -1)
    out = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((B, Hq, Sq), -np.inf, dtype=np.float32) if return_lse else None
    for b in range(B):
        for h in range(Hkv):
            p = 0 if ptr.shape[0] == 1 else b * Hkv + h
            heads = slice(h * group, (h + 1) * group)
            kh, vh = k[b, :, h, :].astype(ft), v[b, :, h, :].astype(ft)
            for qb in range(ptr.shape[1] - 1):
                i0, i1 = qb * block_q, min(Sq, (qb + 1) * block_q)
                blocks = idx[p, ptr[p, qb]:ptr[p, qb + 1]]
                keys = (blocks[:, None] * block_k + np.arange(block_k)[None, :]).reshape(-1)
                keys = keys[keys < Sk]
                qq = q[b, i0:i1, heads, :].astype(ft).transpose(1, 0, 2)          # [group, rows, D]
                mask = (keys[None, :] <= np.arange(i0, i1)[:, None] if causal else
                        np.ones((i1 - i0, keys.size), dtype=bool))                 # [rows, keys]
                o, m, l, seen = _softmax_pv(qq, kh[keys], vh[keys], mask, scale, cap, q.dtype if lowp else None)
                out[b, i0:i1, heads, :] = (o.astype(q.dtype) if lowp else _round_from_f64(o, q.dtype)).transpose(1, 0, 2)
                if lse is not None:
                    with np.errstate(divide="ignore", invalid="ignore"):
                        lse[b, heads, i0:i1] = np.where(seen, m + np.log(l), -np.inf)[..., 0]
    return (out, lse) if return_lse else out


def sdpa_lowp(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """The same attention computed the way flash-attn does in the input precision: docs/accuracy.md's
    baseline ("the error of a same-dtype computation with float32 softmax").

    Same arguments and masks as `flash_attention`. Steps, per query row: scores q.k from the input
    values with float32 products and sums, times softmax_scale in float32, softcap in float32;
    p = exp(s - rowmax) in float32 and l = sum(p) in float32; p rounded to the input dtype; p @ v with
    float32 accumulation; divided by l in float32; rounded to the input dtype. (Unlike the kernel there is
    no online rescaling: the row max is exact, which only makes this baseline slightly better.)
    Rows that see no key give 0. A GPU result passes when
    `err(gpu) <= 2 * err(sdpa_lowp)` (relative Frobenius errors against `flash_attention` in float64) and
    under the absolute cap of docs/accuracy.md for its dtype.

    Returns o [B, Sq, Hq, D] in q's dtype.
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    left, right = _window(window, causal)
    scale = np.float32(_scale(softmax_scale, D))
    cap = np.float32(float(softcap))
    group = Hq // Hkv
    f32 = np.float32
    out = np.empty(q.shape, dtype=q.dtype)
    for b in range(B):
        for h in range(Hkv):
            heads = slice(h * group, (h + 1) * group)
            kh = k[b, :, h, :].astype(f32)
            vh = v[b, :, h, :].astype(f32)
            for i0, i1, j0, j1, mask in _query_blocks(Sq, Sk, group, left, right):
                qb = q[b, i0:i1, heads, :].astype(f32).transpose(1, 0, 2)
                s = (qb @ kh[j0:j1].T) * scale
                if cap > 0:
                    s = cap * np.tanh(s / cap)
                s = np.where(mask, s, f32(-np.inf))
                m = s.max(axis=-1, keepdims=True, initial=f32(-np.inf))
                m = np.where(np.isfinite(m), m, f32(0))
                p = np.exp(s - m)
                l = p.sum(axis=-1, keepdims=True, dtype=f32)
                p = p.astype(q.dtype).astype(f32)
                o = np.divide(p @ vh[j0:j1], l, out=np.zeros(qb.shape, dtype=f32), where=l > 0)
                out[b, i0:i1, heads, :] = o.astype(q.dtype).transpose(1, 0, 2)
    return out
