"""FP8 rows (vbw_cupy.fp8): the reference against ml_dtypes and the rules of docs/formats.md; the GPU kernels bit
for bit against it; W4A8 fp4_matmul on the host."""
import ml_dtypes
import numpy as np
import pytest

import vbw_cupy as vc
from vbw_cupy import fp8, reference as ref
from vbw_cupy.fp8 import FP8Tensor, dequantize_fp8, quantize_fp8

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float16, BF16, np.float32]


def rows_input(shape, dtype, seed=0):
    """Normal values with per-row magnitudes over 2^-20 .. 2^20 (float16: 2^-8 .. 2^8), plus rows that test the rules: zeros, a lone
    NaN, a lone Inf, a max exactly 448 * 2^k, a max just above it, E4M3 ties, tiny values (float32 only)."""
    rng = np.random.default_rng(seed)
    span = 8 if np.dtype(dtype) == np.float16 else 20   # float16 stops at 65504
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-span, span, shape[:-1] + (1,)))
    x = x.reshape(-1, shape[-1])
    K = shape[-1]
    if x.shape[0] >= 8:
        x[0] = 0.0
        x[1, K // 2] = np.nan
        x[2, K - 1] = -np.inf
        x[3, 0] = 448.0 * 4       # the max is 448 * 2^2: scale 4, code 0x7E
        x[4, 0] = 449.0           # above 448 * 2^0: scale 2
        x[5, :] = (np.arange(K) % 8 + 8.5) * 2.0 ** -7   # 1.0625 .. 1.9375 step 1/8 + 1/16: E4M3 ties
        x[5, 0] = 448.0 * 2.0 ** -4                      # the row's scale is 2^-4, so ties land on the grid
        if np.dtype(dtype) == np.float32:
            x[6] *= 2.0 ** -110   # a scale near the 2^-126 floor
            x[7, :] = 1e-42       # subnormal float32: scale clamped to 2^-126, codes 0
    return x.reshape(shape).astype(dtype)


# ---------------------------------------------------------------- reference, CPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 7, 16, 333, 4096])
def test_reference_rules(dtype, K):
    x = rows_input((11, K), dtype, seed=K)
    codes, scales = ref.quantize_fp8(x)
    assert codes.dtype == np.uint8 and codes.shape == (11, K) and scales.dtype == np.float32 and scales.shape == (11,)
    x64 = x.astype(np.float64)
    amax = np.abs(x64).max(-1)
    for r in range(11):
        if not np.isfinite(amax[r]):     # NaN / Inf rows: scale NaN, every code NaN
            assert np.isnan(scales[r]) and (codes[r] == 0x7F).all()
            continue
        s = float(scales[r])
        m, e = np.frexp(s)
        assert m == 0.5 and -126 <= e - 1 <= 127, s            # a power of two, 2^-126 or more
        if amax[r] == 0:
            assert s == 1.0
        elif s > 2.0 ** -126:
            assert 224 * s < amax[r] <= 448 * s                 # the least power of two that fits
        want = (x64[r] / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)  # RNE (ml_dtypes)
        np.testing.assert_array_equal(codes[r], want)
    d = ref.dequantize_fp8(codes, scales)
    ok = np.isfinite(scales)
    np.testing.assert_array_equal(d[ok], (codes[ok].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
                                          * scales[ok, None]).astype(np.float32))
    big = np.abs(x64[ok]) >= 2.0 ** -6 * scales[ok, None]       # normal E4M3 range: relative error <= 2^-4
    assert (np.abs(d[ok] - x64[ok])[big] <= np.abs(x64[ok])[big] * 2.0 ** -4).all()


def test_reference_specific_values():
    x = np.array([[0.3, -1.2, 5.0, 6.5], [0, 0, 0, -0.0], [448.0, 1.0, -1.0, 0.0]], np.float32)
    codes, scales = ref.quantize_fp8(x)
    assert scales.tolist() == [2.0 ** -6, 1.0, 1.0]
    assert codes[1].tolist() == [0, 0, 0, 0x80]
    assert codes[2].tolist() == [0x7E, 0x38, 0xB8, 0]
    np.testing.assert_array_equal(ref.dequantize_fp8(codes, scales)[0], np.float32([0.3125, -1.25, 5.0, 6.5]))


def test_numpy_api():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 50)).astype(np.float16)
    t = quantize_fp8(x)
    assert isinstance(t, FP8Tensor) and t.shape == (2, 3, 50) and t.format == "fp8" and not t.is_gpu
    assert t.data.shape == (2, 3, 50) and t.scales.shape == (2, 3) and t.nbytes == 300 + 24
    codes, scales = ref.quantize_fp8(x)
    np.testing.assert_array_equal(t.data, codes)
    np.testing.assert_array_equal(t.scales, scales)
    for dt in (np.float32, np.float16, BF16, np.float64):
        got = vc.dequantize(t, dt)                      # the public dequantize takes FP8Tensors too
        assert got.dtype == np.dtype(dt) and got.shape == (2, 3, 50)
        np.testing.assert_array_equal(got, ref.dequantize_fp8(codes, scales).astype(dt))
    assert dequantize_fp8(t).dtype == np.float32


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="x: expected dtype"):
        quantize_fp8(np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="x: expected a non-empty"):
        quantize_fp8(np.zeros((2, 0), np.float32))
    with pytest.raises(TypeError, match="x"):
        quantize_fp8([[1.0, 2.0]])
    with pytest.raises(TypeError, match="data: expected uint8"):
        FP8Tensor(np.zeros((2, 4), np.int8), np.ones(2, np.float32), (2, 4))
    with pytest.raises(TypeError, match="scales: expected float32"):
        FP8Tensor(np.zeros((2, 4), np.uint8), np.ones(2, np.float64), (2, 4))
    with pytest.raises(ValueError, match="scales: expected shape"):
        FP8Tensor(np.zeros((2, 4), np.uint8), np.ones(3, np.float32), (2, 4))
    with pytest.raises(ValueError, match="shape"):
        FP8Tensor(np.zeros((2, 4), np.uint8), np.ones(2, np.float32), (2, 5))
    for shape in ((2.9, 4.7), (True, 4), 5, ("a", 4)):   # (the floats were truncated, the others not named)
        with pytest.raises(TypeError, match="shape: expected a tuple of ints"):
            FP8Tensor(np.zeros((2, 4), np.uint8), np.ones(2, np.float32), shape)
    with pytest.raises(TypeError, match="t: expected an FP8Tensor"):
        dequantize_fp8(vc.quantize(np.ones((1, 32), np.float32), "mxfp4"))
    with pytest.raises(TypeError, match="dtype"):
        dequantize_fp8(quantize_fp8(np.ones((1, 4), np.float32)), np.int32)


def test_pow2_scales():
    """quantize_fp8's tensors have power-of-two scales (NaN rows allowed); hand-built NumPy ones are checked;
    the flag survives the trip to the GPU and back (tested there)."""
    x = rows_input((11, 64), np.float32, seed=1)
    t = quantize_fp8(x)
    assert t.pow2_scales and np.isnan(t.scales).any()
    assert FP8Tensor(t.data, t.scales, t.shape).pow2_scales
    odd = t.scales.copy()
    odd[0] = 0.3
    assert not FP8Tensor(t.data, odd, t.shape).pow2_scales
    odd[0] = -0.5
    assert not FP8Tensor(t.data, odd, t.shape).pow2_scales


def test_fp4_matmul_w4a8_on_the_host_is_the_reference():
    rng = np.random.default_rng(4)
    a = quantize_fp8(rng.standard_normal((5, 70)).astype(np.float32))
    w = vc.quantize(rng.standard_normal((9, 70)).astype(np.float32), "mxfp4")
    b = rng.standard_normal(9).astype(np.float32)
    got = vc.fp4_matmul(a, w, b, "silu")
    assert got.dtype == np.float16 and got.shape == (5, 9)
    z = ref.dequantize_fp8(a.data, a.scales).astype(np.float64) @ ref.dequantize(w).astype(np.float64).T + b
    np.testing.assert_array_equal(got, (z / (1 + np.exp(-z))).astype(np.float16))
    with pytest.raises(ValueError, match="a: FP8Tensor of shape"):
        vc.fp4_matmul(quantize_fp8(np.ones((2, 64), np.float32)), w)


# ---------------------------------------------------------------- GPU, bit for bit
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 4096), (37, 4104), (21, 333), (9, 1), (2, 5, 1000), (1, 14336),
                                   (3, 40000)])
@pytest.mark.parametrize("loads", fp8._LOAD_CHOICES)
def test_gpu_matches_reference(dtype, shape, loads, monkeypatch):
    """Every kernel variant (loads in flight; rows of one and of several chunks) bit for bit."""
    import cupy as cp
    monkeypatch.setattr(fp8, "_LOADS", loads)
    x = rows_input(shape, dtype, seed=sum(shape))
    t = quantize_fp8(cp.asarray(x))
    assert t.is_gpu and t.shape == shape
    codes, scales = ref.quantize_fp8(x)
    np.testing.assert_array_equal(t.data.get(), codes)
    np.testing.assert_array_equal(t.scales.get().view(np.uint32), scales.view(np.uint32))
    for dt in (np.float32, np.float16, BF16, np.float64):
        out = vc.dequantize(t, dt)
        assert out.dtype == np.dtype(dt) and out.shape == shape
        want = ref.dequantize_fp8(codes, scales).astype(dt)
        got = out.get()
        nan = np.isnan(want.astype(np.float32))           # NaN where the reference has it (any payload)
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))  # bits, -0 included


@pytest.mark.gpu
def test_gpu_unaligned_and_strided_inputs():
    """A view off the 16-byte grid takes the scalar path; a strided view is made dense first."""
    import cupy as cp
    x = cp.asarray(rows_input((40, 1025), np.float16, seed=9))
    for v in (x[:, 1:], x[:, ::2], x[3:, 1:1001]):
        t = quantize_fp8(v)
        assert t.pow2_scales and t.to_cpu().pow2_scales and t.to_cpu().to_gpu().pow2_scales
        codes, scales = ref.quantize_fp8(v.get())
        np.testing.assert_array_equal(t.data.get(), codes)
        np.testing.assert_array_equal(t.scales.get().view(np.uint32), scales.view(np.uint32))


@pytest.mark.gpu
def test_gpu_repeated_calls_replay_the_plan(monkeypatch):
    """The second and later calls of a shape replay the first call's packed launch with the new arrays: each
    result matches the reference for its own input (an aligned and an unaligned input of one shape alternate)."""
    import cupy as cp
    monkeypatch.setattr(fp8, "_q_plans", fp8._plans.PlanCache())
    buf = cp.asarray(rows_input((6, 24, 4097), np.float16, seed=4))
    for i in range(6):
        x = cp.ascontiguousarray(buf[i, :, :4096]) if i % 2 == 0 else buf[i].ravel()[1:1 + 24 * 4096].reshape(24, 4096)
        t = quantize_fp8(x)
        codes, scales = ref.quantize_fp8(x.get())
        np.testing.assert_array_equal(t.data.get(), codes)
        np.testing.assert_array_equal(t.scales.get().view(np.uint32), scales.view(np.uint32))
    assert len(fp8._q_plans) == 2   # the aligned and the unaligned plan
