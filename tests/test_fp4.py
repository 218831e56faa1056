"""FP4 formats: the reference against ml_dtypes and the rules of docs/formats.md; the GPU kernels bit for bit against it."""
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import vbw_cupy as vc
from vbw_cupy import reference as ref

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float16, BF16, np.float32]
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def random_input(shape, dtype, seed=0):
    """Normal values with per-row magnitudes spread over 2^-10 .. 2^10, so blocks see many scales."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-10, 10, shape[:-1] + (1,)))
    return (rng.standard_normal(shape) * mag).astype(dtype)


# ---------------------------------------------------------------- reference, CPU

def test_e2m1_ties_and_saturation():
    x = np.array(TIES + [-t for t in TIES] + [7.0, np.inf, -np.inf, 0.0, -0.0, 6.0, 1e30], np.float32)
    want = [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 7, 7, 15, 0, 8, 7, 7]
    assert ref.e2m1_encode(x).tolist() == want
    np.testing.assert_array_equal(ref.e2m1_decode(np.arange(16)), ref.E2M1_VALUES)


def test_e2m1_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000) * 3, rng.uniform(-8, 8, 100_000),
                        np.arange(-64, 65) / 8.0]).astype(np.float32)
    np.testing.assert_array_equal(ref.e2m1_encode(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def test_e4m3_matches_ml_dtypes():
    rng = np.random.default_rng(2)
    s = np.exp2(rng.uniform(-9, np.log2(448), 200_000)).astype(np.float32)
    s = np.clip(np.concatenate([s, ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max * np.ones(1, np.float32),
                                np.float32([2.0 ** -9, 2.0 ** -6, 0.0029296875])]), 2.0 ** -9, 448).astype(np.float32)
    codes = ref.e4m3_encode(s)
    np.testing.assert_array_equal(codes, s.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    np.testing.assert_array_equal(ref.e4m3_decode(codes),
                                  codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 15, 16, 31, 32, 33, 100, 4096])
def test_mxfp4_reference_rules(dtype, K):
    x = random_input((7, K), dtype, seed=K)
    t = vc.quantize(x, "mxfp4")
    nb = -(-K // 32)
    assert t.data.shape == (7, nb * 16) and t.scales.shape == (7, nb) and t.global_scale == 1.0
    assert t.nbytes == 7 * nb * 16 + 7 * nb + 4
    xp = np.zeros((7, nb * 32), np.float64)
    xp[:, :K] = x.astype(np.float64)
    blk = xp.reshape(7, nb, 32)
    amax = np.abs(blk).max(-1)
    e = np.where(amax == 0, -127, np.clip(np.floor(np.log2(np.where(amax == 0, 1, amax))) - 2, -127, 127))
    np.testing.assert_array_equal(t.scales, (e + 127).astype(np.uint8))
    # element codes: ml_dtypes' own E2M1 rounding of x / 2^e
    want = (blk / np.exp2(e)[..., None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    want = want.reshape(7, -1)
    np.testing.assert_array_equal(t.data & 15, want[:, 0::2])
    np.testing.assert_array_equal(t.data >> 4, want[:, 1::2])
    d = vc.dequantize(t)  # exact: e2m1 * 2^e
    np.testing.assert_array_equal(d, (want.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
                                      * np.repeat(np.exp2(e), 32, axis=1))[:, :K].astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 16, 17, 100, 4096])
def test_nvfp4_reference_rules(dtype, K):
    x = random_input((5, K), dtype, seed=K + 1)
    t = vc.quantize(x, "nvfp4")
    x32 = x.astype(np.float32)
    gs = np.float32(np.abs(x32).max()) / np.float32(2688.0)
    assert t.global_scale == gs and t.global_scale.dtype == np.float32
    nb = -(-K // 16)
    xp = np.zeros((5, nb * 16), np.float32)
    xp[:, :K] = x32
    blk = xp.reshape(5, nb, 16)
    s = (np.abs(blk).max(-1) / np.float32(6)).astype(np.float32) / gs
    s = np.clip(s, np.float32(2 ** -9), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(t.scales, s.view(np.uint8))
    denom = (s.astype(np.float32) * gs).astype(np.float32)
    q = (blk / denom[..., None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(5, -1)
    np.testing.assert_array_equal(t.data & 15, q[:, 0::2])
    np.testing.assert_array_equal(t.data >> 4, q[:, 1::2])
    vals = q.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.repeat(s.astype(np.float32), 16, axis=1)
    np.testing.assert_array_equal(vc.dequantize(t), (vals.astype(np.float32) * gs)[:, :K])


def test_edge_blocks_reference():
    x = np.zeros((4, 32), np.float32)
    x[1] = 1e-38  # e = floor(log2(1e-38)) - 2 = -129 clamps to -127; 3e-39 is a float32 denormal
    x[1, ::2] = 3e-39
    x[2, :4] = [np.nan, 1.0, 2.0, 3.0]
    x[3, :4] = [np.inf, 1.0, 2.0, 3.0]
    t = vc.quantize(x, "mxfp4")
    assert t.scales[:, 0].tolist() == [0, 0, 255, 255]
    d = vc.dequantize(t)
    assert np.all(d[0] == 0) and np.all(np.isnan(d[2])) and np.all(np.isnan(d[3]))
    assert np.all(d[1] > 0)
    z = vc.quantize(np.zeros((2, 16), np.float16), "nvfp4")
    assert z.global_scale == 1.0 and np.all(vc.dequantize(z) == 0)


def test_signed_zero():
    t = vc.quantize(np.array([[-0.0, 0.0, -0.01, 1.0]], np.float32), "mxfp4")
    assert (t.data[0, 0] & 15, t.data[0, 0] >> 4, t.data[0, 1] & 15) == (8, 0, 8)


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: vc.quantize(np.ones((2, 4), np.float64)), TypeError, "float16, bfloat16 or float32"),
    (lambda: vc.quantize(np.ones((2, 0), np.float32)), ValueError, "non-empty"),
    (lambda: vc.quantize(np.ones((), np.float32)), ValueError, "non-empty"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "fp4"), ValueError, "format"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", 0.0), ValueError, "global_scale"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", float("nan")), ValueError, "global_scale"),
    # a wrong type is a TypeError, in quantize as in FP4Tensor (strings, booleans, arrays of one or more values)
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", "a"), TypeError, "global_scale: expected a.*str"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", "0.01"), TypeError, "global_scale: expected a real num"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", True), TypeError, "global_scale: expected a real num"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", np.array([0.01])), TypeError, "global_scale: expected"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "mxfp4", "2.0"), ValueError, "global_scale: mxfp4 has no tensor"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "mxfp4", 0.0), ValueError, "global_scale: mxfp4 has no tensor"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", 1j), TypeError, "global_scale: .*complex"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", 10**400), ValueError, r"got 1000000000.*\.\.\.$"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), 10**400, "nvfp4", (2, 16)),
     ValueError, "global_scale: expected a positive finite float32"),
    (lambda: vc.quantize(np.ones((0, 32), np.float32)), ValueError, r"at least one row, K >= 1\), got shape \(0, 32\)"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "mxfp4", 2.0), ValueError, "global_scale"),
    (lambda: vc.quantize(np.array([[1.0, np.nan]], np.float32), "nvfp4"), ValueError, "NaN or Inf"),
    (lambda: vc.quantize(np.array([[1.0, np.inf]], np.float32), "nvfp4", 1.0), ValueError, "NaN or Inf"),
    (lambda: vc.quantize([[1.0, 2.0]]), TypeError, "array"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), ["nvfp4"]), ValueError, "format"),
    (lambda: vc.dequantize(np.ones(4)), TypeError, "FP4Tensor"),
    (lambda: vc.dequantize(vc.quantize(np.ones((1, 4), np.float32)), "nonsense"), TypeError, "dtype"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), float("nan"), "nvfp4", (2, 16)),
     ValueError, "global_scale"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), True, "nvfp4", (2, 16)),
     TypeError, "global_scale"),
    (lambda: vc.dequantize(vc.quantize(np.ones((1, 4), np.float32)), np.int8), TypeError, "dtype"),
    (lambda: vc.FP4Tensor(np.zeros((2, 7), np.uint8), np.zeros((2, 1), np.uint8), 1.0, "nvfp4", (2, 15)),
     ValueError, "data: expected shape"),
    # an mxfp4 tensor with a tensor scale: fp4_matmul on the GPU applied it, dequantize and NumPy did not
    (lambda: vc.FP4Tensor(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.uint8), 2.0, "mxfp4", (2, 32)),
     ValueError, r"global_scale: mxfp4 has no tensor scale \(expected 1.0\), got 2.0"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), "2.0", "nvfp4", (2, 16)),
     TypeError, "global_scale: expected a real number, got str"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), 1j, "nvfp4", (2, 16)),
     TypeError, "global_scale: expected a real number, got complex"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), 1e39, "nvfp4", (2, 16)),
     ValueError, "global_scale: expected a positive finite float32, got 1e[+]39"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), 1.0, "nvfp4", None),
     TypeError, "shape: expected a tuple of ints, got None"),
    (lambda: vc.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), 1.0, "nvfp4", (2, 15.9)),
     TypeError, r"shape: expected a tuple of ints, got \(2, 15.9\)"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", 10**400), ValueError, "global_scale: expected a pos"),
    (lambda: vc.quantize(np.ones((2, 4), np.float32), "nvfp4", 1e300), ValueError, "global_scale: expected a pos"),
])
def test_bad_input(bad, exc, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no overflow warning before the error)
        with pytest.raises(exc, match=match):
            bad()


def test_quantize_takes_any_real_scalar_scale():
    """global_scale may be any real scalar: a float, an int, a NumPy scalar or 0-d array, a Fraction or Decimal
    (quantize took them before its check was shared with FP4Tensor): the same tensor each time."""
    import decimal
    import fractions
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    want = vc.quantize(x, "nvfp4", 0.25)
    for gs in (np.float32(0.25), np.array(0.25), np.float16(0.25), fractions.Fraction(1, 4), decimal.Decimal("0.25")):
        got = vc.quantize(x, "nvfp4", gs)
        assert got.global_scale == np.float32(0.25) and type(got.global_scale) is np.float32, gs
        np.testing.assert_array_equal(got.data, want.data)
        np.testing.assert_array_equal(got.scales, want.scales)


def test_global_scale_takes_numpy_scalars():
    """A NumPy scalar or 0-d array is the same global_scale as the Python float."""
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    want = vc.quantize(x, "nvfp4", 0.01)
    for gs in (np.float32(0.01), np.float64(0.01), np.array(0.01)):
        got = vc.quantize(x, "nvfp4", gs)
        assert got.global_scale == want.global_scale
        np.testing.assert_array_equal(got.data, want.data)
        np.testing.assert_array_equal(got.scales, want.scales)


def test_reference_matmul_of_nonfinite_inputs_warns_nothing():
    """NaN / Inf activations and an out-of-range float16 result follow docs/nan.md without NumPy warnings."""
    w = vc.quantize(np.ones((2, 70), np.float32), "mxfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = vc.fp4_matmul(np.array([[np.nan] + [1.0] * 69], np.float16), w)
        assert np.isnan(out).all()
        assert np.isinf(vc.fp4_matmul(np.full((1, 70), 60000, np.float16), w)).all()


# ---------------------------------------------------------------- GPU, bit-exact against the reference

def _assert_same(tg, tr, dtype):
    np.testing.assert_array_equal(tg.scales.get(), tr.scales)
    np.testing.assert_array_equal(tg.data.get(), tr.data)
    assert tg.global_scale == tr.global_scale and tg.shape == tr.shape
    for out in (np.float32, dtype):
        dg = vc.dequantize(tg, out)
        assert dg.dtype == np.dtype(out) and dg.shape == tr.shape
        got, want = dg.get(), vc.dequantize(tr, out)
        nan = np.isnan(want.astype(np.float32))  # NaN payloads differ between CUDA and NumPy; positions must not
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2048, 4096), (3, 4095), (1000, 17), (5, 1), (2, 3, 100)])
def test_gpu_bitexact_random(fmt, dtype, shape):
    import cupy as cp
    x = random_input(shape, dtype, seed=sum(shape))
    _assert_same(vc.quantize(cp.asarray(x), fmt), vc.quantize(x, fmt), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bitexact_edges(fmt, dtype):
    import cupy as cp
    rng = np.random.default_rng(5)
    rows = []
    # amax 7 gives the MXFP4 scale 2^0, so the ties stay ties after scaling; the other scales shift them
    for scale in (1.0, 0.5, 2.0 ** -20, 2.0 ** 10, 2.0 ** 14):
        r = np.array(TIES + [-t for t in TIES] + [6.0, -6.0, 7.0, 0.0, -0.0, 0.1] + [0.0] * 12) * scale
        rows.append(r[:32])
    rows.append(np.zeros(32))                                    # all-zero block
    rows.append(np.full(32, 1e-6))                               # tiny block
    rows.append(rng.standard_normal(32) * 6e4 if dtype == np.float16 else rng.standard_normal(32) * 1e30)  # huge
    rows.append(rng.standard_normal(32) * 1e-3)
    with np.errstate(over="ignore"):
        x = np.array(rows).astype(dtype)  # the 2^14 row overflows float16 to Inf: an MXFP4 NaN block
    if fmt == "nvfp4":  # NVFP4 refuses Inf (tested below); keep the finite rows
        x = x[np.all(np.isfinite(x.astype(np.float32)), axis=1)]
    _assert_same(vc.quantize(cp.asarray(x), fmt), vc.quantize(x, fmt), dtype)
    if fmt == "nvfp4":  # a large given global scale drives the block scales into E4M3's denormal range
        x = x[np.abs(x.astype(np.float32)).max(axis=1) < 3072 * 1e3]  # (rows it would saturate are refused)
        _assert_same(vc.quantize(cp.asarray(x), fmt, 1e3), vc.quantize(x, fmt, 1e3), dtype)


def _every_code_blocks(dtype, gs):
    """Blocks of 16 whose first element sets the block's amax to 6 * v * gs for every E4M3 value v (so every
    scale code is reached), the other 15 running through every finite 16-bit magnitude in [amax / 64, amax]
    (every E2M1 boundary of that scale), signs random."""
    bits = np.arange(1, 0x8000, dtype=np.uint16)
    vals = bits.view(np.float16 if dtype == np.float16 else BF16).astype(np.float32)
    vals = vals[np.isfinite(vals)]
    rng = np.random.default_rng(11)
    blocks = []
    for code in range(1, 127):
        a = float(np.asarray(ref.e4m3_decode(np.uint8(code)))) * 6 * gs
        a = float(np.float32(a).astype(dtype).astype(np.float32))
        if a == 0 or not np.isfinite(a):
            continue
        v = vals[(vals >= a / 64) & (vals <= a)]
        v = np.concatenate([v, np.full(-len(v) % 15, a, np.float32)]).reshape(-1, 15)
        blocks.append(np.concatenate([np.full((len(v), 1), a, np.float32), v], axis=1))
    x = np.concatenate(blocks)
    return (x * rng.choice([-1.0, 1.0], x.shape)).astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16])
@pytest.mark.parametrize("int_compare", [False, True], ids=["packed-compare", "integer-compare"])
def test_gpu_nvfp4_16bit_codes_every_value(dtype, int_compare, monkeypatch):
    """16-bit NVFP4 codes come from per-scale thresholds (fp4_codec.cu, nvfp4_thresholds): every finite
    16-bit magnitude near every E2M1 boundary of every block scale, bit for bit against the reference, for an
    exact, an awkward and a tiny global scale (fp16 subnormal inputs; bfloat16 also 2^-120 and 2^100), and blocks of
    zeros. integer-compare builds the form bfloat16 takes below sm_90."""
    import cupy as cp
    from vbw_cupy import _runtime as rt, fp4
    if int_compare:
        get = rt.get_kernel
        monkeypatch.setattr(rt, "get_kernel", lambda f, n, o=(): get(f, n, tuple(o) + ("-DVBW_NV_INT_COMPARE",)))
    scales = (1.0, 0.7313, 2.0 ** -12) + ((2.0 ** -120, 2.0 ** 100) if dtype == BF16 else ())
    for gs in scales:  # bfloat16 also: subnormal thresholds, and codes whose thresholds pass its largest finite
        x = _every_code_blocks(dtype, gs)
        x[:3] = 0  # three blocks of zeros
        got = fp4._quantize_gpu(cp.asarray(x), "nvfp4", np.float32(gs))  # no plan kept: the patched kernel
        want = vc.quantize(x, "nvfp4", gs)
        np.testing.assert_array_equal(got.scales.get(), want.scales)
        np.testing.assert_array_equal(got.data.get(), want.data)
    vc.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nan_inf(dtype):
    import cupy as cp
    x = random_input((4, 64), dtype)
    x[1, 3] = np.nan
    x[2, 40] = np.inf
    tg, tr = vc.quantize(cp.asarray(x), "mxfp4"), vc.quantize(x, "mxfp4")
    _assert_same(tg, tr, dtype)
    assert tg.scales.get()[1, 0] == 255 and tg.scales.get()[2, 1] == 255
    with pytest.raises(ValueError, match="NaN or Inf"):          # no global_scale: the amax read raises
        vc.quantize(cp.asarray(x), "nvfp4")
    vc.quantize(cp.asarray(x), "nvfp4", 1.0)                      # given: flagged on the device, no sync
    with pytest.raises(ValueError, match="quantize: x: NaN or Inf"):
        vc.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("K", [1001, 4096])  # padded rows and the flat path
def test_gpu_dequantize_writes_everything(K):
    import cupy as cp
    from vbw_cupy import fp4
    x = cp.asarray(random_input((333, K), np.float32))
    t = vc.quantize(x, "nvfp4")
    out = cp.full((333, K), cp.nan, dtype=cp.float16)  # poisoned: every element must be overwritten
    fp4._launch_dequantize(t, out)
    assert not bool(cp.isnan(out).any())
    np.testing.assert_array_equal(out.get(), vc.dequantize(t.to_cpu(), np.float16))


@pytest.mark.gpu
def test_gpu_views_are_made_dense():
    import cupy as cp
    t = vc.quantize(cp.asarray(random_input((64, 256), np.float16)), "mxfp4")
    for data, scales in ((t.data[::2], t.scales[::2]), (t.data[1:, :], t.scales[1:, :])):  # strided; offset
        v = vc.FP4Tensor(data, scales, 1.0, "mxfp4", (data.shape[0], 256))
        np.testing.assert_array_equal(vc.dequantize(v).get(), vc.dequantize(v.to_cpu()))


@pytest.mark.gpu
def test_gpu_noncontiguous_and_dlpack():
    import cupy as cp
    x = random_input((64, 256), np.float16)
    xt = cp.asarray(x.T.copy()).T  # non-contiguous view
    _assert_same(vc.quantize(xt, "nvfp4"), vc.quantize(np.ascontiguousarray(x), "nvfp4"), np.float16)

    class Wrapped:  # any object exporting DLPack is accepted
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()
    _assert_same(vc.quantize(Wrapped(cp.asarray(x)), "mxfp4"), vc.quantize(x, "mxfp4"), np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, gs", [("mxfp4", None), ("nvfp4", None), ("nvfp4", 2.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_same_signature_twice_then_views_and_bad_input(fmt, gs, dtype):
    """Repeated calls of one signature replay a cached launch plan: each must still be bit-exact, and inputs of
    the same shape and dtype that are strided, misaligned, on another device or hold NaN must still be handled."""
    import cupy as cp
    from vbw_cupy import fp4
    x = random_input((96, 4111), dtype, seed=11)          # a padded last block
    xd = cp.asarray(x)
    want = vc.quantize(x, fmt, gs)
    for _ in range(3):
        t = vc.quantize(xd, fmt, gs)
        _assert_same(t, want, dtype)
        assert t.data.flags.c_contiguous and t.data.data.ptr % 16 == 0 and type(t.global_scale) is np.float32
    if gs is not None or fmt == "mxfp4":
        assert len(fp4._q_plans) >= 1
    xv = cp.asarray(np.repeat(x, 2, axis=1))[:, ::2]       # same shape and dtype, strided
    assert xv.shape == x.shape and not xv.flags.c_contiguous
    _assert_same(vc.quantize(xv, fmt, gs), want, dtype)
    flat = cp.empty(x.size + 1, dtype=x.dtype)
    xm = flat[1:].reshape(x.shape)                          # contiguous, 2 or 4 bytes off 16-byte alignment
    xm[...] = xd
    assert xm.data.ptr % 16
    _assert_same(vc.quantize(xm, fmt, gs), want, dtype)
    bad = xd.copy()
    bad[5, 7] = np.nan
    if fmt == "nvfp4":
        with pytest.raises(ValueError, match="NaN or Inf"):
            vc.quantize(bad, fmt, gs)
            vc.check_errors()  # a given global_scale: raised by the check, not the call
    else:
        assert int(vc.quantize(bad, fmt).scales[5, 0]) == 255
    _assert_same(vc.quantize(xd, fmt, gs), want, dtype)   # and the plan is still good
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            x1 = cp.asarray(x)
        for _ in range(2):                                  # current device 0, input on 1
            t1 = vc.quantize(x1, fmt, gs)
            assert t1.data.device.id == 1
            _assert_same(t1, want, dtype)


# ---------------------------------------------------------------- property tests (hypothesis)


@settings(max_examples=2000, deadline=None)
@given(st.floats(width=32, allow_nan=False))
def test_e2m1_encode_matches_ml_dtypes_everywhere(x):
    x = np.float32(x)
    assert ref.e2m1_encode(np.array([x]))[0] == np.array([x]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0 ** 100, max_value=2.0 ** 100),
                min_size=1, max_size=70),
       st.sampled_from(["mxfp4", "nvfp4"]))
def test_quantize_round_trip_error_is_bounded_per_block(values, fmt):
    """Each element decodes to within half an E2M1 step of its block-scaled value (or saturates at 6 scale
    units), whatever the values: the invariant that makes the format usable."""
    x = np.array([values], np.float32)
    t = vc.quantize(x, fmt)
    d = vc.dequantize(t).astype(np.float64)[0]
    block = 32 if fmt == "mxfp4" else 16
    sc = (ref.e8m0_decode(t.scales) if fmt == "mxfp4" else ref.e4m3_decode(t.scales).astype(np.float64)
          * np.float64(t.global_scale))[0]
    unit = np.repeat(sc, block)[: x.shape[1]]  # the value of E2M1 code 1.0 in each block
    # E2M1 steps are 0.5, 1 and 2 units in [0, 2), [2, 4), [4, 6]: the rounding error is at most half a step,
    # beyond 6 units the value saturates (and the scale, E4M3 rounded for nvfp4, may put amax there)
    scaled = np.abs(x[0].astype(np.float64)) / unit
    step = np.where(scaled < 2, 0.5, np.where(scaled < 4, 1.0, 2.0))
    err = np.abs(d - x[0]) / unit
    ok = (err <= step / 2 * (1 + 1e-6)) | (scaled > 6)
    assert ok.all(), (x[0][~ok], d[~ok], unit[~ok])


@pytest.mark.parametrize("amax", [1.401298464324817e-45, 1.0e-42, 0.0])
def test_global_scale_never_underflows_to_zero(amax):
    """A tensor whose amax / (448 * 6) underflows (found by the property test above: one subnormal value)
    gets global_scale 1.0 like an all-zero one, and round-trips to zeros instead of raising."""
    x = np.array([[amax, -amax / 2]], np.float32)
    t = vc.quantize(x, "nvfp4")
    assert t.global_scale == np.float32(1.0)
    assert np.all(vc.dequantize(t) == 0)


@pytest.mark.gpu
def test_global_scale_underflow_gpu_matches_host():
    cp = pytest.importorskip("cupy")
    x = np.array([[1.0e-42, -5.0e-43] + [0.0] * 30], np.float32)
    t, r = vc.quantize(cp.asarray(x), "nvfp4"), vc.quantize(x, "nvfp4")
    assert t.global_scale == r.global_scale == np.float32(1.0)
    assert np.array_equal(cp.asnumpy(t.data), r.data) and np.array_equal(cp.asnumpy(t.scales), r.scales)


# ---------------------------------------------------------------- scale codes, global_scale range, float64 (issue 18)

def test_scale_decode_tables_match_ml_dtypes():
    """Every E4M3 and E8M0 code decodes as ml_dtypes does; NaN exactly at E4M3FN's 0x7F / 0xFF and E8M0's 255."""
    codes = np.arange(256, dtype=np.uint8)
    for decode, fmt, nan_codes in ((ref.e4m3_decode, ml_dtypes.float8_e4m3fn, [0x7F, 0xFF]),
                                   (ref.e8m0_decode, ml_dtypes.float8_e8m0fnu, [255])):
        got, want = decode(codes), codes.view(fmt).astype(np.float32)
        assert got.dtype == np.float32
        assert np.flatnonzero(np.isnan(got)).tolist() == nan_codes
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(got)], want.view(np.uint32)[~np.isnan(want)])
    # the SPEC's values, independent of ml_dtypes
    assert ref.e4m3_decode(np.array([0x7E, 0x01, 0x08, 0x80])).tolist() == [448.0, 2.0 ** -9, 2.0 ** -6, -0.0]
    assert ref.e8m0_decode(np.array([0, 127, 254])).tolist() == [2.0 ** -127, 1.0, 2.0 ** 127]


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nvfp4_nan_scale_code_decodes_its_block_to_nan(code):
    t = vc.quantize(random_input((2, 32), np.float32), "nvfp4")
    scales = t.scales.copy()
    scales[1, 0] = code
    d = vc.dequantize(vc.FP4Tensor(t.data, scales, t.global_scale, "nvfp4", t.shape))
    assert np.isnan(d[1, :16]).all() and np.isfinite(d[1, 16:]).all()
    np.testing.assert_array_equal(d[0], vc.dequantize(t)[0])


def test_nvfp4_global_scale_too_small_is_refused():
    x = random_input((4, 100), np.float32)
    amax = float(np.abs(x).max())
    with pytest.raises(ValueError, match=r"global_scale: expected at least max\|x\| / 3072 = .*got 1e-06.*saturate"):
        vc.quantize(x, "nvfp4", global_scale=1e-6)
    with pytest.raises(ValueError, match="global_scale"):
        vc.quantize(x, "nvfp4", global_scale=amax / 3500)
    # from the default (amax / 2688) down to amax / 3072 the largest block saturates by under E2M1's step at 6
    for g in (amax / 2688, amax / 3000):
        t = vc.quantize(x, "nvfp4", global_scale=g)
        assert ref.rel_error(vc.dequantize(t), x) < 0.2
    assert vc.quantize(np.zeros((2, 16), np.float32), "nvfp4", global_scale=1e-30).global_scale == np.float32(1e-30)


def test_nvfp4_zero_stays_zero_where_the_denominator_underflows():
    """A global_scale so small that a block's scale times it underflows to 0 in float32: zeros keep code 0 (with
    their sign), other elements saturate, and no NaN from 0 / 0 decides a code (NumPy's NaN sign is platform's)."""
    x = np.array([[0.0, -0.0] + [2.0 ** -133] * 14, [0.0] * 16], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = vc.quantize(x, "nvfp4", 2.0 ** -142)
    codes = (t.data[..., None] >> np.array([0, 4], np.uint8)) & 15
    codes = codes.reshape(2, 16)
    assert codes[0, 0] == 0 and codes[0, 1] == 8 and (codes[0, 2:] == 7).all() and (codes[1] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_nvfp4_zero_stays_zero_where_the_denominator_underflows(dtype):
    """The GPU kernels (the table of 16-bit inputs, float32's plain division) as the reference: an all-zero
    tensor (signed zeros too) with global_scale 2^-142, (bfloat16, float32) zeros beside 2^-133, and (float32)
    zeros beside 2^-149 in a block whose denominator underflows."""
    import cupy as cp
    zeros = np.zeros((2, 32))
    zeros[0, 3] = zeros[1, 30] = -0.0
    cases = [zeros]
    if dtype != np.float16:  # (float16 has no 2^-133, and with its values a global scale cannot be that small)
        mixed = np.full((4, 32), 2.0 ** -133)
        mixed[0], mixed[1, :16], mixed[2, 5] = 0.0, -0.0, 0.0
        if dtype == np.float32:  # 2^-149 beside zeros: its block's scale clamps to 2^-9, the denominator to 0
            mixed[3, 16:] = [2.0 ** -149, 0.0, -0.0, -(2.0 ** -149)] * 4
        cases.append(mixed)
    for x in cases:
        xd = x.astype(dtype)
        _assert_same(vc.quantize(cp.asarray(xd), "nvfp4", 2.0 ** -142), vc.quantize(xd, "nvfp4", 2.0 ** -142), dtype)


def test_nvfp4_large_global_scale_loses_precision_gracefully():
    """A global_scale far above amax / 2688 is allowed: block scales below E4M3's 2^-9 clamp to it and their
    elements are within 2^-9 * global_scale of their values (the documented bound), never saturated."""
    x = random_input((8, 64), np.float32)
    for g in (float(np.abs(x).max()) * 512 / 6, 1e6):  # every block's scale at or under 2^-9
        d = vc.dequantize(vc.quantize(x, "nvfp4", global_scale=g))
        assert np.all(np.abs(d - x) <= 2.0 ** -9 * g)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_dequantize_to_float64(fmt):
    t = vc.quantize(random_input((3, 50), np.float32), fmt)
    d = vc.dequantize(t, np.float64)
    assert d.dtype == np.float64
    np.testing.assert_array_equal(d, vc.dequantize(t, np.float32).astype(np.float64))
    with pytest.raises(TypeError, match="dtype: expected float16, bfloat16, float32 or float64, got int64"):
        vc.dequantize(t, np.int64)


@pytest.mark.gpu
def test_gpu_e4m3_and_e8m0_nan_codes():
    """fp4.cuh decodes every scale code as the reference does, NaN codes included."""
    import cupy as cp
    for fmt, block in (("nvfp4", 16), ("mxfp4", 32)):
        data = np.full((256, block // 2), 0x22, np.uint8)   # every element 1.0
        scales = np.arange(256, dtype=np.uint8)[:, None]
        tr = vc.FP4Tensor(data, scales, np.float32(1.0), fmt, (256, block))
        tg = vc.FP4Tensor(cp.asarray(data), cp.asarray(scales), np.float32(1.0), fmt, (256, block))
        for dtype in (np.float32, np.float64):
            got, want = vc.dequantize(tg, dtype).get(), vc.dequantize(tr, dtype)
            assert got.dtype == want.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, want)  # NaN positions compared too


@pytest.mark.gpu
def test_gpu_global_scale_too_small_is_flagged():
    """With a global_scale the GPU quantize does not sync: the saturation is flagged and check_errors raises."""
    import cupy as cp
    x = random_input((64, 256), np.float32)
    vc.check_errors()
    vc.quantize(cp.asarray(x), "nvfp4", float(np.abs(x).max()) / 2688)   # fine
    vc.check_errors()
    vc.quantize(cp.asarray(x), "nvfp4", 1e-6)
    with pytest.raises(ValueError, match="quantize: global_scale: too small for x"):
        vc.check_errors()
    vc.quantize(cp.asarray(x), "nvfp4", 1e-6)   # the fast path (a replayed plan) flags it too
    with pytest.raises(ValueError, match="global_scale"):
        vc.check_errors()
