"""FP8 attention (vbw_cupy.attention_fp8): quantize_e4m3 bit-exact with the reference, flash_attention_fp8 against
the float64 reference on the decoded inputs.

Bound (docs/accuracy.md, FP8 attention): the relative Frobenius error against float64 is at most twice that of
the same computation in float32 with P rounded to E4M3 as the kernel rounds it (`attention_fp8._emulated`). CPU
tests check the reference path, the argument errors and that the bound is a real one (the emulation's error is
well above float32 rounding and well below the inputs' own E4M3 rounding error). The CUDA-graph test of both ops
is in tests/test_call_path.py with the other ops'.
"""
import ml_dtypes
import numpy as np
import pytest

import vbw_cupy as vc
from vbw_cupy import attention_fp8 as F
from vbw_cupy import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
gpu = pytest.mark.gpu


def _codes(rng, shapes, dtype=np.float16):
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    qs = [ref.quantize_e4m3_tensor(x) for x in xs]
    return xs, [c for c, _ in qs], np.concatenate([d for _, d in qs])


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_quantize_e4m3_reference_round_trip(dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 257)) * 10).astype(dtype)
    codes, ds = vc.quantize_e4m3(x)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and ds.shape == (1,) and ds.dtype == np.float32
    x32 = x.astype(np.float32)
    assert ds[0] == np.float32(np.abs(x32).max()) / np.float32(448)
    back = ref.e4m3_decode(codes) * ds[0]
    # E4M3 keeps 4 significant bits: within half an ulp (2^-4 relative) of x, or of the subnormal step below 2^-6
    tol = np.maximum(np.abs(x32) * 2.0 ** -4, 2.0 ** -10 * ds[0]) * 1.0001
    assert np.all(np.abs(back - x32) <= tol)
    assert np.abs(ref.e4m3_decode(codes)).max() == 448    # the largest magnitude maps to 448 exactly


def test_quantize_e4m3_special_values():
    z = np.zeros((4, 5), np.float16)
    codes, ds = vc.quantize_e4m3(z)
    assert ds[0] == 1 and not codes.any()
    codes, _ = vc.quantize_e4m3(np.array([-0.0, 1.0], np.float32))
    assert codes[0] == 0x80                                  # the sign of -0 is kept
    for bad in (np.nan, np.inf):
        codes, ds = vc.quantize_e4m3(np.array([1.0, bad, -2.0], np.float32))
        assert np.isnan(ds[0]) and (codes == 0x7F).all()     # nothing silently finite
    # float32 amax below ~3e-43: amax / 448 was 0, so the codes were NaN (0 / 0) and 448 (x / 0)
    tiny = np.array([1e-45, 0.0, -1e-45, 3e-45], np.float32)
    codes, ds = vc.quantize_e4m3(tiny)
    assert ds[0] == np.float32(2.0 ** -149) and not (codes & 0x7F == 0x7F).any()
    np.testing.assert_array_equal(ref.e4m3_decode(codes).astype(np.float32) * ds[0], tiny)


def test_fp8_numpy_path_is_the_reference():
    rng = np.random.default_rng(1)
    _, (q, k, v), ds = _codes(rng, [(2, 9, 4, 32), (2, 13, 2, 32), (2, 13, 2, 32)])
    o, lse = vc.flash_attention_fp8(q, k, v, ds, causal=True, return_lse=True)
    o2, lse2 = ref.flash_attention_fp8(q, k, v, ds, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    assert o.dtype == np.float16
    assert vc.flash_attention_fp8(q, k, v, out_dtype=BF16).dtype == BF16


def test_fp8_takes_ml_dtypes_float8_arrays():
    """NumPy float8_e4m3fn arrays are read as their codes: the same results as the uint8 views."""
    rng = np.random.default_rng(2)
    _, (q, k, v), ds = _codes(rng, [(1, 5, 2, 32), (1, 7, 2, 32), (1, 7, 2, 32)])
    f8 = [x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)]
    np.testing.assert_array_equal(vc.flash_attention_fp8(*f8, ds), vc.flash_attention_fp8(q, k, v, ds))
    np.testing.assert_array_equal(F.dequantize_e4m3(f8[0], ds[:1]), F.dequantize_e4m3(q, ds[:1]))


def test_fp8_reference_decodes_with_the_descales():
    rng = np.random.default_rng(2)
    xs, (q, k, v), ds = _codes(rng, [(1, 7, 2, 16)] * 3)
    dec = [(ref.e4m3_decode(c) * d).astype(np.float64) for c, d in zip((q, k, v), ds)]
    want = ref.flash_attention(*dec)
    np.testing.assert_array_equal(vc.flash_attention_fp8(q, k, v, ds, out_dtype=np.float16),
                                  want.astype(np.float16))


def test_fp8_argument_errors():
    rng = np.random.default_rng(3)
    xs, (q, k, v), ds = _codes(rng, [(1, 8, 2, 16)] * 3)
    with pytest.raises(TypeError, match="q"):
        vc.flash_attention_fp8(xs[0], k, v)
    with pytest.raises(ValueError, match="descale"):
        vc.flash_attention_fp8(q, k, v, ds[:2])
    with pytest.raises(TypeError, match="out_dtype"):
        vc.flash_attention_fp8(q, k, v, out_dtype=np.float32)
    with pytest.raises(ValueError, match="v"):
        vc.flash_attention_fp8(q, k, v[:, :4])
    with pytest.raises(TypeError, match="x"):
        vc.quantize_e4m3(np.arange(4))


def test_emulation_bound_is_a_real_bound():
    """The GPU tests' baseline: above float32 noise, below the error E4M3 inputs already carry."""
    rng = np.random.default_rng(4)
    xs, (q, k, v), ds = _codes(rng, [(1, 256, 2, 64)] * 3)
    o64 = ref.flash_attention_fp8(q, k, v, ds, causal=True, out_dtype=np.float32)
    base = ref.rel_error(F._emulated(q, k, v, ds, True), o64)
    inputs = ref.rel_error(ref.flash_attention(*[x.astype(np.float32) for x in xs], causal=True), o64)
    assert 1e-4 < base < 0.05 and base < inputs, (base, inputs)


def test_quantize_e4m3_heads_is_one_tensor_quantization_a_group():
    """heads = n: each group of H / n heads quantized as a tensor of its own (its own max |x|), NaN / Inf and
    all-zero groups included; dequantize_e4m3 with the n descales undoes it group by group."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 5, 6, 8)) * np.exp2(np.arange(6) * 3.0)[:, None]).astype(np.float32)
    x[:, :, 2:4] = 0
    x[1, 3, 5, 1] = np.nan
    codes, ds = vc.quantize_e4m3(x, heads=3)
    assert codes.shape == x.shape and ds.shape == (3,) and ds.dtype == np.float32
    for g in range(3):
        cg, dg = ref.quantize_e4m3_tensor(x[:, :, 2 * g:2 * g + 2])
        np.testing.assert_array_equal(codes[:, :, 2 * g:2 * g + 2], cg)
        np.testing.assert_array_equal(ds[g:g + 1], dg)
    assert ds[1] == 1 and np.isnan(ds[2]) and np.isfinite(ds[0])
    back = vc.dequantize_e4m3(codes, ds)
    np.testing.assert_array_equal(back[:, :, :2], vc.dequantize_e4m3(codes[:, :, :2], ds[:1]))
    np.testing.assert_array_equal(back[:, :, 2:4], 0)
    assert np.isnan(back[:, :, 4:]).all()
    # one group: the per-tensor quantization, bit for bit
    for a, b in zip(vc.quantize_e4m3(x[..., :2, :], heads=1), vc.quantize_e4m3(x[..., :2, :])):
        np.testing.assert_array_equal(a, b)


def test_quantize_e4m3_heads_errors():
    x = np.ones((2, 3, 6, 8), np.float16)
    for bad, err, msg in ((0, ValueError, r"heads: expected a positive divisor of the 6 heads"),
                          (4, ValueError, r"heads: expected a positive divisor of the 6 heads of x \(axis -2 of "
                                          r"\(2, 3, 6, 8\)\), one of \[1, 2, 3, 6\], got 4"),
                          (True, TypeError, "heads: expected None or an int, got bool"),
                          ("2", TypeError, "heads: expected None or an int, got str"),
                          (2.0, TypeError, "heads: expected None or an int, got float")):
        with pytest.raises(err, match=msg):
            vc.quantize_e4m3(x, heads=bad)
    with pytest.raises(ValueError, match=r"heads: needs x with a head axis"):
        vc.quantize_e4m3(np.ones(8, np.float16), heads=1)
    with pytest.raises(ValueError, match=r"heads: expected a positive divisor of the 0 heads.*got 7"):
        vc.quantize_e4m3(np.ones((2, 0, 8), np.float16), heads=7)
    with pytest.raises(ValueError, match=r"heads: at most 65535 groups.*got 70000"):
        vc.quantize_e4m3(np.ones((1, 70000, 1), np.float16), heads=70000)


def test_fp8_reference_per_head_descales():
    """descale [3, Hkv] and [3, B, Hkv]: the reference decodes each KV head (a query head: its KV head's) with
    its own value, as the inputs E4M3(code) * descale decoded by hand and run through flash_attention say; equal
    values everywhere are the per-tensor descale."""
    rng = np.random.default_rng(12)
    B, S, Hq, Hkv, D = 2, 40, 6, 2, 16
    q, k, v = (rng.integers(0, 0x7E, (B, S, h, D), dtype=np.uint8) for h in (Hq, Hkv, Hkv))
    ds = rng.uniform(0.01, 0.1, (3, B, Hkv)).astype(np.float32)
    for d in (ds[:, 0], ds):
        per = [ref.e4m3_decode(c).astype(np.float64) * ref.fp8_head_descale(d[i], c.shape)
               for i, c in enumerate((q, k, v))]
        for b in range(B):   # every query head by hand: head h takes KV head h // 3's descale
            for h in range(Hq):
                want = ref.e4m3_decode(q[b, :, h]).astype(np.float64) * (d[0][b, h // 3] if d.ndim == 3 else d[0][h // 3])
                np.testing.assert_array_equal(per[0][b, :, h], want)
        o, lse = ref.flash_attention_fp8(q, k, v, d, causal=True, return_lse=True, out_dtype=np.float32)
        o_want, lse_want = ref.flash_attention(*per, causal=True, return_lse=True)
        np.testing.assert_array_equal(o, o_want.astype(np.float32))
        np.testing.assert_array_equal(lse, lse_want)
        np.testing.assert_array_equal(vc.flash_attention_fp8(q, k, v, d, causal=True), o_want.astype(np.float16))
    same = np.full((3, Hkv), 0.05, np.float32)
    np.testing.assert_array_equal(vc.flash_attention_fp8(q, k, v, same), vc.flash_attention_fp8(q, k, v, same[:, 0]))
    with pytest.raises(ValueError, match=r"descale: expected shape .*irregular"):
        vc.flash_attention_fp8(q, k, v, [[1.0, 2.0], [3.0]])
    # a descale per query head (q quantized with heads=Hq): named as such
    with pytest.raises(ValueError, match=r"descale: .*got \(3, 6\).*per query head are not supported: quantize q "
                                         r"with heads=2"):
        vc.flash_attention_fp8(q, k, v, np.ones((3, Hq), np.float32))
    for bad in (np.ones((3, Hkv + 1), np.float32), np.ones((3, B + 1, Hkv), np.float32), np.ones((2, Hkv), np.float32),
                np.ones((3, 1, 1, Hkv), np.float32)):
        with pytest.raises(ValueError, match=r"descale: expected shape \(3,\), \(3, Hkv=2\) or \(3, B=2, Hkv=2\).*got " +
                           str(bad.shape).replace("(", r"\(").replace(")", r"\)")):
            vc.flash_attention_fp8(q, k, v, bad)


def test_fp8_per_head_descales_keep_small_heads():
    """Why one descale a head: heads whose magnitudes differ by 2^18 quantized with one descale lose the small
    ones to E4M3's bottom (their codes are mostly 0 or subnormal); with one a head each keeps E4M3's relative
    precision. Against float64 attention on the unquantized values, the per-head error is far below."""
    rng = np.random.default_rng(13)
    B, S, H, D = 1, 64, 4, 32
    mag = np.exp2(-6.0 * np.arange(H))[None, None, :, None]
    xs = [(rng.standard_normal((B, S, H, D)) * mag).astype(np.float32) for _ in range(3)]
    exact = ref.flash_attention(*[x.astype(np.float64) for x in xs], softmax_scale=1.0)
    errs = []
    for heads in (None, H):
        qs = [vc.quantize_e4m3(x, heads=heads) for x in xs]
        ds = np.stack([d for _, d in qs]) if heads else np.concatenate([d for _, d in qs])
        o = vc.flash_attention_fp8(*[c for c, _ in qs], ds, softmax_scale=1.0, out_dtype=BF16)
        errs.append(ref.rel_error(o[:, :, -1].astype(np.float64), exact[:, :, -1]))   # the smallest head
    assert errs[1] < 0.05 and errs[0] > 0.5, errs


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_dequantize_e4m3_reference(dtype):
    """dequantize_e4m3 on NumPy codes: E4M3(codes) * descale in float32, then dtype; every code incl. NaN."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for ds in (None, np.array([0.375], np.float32), np.float32(3.0), 2):
        got = vc.dequantize_e4m3(codes, ds, dtype)
        want = (ref.e4m3_decode(codes) * np.float32(1 if ds is None else ds)).astype(dtype)
        assert got.dtype == np.dtype(dtype) and got.shape == codes.shape
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    assert np.isnan(vc.dequantize_e4m3(np.array([0x7F, 0xFF], np.uint8))).all()
    x = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    back = vc.dequantize_e4m3(*vc.quantize_e4m3(x))
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -4 + 2.0 ** -10 * np.abs(x).max() / 448)


def test_dequantize_e4m3_errors():
    codes = np.zeros(4, np.uint8)
    with pytest.raises(TypeError, match="codes: expected uint8"):
        vc.dequantize_e4m3(codes.astype(np.int8))
    with pytest.raises(TypeError, match="dtype"):
        vc.dequantize_e4m3(codes, None, np.int32)
    with pytest.raises(ValueError, match=r"descale: expected one value"):
        vc.dequantize_e4m3(codes, np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"descale: expected one value"):
        vc.dequantize_e4m3(codes, np.ones(0, np.float32))
    # several values are one a group of heads: codes [..., H, D] with H a multiple of their number
    with pytest.raises(ValueError, match=r"descale: 3 values \(one per group of heads\).*shape \(4,\)"):
        vc.dequantize_e4m3(codes, np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"descale: 3 values .* H a multiple of 3.*\(2, 4, 8\) \(H = 4\)"):
        vc.dequantize_e4m3(np.zeros((2, 4, 8), np.uint8), np.ones(3, np.float32))
    with pytest.raises(TypeError, match="descale"):
        vc.dequantize_e4m3(codes, "x")
    with pytest.raises(TypeError, match="codes"):
        vc.dequantize_e4m3([1, 2])


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_dequantize_e4m3_bit_exact(dtype):
    """The GPU decode equals the NumPy path (values and signs, NaN where NaN): every code, with and without a
    descale, an odd size, into pool memory that held NaN (so an element left unwritten shows)."""
    cp = pytest.importorskip("cupy")
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    codes = np.random.default_rng(2).integers(0, 256, 3 * 257 * 5, dtype=np.uint8)
    codes[:256] = np.arange(256)
    for ds in (None, np.array([0.0371], np.float32)):
        c, d = cp.asarray(codes), None if ds is None else cp.asarray(ds)
        poison = cp.full(codes.size, np.nan, dtype=dt)   # the pool hands this block to the output next
        del poison
        got = vc.dequantize_e4m3(c, d, dt)
        want = vc.dequantize_e4m3(codes, ds, dt)
        assert isinstance(got, cp.ndarray) and got.dtype == dt
        g, w = got.get().astype(np.float32), want.astype(np.float32)
        np.testing.assert_array_equal(g, w)   # NaN where NaN
        np.testing.assert_array_equal(np.signbit(g[~np.isnan(w)]), np.signbit(w[~np.isnan(w)]))
    with pytest.raises(ValueError, match="descale"):
        vc.dequantize_e4m3(cp.asarray(codes), cp.ones(2, cp.float32))


def _gpu_case(B, Sq, Sk, Hq, Hkv, D, causal, out_dtype=np.float16, seed=0, descale="quantize", **opts):
    """One GPU call against the reference on the decoded inputs, within 2x the float32 emulation's error.
    descale: "quantize" (quantize_e4m3's), None (codes of the values themselves, N(0, 1)), "negq" (q's
    negated) or "zeroq" (q's 0: uniform attention); "heads" (quantize_e4m3(heads=Hkv)'s, [3, Hkv], on values
    whose KV heads differ in magnitude by up to 2^(2 (Hkv - 1))), "batch_heads" (the same a batch, [3, B,
    Hkv]), "heads_negq" (KV head 0's q descale negated, the others' not). The emulation's output is rounded to
    out_dtype as the kernel's is (where P is exact, as with a zero descale, that rounding is all the error there
    is)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(seed)
    xs = [cp.asarray(rng.standard_normal(s).astype(np.float16)) for s in ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D))]
    per_head = descale in ("heads", "batch_heads", "heads_negq")
    if per_head:   # KV head h (its query heads too) scaled by 2^-2h
        xs = [(x.astype(cp.float32) * cp.asarray(np.repeat(np.exp2(-2.0 * np.arange(Hkv)), x.shape[2] // Hkv))[:, None]
               ).astype(cp.float16) for x in xs]
    if descale == "batch_heads":
        qs = [[vc.quantize_e4m3(x[b], heads=Hkv) for b in range(B)] for x in xs]
        codes = [cp.stack([c for c, _ in q]) for q in qs]
        ds = cp.stack([cp.stack([d for _, d in q]) for q in qs])
    else:
        qs = [vc.quantize_e4m3(x, heads=Hkv if per_head else None) for x in xs]
        codes, ds = [c for c, _ in qs], (cp.stack if per_head else cp.concatenate)([d for _, d in qs])
    if descale is None:
        codes, ds = [cp.asarray(ref.e4m3_codes(x.get())) for x in xs], None
    elif descale in ("negq", "zeroq"):
        ds[0] = -ds[0] if descale == "negq" else 0
    elif descale == "heads_negq":
        ds[0, 0] = -ds[0, 0]
    o, lse = vc.flash_attention_fp8(*codes, ds, causal=causal, return_lse=True, out_dtype=out_dtype, **opts)
    hc, hd = [c.get() for c in codes], None if ds is None else ds.get()
    o64, lse64 = ref.flash_attention_fp8(*hc, hd, causal=causal, return_lse=True, out_dtype=np.float32, **opts)
    g = Hq // Hkv
    emul = F._emulated(hc[0], np.repeat(hc[1], g, axis=2), np.repeat(hc[2], g, axis=2), hd, causal, **opts)
    base = ref.rel_error(emul.astype(out_dtype).astype(np.float32), o64)
    err = ref.rel_error(o.get().astype(np.float32), o64)
    assert o.dtype == np.dtype(out_dtype) and bool(cp.isfinite(o).all())
    assert err <= 2 * base + 1e-6, (err, base)
    np.testing.assert_allclose(lse.get(), lse64, rtol=1e-3, atol=2e-3)
    return err, base


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("n", [1, 1000, 3 * 257 * 5])
def test_gpu_quantize_e4m3_bit_exact(dtype, n):
    cp = pytest.importorskip("cupy")
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = (np.random.default_rng(n).standard_normal(n) * 3).astype(dt)
    codes, ds = vc.quantize_e4m3(cp.asarray(x))
    want_codes, want_ds = ref.quantize_e4m3_tensor(x)
    np.testing.assert_array_equal(codes.get(), want_codes)
    np.testing.assert_array_equal(ds.get(), want_ds)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_quantize_e4m3_bit_exact_awkward(dtype):
    """Magnitudes over 32 binades (codes on E4M3's subnormal grid, input subnormals), float32 tensor scales outside
    [2^-90, 2^100] (the kernel's plain division; 2^-95 is where the corrected division's residual would round) and
    float32 subnormals beside normal values (its corrected division), each also as an unaligned view (copied to an
    aligned one first) and with an odd length; and float32 values a review found on an E4M3 tie at ds ~ 2^-97."""
    cp = pytest.importorskip("cupy")
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(4099) * np.exp2(rng.uniform(-24, 8, 4099))
    cases = [x]
    if dtype == "float32":
        cases += [x * 2.0 ** -120, x * 2.0 ** -95, x * 2.0 ** 110, np.concatenate([x, x * 2.0 ** -140]),
                  np.array([0x135FFFFF, 0x0A000000, 0x8A000000], np.uint32).view(np.float32),
                  np.array([1e-45, 0.0, -1e-45, 3e-45], np.float32)]   # (amax / 448 underflowing to 0)
    for c in cases:
        xd = c.astype(dt)
        want_codes, want_ds = ref.quantize_e4m3_tensor(xd)
        for arr in (cp.asarray(xd), cp.asarray(np.concatenate([xd[:1], xd]))[1:]):
            codes, ds = vc.quantize_e4m3(arr)
            np.testing.assert_array_equal(codes.get(), want_codes)
            np.testing.assert_array_equal(ds.get(), want_ds)


@gpu
def test_gpu_quantize_e4m3_special_values():
    cp = pytest.importorskip("cupy")
    for x in (np.zeros(300, np.float16), np.array([1.0, np.nan, -3.0], np.float32),
              np.array([np.inf, 1.0], np.float32), np.array([-0.0, 2.0, -1e-30], np.float32)):
        codes, ds = vc.quantize_e4m3(cp.asarray(x))
        want_codes, want_ds = ref.quantize_e4m3_tensor(x)
        np.testing.assert_array_equal(codes.get(), want_codes)
        np.testing.assert_array_equal(ds.get(), want_ds)


@gpu
@pytest.mark.parametrize("shape", [(2, 300, 300, 4, 4, 128, True), (1, 200, 777, 8, 2, 128, False),
                                   (1, 1024, 1024, 2, 2, 128, True), (1, 512, 512, 4, 4, 64, True),
                                   (1, 130, 260, 2, 1, 96, False), (1, 257, 257, 2, 2, 40, True)],
                         ids=lambda s: "B{}-Sq{}-Sk{}-H{}/{}-D{}-{}{}".format(*s[:6], "causal" if s[6] else "full",
                                                                             "-fallback" if s[5] % 16 else ""))
def test_gpu_fp8_attention_within_bound(shape):
    _gpu_case(*shape)


@gpu
@pytest.mark.parametrize("case", ["softcap", "negative_scale", "window", "rows_without_keys", "descale_none",
                                  "negative_descale", "zero_descale"])
def test_gpu_fp8_options(case):
    """The score modes the descales fold into (softcap, a softmax_scale <= 0, a descale <= 0), windows, rows
    that see no key (o 0, lse -inf), no descale."""
    kw = {"softcap": dict(softcap=20.0), "negative_scale": dict(softmax_scale=-0.05),
          "window": dict(window=(40, 8)), "descale_none": dict(descale=None),
          "negative_descale": dict(descale="negq"), "zero_descale": dict(descale="zeroq")}.get(case, {})
    if case == "rows_without_keys":
        _gpu_case(1, 300, 200, 4, 2, 128, True)
    else:
        _gpu_case(1, 333, 333, 4, 2, 128, case != "window", **kw)


@gpu
@pytest.mark.parametrize("Sk,causal", [(700, True), (8192, False)])
def test_gpu_fp8_persistent_and_long_tiles(monkeypatch, Sk, causal):
    """Below 8k keys the persistent tile ("wsp") on a grid of 3 CTAs, so each walks many work tiles (the ring,
    Q's buffer and the turns carried from tile to tile); from 8k keys the non-persistent one."""
    monkeypatch.setattr(F._attn._device, "num_sms", lambda: 3)
    assert F._config(Sk)["KIND"] == ("wsp" if Sk < 8192 else "ws")
    _gpu_case(2, 300 if Sk < 8192 else 128, Sk, 4, 2, 128, causal, seed=Sk)


@gpu
@pytest.mark.parametrize("descale", ["heads", "batch_heads", "heads_negq"])
@pytest.mark.parametrize("Sk,causal", [(700, True), (8192, False)])
def test_gpu_fp8_per_head_descales(monkeypatch, descale, Sk, causal):
    """Descales a KV head (a batch and KV head) on values whose heads differ in magnitude, GQA (4 query heads a
    KV head): the persistent tile on 3 CTAs, each walking work tiles of several heads (the descales fold into
    each tile's score scale, a negative one into a prescale of that head only), and from 8k keys the
    non-persistent one."""
    monkeypatch.setattr(F._attn._device, "num_sms", lambda: 3)
    _gpu_case(2, 300 if Sk < 8192 else 128, Sk, 8, 2, 128, causal, seed=Sk + 1, descale=descale)


@gpu
def test_gpu_fp8_nan_in_one_kv_head_stays_there():
    """One descale a KV head: a NaN in v's KV head 0 makes its descale NaN and the rows of its query heads NaN;
    the other heads' outputs are bit for bit those of the same call without the NaN."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(21)
    xs = [cp.asarray(rng.standard_normal((1, 256, h, 128)).astype(np.float16)) for h in (6, 3, 3)]
    outs = []
    for poison in (False, True):
        v = xs[2].copy()
        if poison:
            v[0, 17, 0, 5] = np.nan
        qs = [vc.quantize_e4m3(t, heads=3) for t in (xs[0], xs[1], v)]
        assert bool(cp.isnan(qs[2][1][0])) == poison and bool(cp.isfinite(qs[2][1][1:]).all())
        outs.append(vc.flash_attention_fp8(*[c for c, _ in qs], cp.stack([d for _, d in qs]), causal=True).get())
    assert np.isnan(outs[1][:, :, :2]).all()                       # query heads 0, 1: KV head 0
    np.testing.assert_array_equal(outs[1][:, :, 2:], outs[0][:, :, 2:])
    assert np.isfinite(outs[0]).all()


@gpu
@pytest.mark.parametrize("descale", ["heads", "batch_heads"])
def test_gpu_fp8_per_head_fallback(monkeypatch, descale):
    """Off sm_90 (here forced) per-head descales decode each KV head's values (a query head's: its group's)."""
    monkeypatch.setattr(F, "_fp8_kernel_runs", lambda *args: False)
    _gpu_case(2, 200, 200, 6, 3, 128, True, descale=descale)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape,heads", [((2, 300, 8, 128), 8), ((2, 300, 8, 128), 2), ((3, 7, 6, 5), 3),
                                         ((1, 4099, 4, 16), 1), ((5, 3, 2, 4), 2), ((2, 64, 32, 128), 2)])
def test_gpu_quantize_e4m3_heads_bit_exact(monkeypatch, dtype, shape, heads):
    """quantize_e4m3(heads=n) and dequantize_e4m3 with its n descales, bit-exact with the reference: 16-byte
    chunks (a group's row G a multiple of them) and element by element (G = 10, and G = 4 for 16-bit x), a
    group's row of more chunks than a CTA has threads (G = 2048), a grid (patched to one SM) that walks the rows
    several times, heads of magnitudes 2^-12 .. 1, one group NaN and one all zero where there are enough."""
    cp = pytest.importorskip("cupy")
    monkeypatch.setattr(F._device, "num_sms", lambda: 1)
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(sum(shape) + heads)
    x = rng.standard_normal(shape) * np.exp2(-12.0 * rng.random(shape[-2]))[:, None]
    if heads >= 3:
        x[..., :shape[-2] // heads, :] = 0
        x[0, 0, -1, 0] = np.nan
    x = x.astype(dt)
    codes, ds = vc.quantize_e4m3(cp.asarray(x), heads=heads)
    want_codes, want_ds = ref.quantize_e4m3_tensor(x, heads)
    np.testing.assert_array_equal(codes.get(), want_codes)
    np.testing.assert_array_equal(ds.get(), want_ds)
    for out in ("float32", "float16"):
        np.testing.assert_array_equal(vc.dequantize_e4m3(codes, ds, out).get(),
                                      vc.dequantize_e4m3(want_codes, want_ds, out))


@gpu
def test_gpu_fp8_attention_bfloat16_out():
    _gpu_case(1, 384, 384, 2, 2, 128, True, out_dtype=BF16)


@gpu
def test_gpu_fp8_fallback_within_bound(monkeypatch):
    """Off sm_90 (here forced) the codes are decoded and flash_attention runs: the same bound holds."""
    monkeypatch.setattr(F, "_fp8_kernel_runs", lambda *args: False)
    _gpu_case(1, 300, 300, 4, 2, 128, True)



@gpu
@pytest.mark.parametrize("with_descale", [True, False, "heads"])
def test_gpu_fp8_repeated_call_replays_the_same_launches(with_descale):
    """The second call of a signature takes the packed fast path: identical results, new array addresses and
    values included (compared with the full path run after clearing the plans), and a strided input after it
    goes back to the full path."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(9)

    def inputs():
        xs = [cp.asarray(rng.standard_normal((2, 200, 4, 128)).astype(np.float16)) for _ in range(3)]
        if with_descale == "heads":
            qs = [vc.quantize_e4m3(x, heads=4) for x in xs]
            return [c for c, _ in qs], cp.stack([d for _, d in qs])
        qs = [vc.quantize_e4m3(x) for x in xs]
        return [c for c, _ in qs], (cp.concatenate([d for _, d in qs]) if with_descale else None)

    codes, ds = inputs()
    first = vc.flash_attention_fp8(*codes, ds, causal=True, return_lse=True)
    key = F._fast_key(*codes, ds, True, None, (-1, -1), 0.0, True, np.float16)
    assert F._fast_plans.get(key) is not None, "the first call left no plan to replay"
    again = vc.flash_attention_fp8(*codes, ds, causal=True, return_lse=True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.get(), b.get())
    codes2, ds2 = inputs()                                   # new addresses and values: the fast path again
    fast = vc.flash_attention_fp8(*codes2, ds2, causal=True, return_lse=True)
    F._fast_plans.clear()
    full = vc.flash_attention_fp8(*codes2, ds2, causal=True, return_lse=True)
    for a, b in zip(fast, full):
        np.testing.assert_array_equal(a.get(), b.get())
    if with_descale is True:   # the same inputs with one descale a KV head: not this plan's kernel arguments
        per_head = cp.stack([cp.broadcast_to(d, (4,)) for d in ds2]) * cp.asarray([1.0, 0.5, 2.0, 1.0], cp.float32)
        got = vc.flash_attention_fp8(*codes2, per_head, causal=True, return_lse=True)
        F._fast_plans.clear()
        for a, b in zip(got, vc.flash_attention_fp8(*codes2, per_head, causal=True, return_lse=True)):
            np.testing.assert_array_equal(a.get(), b.get())
        assert not np.array_equal(got[0].get(), full[0].get())
    strided = cp.ascontiguousarray(cp.concatenate([codes2[0], codes2[0]], axis=3))[..., :128]   # a view
    np.testing.assert_array_equal(vc.flash_attention_fp8(strided, codes2[1], codes2[2], ds2, causal=True).get(),
                                  full[0].get())
