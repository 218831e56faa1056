"""fp4_matmul (vbw_cupy.gemm): argument checks on the CPU; on the GPU every kernel config, both formats, both
16-bit dtypes, float32, every activation, bias, awkward shapes and the benchmark shapes against the float64
reference with the bound of docs/accuracy.md (2x the error of the float64 result rounded once to the output dtype, + 1e-6)."""
import re

import ml_dtypes
import numpy as np
import pytest

from vbw_cupy import _device, _plans
from vbw_cupy import _runtime as rt
from vbw_cupy import gemm, reference as ref
from vbw_cupy.fp4 import FP4Tensor, quantize
from vbw_cupy.fp8 import FP8Tensor, quantize_fp8

BF16 = ml_dtypes.bfloat16


@pytest.fixture(autouse=True)
def _untuned(monkeypatch):
    """Per-arch default configs (tuning is tested in test_autotune; every config is tested below)."""
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")


def _host_w(N=24, K=40, fmt="nvfp4", seed=0):
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((N, K)).astype(np.float32), fmt)


# ------------------------------------------------------------------------------------------------- CPU
def test_numpy_path_is_the_reference():
    rng = np.random.default_rng(1)
    for fmt in ("nvfp4", "mxfp4"):
        w = _host_w(24, 40, fmt)
        a = rng.standard_normal((2, 3, 40)).astype(np.float16)
        b = rng.standard_normal(24).astype(np.float32)
        got = gemm.fp4_matmul(a, w, b, "gelu")
        want = ref.fp4_matmul(a.reshape(6, 40), w, b, "gelu").reshape(2, 3, 24)
        assert got.dtype == np.float16 and got.shape == (2, 3, 24)
        np.testing.assert_array_equal(got, want)
    got = gemm.fp4_matmul(a, w, out_dtype=np.float32)
    assert got.dtype == np.float32


@pytest.mark.parametrize("call,exc,match", [
    (lambda w, a: gemm.fp4_matmul(a[:, :39], w), ValueError, r"a: expected shape \[\.\.\., K\] with K = 40"),
    (lambda w, a: gemm.fp4_matmul(a, np.zeros((24, 40), np.float32)), TypeError, r"w: expected an FP4Tensor"),
    (lambda w, a: gemm.fp4_matmul(a, w, bias=np.zeros(23, np.float16)), ValueError, r"bias: expected shape \[24\]"),
    (lambda w, a: gemm.fp4_matmul(a, w, bias=np.zeros(24, BF16)), TypeError, r"bias: expected dtype float16"),
    (lambda w, a: gemm.fp4_matmul(a, w, bias=np.zeros(24, np.float64)), TypeError, r"bias: expected dtype"),
    (lambda w, a: gemm.fp4_matmul(a, w, activation="tanh"), ValueError, r"activation: expected one of"),
    (lambda w, a: gemm.fp4_matmul(a.astype(np.float64), w), TypeError, r"a: expected dtype float16"),
    (lambda w, a: gemm.fp4_matmul(a.astype(np.int8), w), TypeError, r"a: expected dtype"),
    (lambda w, a: gemm.fp4_matmul(a, w, out_dtype=np.int32), TypeError, r"out_dtype"),
    (lambda w, a: gemm.fp4_matmul(a, w, out_dtype=[np.float16]), TypeError, r"out_dtype: expected .*got \["),
    (lambda w, a: gemm.fp4_matmul(np.float16(1.0), w), TypeError, r"a: expected a NumPy or GPU array, got a NumPy"),
    (lambda w, a: gemm.fp4_matmul(a[:0], w), ValueError, r"empty dimension"),
    (lambda w, a: gemm.fp4_matmul([[1.0] * 40], w), TypeError, r"a: expected a NumPy or GPU array, got list"),
    (lambda w, a: gemm.fp4_matmul(a, w, bias=[0.0] * 24), TypeError, r"bias: expected an array"),
])
def test_bad_input_raises_before_any_launch(call, exc, match):
    w = _host_w()
    a = np.ones((3, 40), np.float16)
    with pytest.raises(exc, match=match):
        call(w, a)


def test_bad_w_rank():
    w = quantize(np.ones((2, 3, 40), np.float32), "nvfp4")
    with pytest.raises(ValueError, match=r"w: expected logical shape \[N, K\]"):
        gemm.fp4_matmul(np.ones((3, 40), np.float16), w)


def test_instances_cover_every_config():
    instances = gemm.kernel_instances()
    names = {n for _, n in instances}
    for f, n in instances:  # every instance names a kernel of the file it says
        assert re.search(n.split("<")[0].split("::")[1] + r"\s*\(", (rt.SOURCE_DIR / f).read_text()), (f, n)
    assert {f for f, _ in instances} == {"fp4_gemm_sm80.cu", "fp4_gemm_sm90.cu", "fp8_gemm.cu"}
    for blk in (16, 32):
        for T in ("__half", "__nv_bfloat16"):
            for cfg in gemm.TILES.values():
                assert gemm._kernel_name(T, blk, 0, cfg) in names
    for t in (t for _, t in gemm._TUNABLES):
        for c in list(t.candidates) + list(t.defaults.values()):
            assert gemm._tile_key(c) in gemm._TILE_BY_KEY, c


def test_configs_fit_the_architectures():
    hopper = {"arch": 90, "smem_optin": 232448, "max_threads": 1024}
    ampere86 = {"arch": 86, "smem_optin": 101376, "max_threads": 1024}
    for name, cfg in gemm.TILES.items():
        assert gemm._fits(cfg, hopper), name
        assert gemm._fits(cfg, ampere86) == (cfg["KIND"] not in gemm._WG), name
    for _, t in gemm._TUNABLES:
        for arch in (80, 86, 89):
            assert t.defaults[arch]["KIND"] not in gemm._WG
    assert gemm.smem_bytes(gemm.F32_TILE, 16, 4) <= ampere86["smem_optin"]


def test_chosen_config_is_the_newest_plan():
    """Plans of an earlier tuning generation stay in w's cache: chosen_config reports the newest one."""
    import types
    a = np.zeros((16, 64), np.float16)
    old, new = {"BLOCK_N": 64}, {"BLOCK_N": 128}
    key = lambda gen: (16, 64, 64, "float16", 0, None, "float16", 0, 0, True, gen)  # noqa: E731
    plans = _plans.PlanCache()   # what _matmul_gpu keeps in w._cache
    plans.put(key(0), (None, old))
    plans.put(key(1), (None, new))
    w = types.SimpleNamespace(_cache={"gemm_v1_plans": plans})
    assert gemm.chosen_config(a, w) == new
    assert gemm.chosen_config(np.zeros((8, 64), np.float16), w) is None
    assert gemm.chosen_config(a, types.SimpleNamespace(_cache={})) is None


def test_regimes():
    assert gemm._regime(1).name == "fp4_gemm_m1" and gemm._regime(2).name == "fp4_gemm_m8"
    assert gemm._regime(8).name == "fp4_gemm_m8" and gemm._regime(16).name == "fp4_gemm_m16"
    assert gemm._regime(17).name == "fp4_gemm_m64" and gemm._regime(100).name == "fp4_gemm_m128"
    assert gemm._regime(4096).name == "fp4_gemm_big"
    assert gemm.default_config(4096, 90)["KIND"] != "mma" and gemm.default_config(4096, 80)["KIND"] == "mma"


# ------------------------------------------------------------------------------------------------- GPU
def _gpu_case(M, N, K, fmt, dtype, seed=0, scale_rows=False):
    cp = rt.require_cupy()
    rs = cp.random.RandomState(seed)
    wf = rs.standard_normal((N, K), dtype=cp.float32)
    if scale_rows:  # rows spanning 2^-16 .. 2^2: float16 needs the fp32-partial mode
        wf *= cp.exp2(cp.linspace(-16, 2, N, dtype=cp.float32))[:, None]
    w = quantize(wf, fmt)
    a = rs.standard_normal((M, K), dtype=cp.float32).astype(dtype)
    return a, w


def _check(got, a, w, bias=None, act=None, out_dtype=None):
    """Relative Frobenius error vs float64 (computed on the GPU in float64) and the bound of docs/accuracy.md."""
    cp = rt.require_cupy()
    from vbw_cupy.fp4 import dequantize
    a64 = (dequantize(a) if isinstance(a, (FP4Tensor, FP8Tensor)) else a).astype(cp.float64)
    z = a64.reshape(-1, a64.shape[-1]) @ dequantize(w).astype(cp.float64).T
    if bias is not None:
        z += bias.astype(cp.float64)
    if act == "relu":
        z = cp.maximum(z, 0)
    elif act == "gelu":
        import cupyx.scipy.special as sp
        z = 0.5 * z * (1 + sp.erf(z / np.sqrt(2.0)))
    elif act == "gelu_tanh":
        z = 0.5 * z * (1 + cp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    elif act == "silu":
        z = z / (1 + cp.exp(-z))
    odt = np.dtype(out_dtype) if out_dtype is not None else got.dtype
    g = got.reshape(z.shape).astype(cp.float64)
    nz = float(cp.linalg.norm(z))
    assert bool(cp.isfinite(g).all()), "non-finite output"
    err = float(cp.linalg.norm(g - z)) / nz
    bound = 2 * float(cp.linalg.norm(z.astype(odt).astype(cp.float64) - z)) / nz + 1e-6
    return err, bound


def _run_nan_poisoned(a, w, cfg=None, act=None, bias=None, out_dtype=None):
    """fp4_matmul through the internal launcher into a NaN-filled output; every element must be written."""
    cp = rt.require_cupy()
    M, K = a.shape
    out_dtype = np.dtype(out_dtype or a.dtype)
    a2 = a
    epc = 16 // a.itemsize
    if K % epc:
        a2 = cp.zeros((M, -(-K // epc) * epc), a.dtype)
        a2[:, :K] = a
    out = cp.full((M, w.shape[0]), np.nan, dtype=out_dtype)
    gemm._matmul_gpu(a2, w, bias, act, out_dtype, cfg=cfg, out=out)
    return out


SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (3, 1000, 4095), (64, 14336, 4096), (256, 4096, 14336),
          (4096, 8192, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_shapes_default_config(M, N, K, fmt, dtype):
    a, w = _gpu_case(M, N, K, fmt, dtype, seed=M + K)
    got = gemm.fp4_matmul(a, w)
    assert got.shape == (M, N) and got.dtype == np.dtype(dtype)
    err, bound = _check(got, a, w)
    assert err <= bound, (err, bound, gemm.chosen_config(a, w))


_CFGS = [(name, split) for name in gemm.TILES for split in (0, 1, 3)]


_WGRS = [n for n, c in gemm.TILES.items() if c["KIND"] == "wgrs"]


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp_async"])
@pytest.mark.parametrize("name", _WGRS)
def test_wgrs_loads_by_tma_and_by_cp_async(name, tma, monkeypatch):
    """The register-A wgmma kernel with activations by TMA and weights by bulk copies (the sm_90 default) and
    with cp.async: K = 936 leaves an odd last atom (a two-atom k-tile half past K), N = 1000 a partial row
    group, M = 203 a partial token tile; split-K 3, bias and SiLU; NaN-poisoned output."""
    cp = pytest.importorskip("cupy")
    if _device.device_arch() != 90:
        pytest.skip("wgmma configs run on sm_90 only")
    monkeypatch.setattr(gemm, "_USE_TMA", tma)
    cfg = dict(gemm.TILES[name], SPLIT=3)
    for fmt, K, dtype in (("nvfp4", 936, np.float16), ("mxfp4", 4095, BF16)):
        a, w = _gpu_case(203, 1000, K, fmt, dtype, seed=K)
        bias = cp.asarray(np.random.default_rng(K).standard_normal(1000).astype(dtype))
        got = _run_nan_poisoned(a, w, cfg, act="silu", bias=bias)
        err, bound = _check(got, a, w, bias=bias, act="silu")
        assert err <= bound, (name, tma, fmt, err, bound)
        plan = gemm._plan(w, 203, K, np.dtype(dtype).name, -(-K // 8) * 8, gemm._BIAS_KIND[np.dtype(dtype).name],
                          "silu", np.dtype(dtype), cfg)
        assert plan[8] == (cfg["BC"] if tma else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("name,split", _CFGS, ids=[f"{n}-s{s}" for n, s in _CFGS])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_config_tails_nan_poisoned(name, split, fmt):
    cfg = dict(gemm.TILES[name], SPLIT=split)
    if cfg["KIND"] in gemm._WG and _device.device_arch() != 90:
        pytest.skip("wgmma configs run on sm_90 only")
    M = 1 if cfg["KIND"] in gemm._M1_ONLY else 203  # the DIAG kernels run M = 1 only
    for dtype in (np.float16, BF16):
        a, w = _gpu_case(M, 1000, 1000, fmt, dtype, seed=split)  # M, N, K all off the tile grid
        got = _run_nan_poisoned(a, w, cfg)
        err, bound = _check(got, a, w)
        assert err <= bound, (name, split, dtype, err, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mmvd", "mmvk"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("K", [4095, 4096 + 64, 8192])
def test_diag_decode_kernel_m1(name, fmt, K):
    """M = 1 through the DIAG kernels (scales applied per 8 blocks in fp32): odd K, K not a whole 8-block group,
    a row tail, every split (mmvk: k-parts of a CTA, up to one 4-atom unit a warp); and M = 2 is refused before
    launch."""
    for dtype in (np.float16, BF16):
        a, w = _gpu_case(1, 1000, K, fmt, dtype, seed=K)
        for split in ((0, 1, 5) if name == "mmvd" else (0, 1, 3, 16)):
            got = _run_nan_poisoned(a, w, dict(gemm.TILES[name], SPLIT=split), act="silu")
            err, bound = _check(got, a, w, act="silu")
            assert err <= bound, (dtype, split, err, bound)
    a2 = rt.require_cupy().ones((2, K), np.float16)
    with pytest.raises(ValueError, match="M = 1 only"):
        gemm.fp4_matmul(a2, w, _config=dict(gemm.TILES[name], SPLIT=0))


def test_mmvk_shape():
    """The k-split of the in-CTA decode kernel: whole 4-atom units a warp, every atom covered, at most 16 warps
    a CTA; by default 4, 8 or 16 k-parts by how the CTAs fill whole waves (fewer when K has fewer units)."""
    cfg = gemm.TILES["mmvk"]
    for n_rg, katoms in ((256, 64), (768, 64), (1376, 64), (256, 172), (2000, 64), (63, 16), (1, 4), (5000, 512)):
        for split in (0, 1, 3, 16, 64):
            S, apw, R = gemm._mmvk_shape(dict(cfg, SPLIT=split), n_rg, katoms, 132)
            assert apw % 4 == 0 and apw * S >= katoms > apw * (S - 1), (n_rg, katoms, split, S, apw)
            assert 1 <= R * S <= 16 and R <= n_rg, (n_rg, katoms, split, S, R)
            want = min(split or gemm._mmvk_split(n_rg, 132), 16, katoms // 4)
            assert S == -(-katoms // (4 * -(-katoms // 4 // want))), (n_rg, katoms, split, S)
    # the measured shapes on 132 SMs (the 7B decode GEMVs and the four)
    for N, want in ((4096, 16), (8192, 8), (12288, 4), (14336, 4), (22016, 8), (28672, 4), (32000, 4)):
        assert gemm._mmvk_split(N // 16, 132) == want, (N, want)
    assert gemm._mmvk_shape(dict(cfg, SPLIT=0), 256, 64, 132) == (16, 4, 1)   # 4096 x 4096
    assert gemm._mmvk_shape(dict(cfg, SPLIT=0), 256, 172, 132) == (15, 12, 1)  # 4096 x 11008
    assert gemm._mmvk_shape(dict(cfg, SPLIT=0), 768, 64, 132) == (4, 16, 2)   # 12288 x 4096
    assert gemm._mmvk_shape(dict(cfg, SPLIT=8), 63, 16, 132) == (4, 4, 2)     # K = 1024: 4 units, 2 row groups



@pytest.mark.gpu
@pytest.mark.parametrize("name,M", [("mmvd", 1), ("mmv8", 5), ("mmv16", 16)])
def test_decode_split2_cluster_reduction_matches_global(name, M, monkeypatch):
    """Split-K 2 of the decode kernels reduces in a thread-block cluster on sm_90: bit for bit the global
    workspace's result (same fixed order), NaN-poisoned output, K = 100 (2 real atoms of a row padded to 4)
    and K = 4095 (odd), N = 1000 (a partial row group)."""
    if _device.device_arch() != 90:
        pytest.skip("clusters are used on sm_90 only")
    for fmt, K, dtype in (("nvfp4", 4095, np.float16), ("mxfp4", 4095, BF16), ("nvfp4", 100, BF16)):
        a, w = _gpu_case(M, 1000, K, fmt, dtype, seed=K + M)
        cfg = dict(gemm.TILES[name], SPLIT=2)
        got = {}
        for use in (True, False):
            monkeypatch.setattr(gemm, "_USE_CLUSTERS", use)
            got[use] = _run_nan_poisoned(a, w, cfg, act="gelu")
            plan = gemm._plan(w, M, K, np.dtype(dtype).name, -(-K // 8) * 8, 0, "gelu", np.dtype(dtype), cfg)
            splits = plan[1][2]
            assert splits == (1 if K <= 256 else 2), splits  # K = 100 is one k-tile: nothing to split
            assert (plan[5] is None) == (splits == 1 or use), (use, splits)  # no workspace when clustered
        err, bound = _check(got[True], a, w, act="gelu")
        assert err <= bound, (name, fmt, K, err, bound)
        assert bool((got[True] == got[False]).all()), (name, fmt, K)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bias_dtype", ["same", "float32"])
def test_activations_bias(act, bias_dtype):
    cp = rt.require_cupy()
    for dtype, fmt in ((np.float16, "nvfp4"), (BF16, "mxfp4")):
        a, w = _gpu_case(3, 1000, 4095, fmt, dtype, seed=5)
        bias = cp.random.standard_normal(1000, dtype=cp.float32).astype(dtype if bias_dtype == "same" else np.float32)
        got = gemm.fp4_matmul(a, w, bias, act)
        err, bound = _check(got, a, w, bias, act)
        assert err <= bound, (act, dtype, err, bound)
        a, w = _gpu_case(300, 520, 768, fmt, dtype, seed=6)
        got = gemm.fp4_matmul(a, w, bias[:520], act, out_dtype=np.float32)
        err, bound = _check(got, a, w, bias[:520], act, np.float32)
        assert err <= bound, (act, dtype, err, bound)  # float32 output: the tight end of docs/accuracy.md


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(3, 1000, 4095), (64, 512, 8192), (20, 130, 100)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_float32_activations(M, N, K, fmt):
    a, w = _gpu_case(M, N, K, fmt, np.float32, seed=K)
    got = _run_nan_poisoned(a, w)
    err, bound = _check(got, a, w)
    assert err <= bound, (err, bound)


@pytest.mark.gpu
def test_fp32_partial_mode_for_wide_scale_ranges():
    for fmt in ("nvfp4", "mxfp4"):
        a, w = _gpu_case(40, 1024, 2048, fmt, np.float16, scale_rows=True)
        c, f16ok, bf16ok = gemm._scale_info(w)
        assert not f16ok and bf16ok
        for dtype in (np.float16, BF16):
            a2 = a.astype(dtype)
            for cfg in (None, dict(gemm.TILES["mma_s"], SPLIT=2)):
                got = _run_nan_poisoned(a2, w, cfg)
                err, bound = _check(got, a2, w)
                assert err <= bound, (fmt, dtype, cfg, err, bound)


def _scale_info_host(data, scales, fmt, blk):
    """gemm._scale_info's answer from NumPy: (c, fp16_ok, bf16_ok)."""
    sc = scales.reshape(-1)
    live = ((data.reshape(sc.size, blk // 2) & 0x77) != 0).any(axis=1)
    if fmt == "mxfp4":
        if (sc == 255).any():
            return 0, False, False
        e = sc.astype(np.int64) - 127
    else:
        if (sc >= 0x7F).any():
            return 0, False, False
        s = sc.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        live &= s > 0
        e = np.floor(np.log2(np.where(s > 0, s, 1))).astype(np.int64)
    if not live.any():
        return 0, True, True
    c = int(e[live].max()) - 1
    emin = int(e[live].min())
    return c, emin - c >= -13, emin - c >= -29


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_scale_info_kernel_matches_host(fmt):
    """fp4_scale_range over hand-built weights: every legal scale code (E4M3 subnormals included), dead blocks
    (all-zero codes, or only the sign bits), dead blocks with extreme scales, NaN / negative codes."""
    cp = rt.require_cupy()
    blk = 16 if fmt == "nvfp4" else 32
    rng = np.random.default_rng(11)
    N, K = 77, 40 * blk
    for case in range(6):
        data = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
        hi = 0x7F if fmt == "nvfp4" else 255
        scales = rng.integers(0, hi, (N, K // blk), dtype=np.uint8)
        if case == 1:  # a narrow range
            scales = rng.integers(100, 104, (N, K // blk), dtype=np.uint8)
        if case >= 2:  # dead blocks, some holding the extreme codes that must not count
            dead = rng.random((N, K // blk)) < 0.5
            d3 = data.reshape(N, K // blk, blk // 2)
            d3[dead] = np.where(rng.random(d3[dead].shape) < 0.5, 0x88, 0).astype(np.uint8)
            scales[dead & (rng.random(dead.shape) < 0.5)] = 1
            scales[dead & (rng.random(dead.shape) < 0.3)] = hi - 1
        if case == 3:
            data[:] = 0x80
        if case == 4:
            scales[rng.integers(N), rng.integers(K // blk)] = 0xFF if fmt == "mxfp4" else rng.choice([0x7F, 0x93, 0xFF])
        if case == 5 and fmt == "nvfp4":
            scales = rng.integers(0, 8, (N, K // blk), dtype=np.uint8)  # zero and subnormal scales only
        w = FP4Tensor(cp.asarray(data), cp.asarray(scales), 1.0, fmt, (N, K))
        assert gemm._scale_info(w) == _scale_info_host(data, scales, fmt, blk), (fmt, case)


@pytest.mark.gpu
def test_mxfp4_nan_block_propagates():
    cp = rt.require_cupy()
    x = cp.random.standard_normal((64, 256), dtype=cp.float32)
    x[5, 40] = np.nan
    w = quantize(x, "mxfp4")
    a = cp.random.standard_normal((4, 256), dtype=cp.float32).astype(cp.float16)
    got = gemm.fp4_matmul(a, w).get()
    assert np.isnan(got[:, 5]).all()
    assert np.isfinite(np.delete(got, 5, axis=1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nvfp4_nan_scale_code_propagates(code):
    """E4M3FN's NaN scale codes (never made by quantize, possible in a hand-built FP4Tensor) make that row of w
    NaN, as in the reference: the fp32-partial mode is chosen and decodes them to NaN."""
    cp = rt.require_cupy()
    w = quantize(cp.random.standard_normal((64, 256), dtype=cp.float32), "nvfp4")
    scales = w.scales.copy()
    scales[5, 3] = code
    w = FP4Tensor(w.data, scales, w.global_scale, "nvfp4", w.shape)
    assert gemm._scale_info(w)[1:] == (False, False)
    a = cp.random.standard_normal((4, 256), dtype=cp.float32).astype(cp.float16)
    got = gemm.fp4_matmul(a, w).get()
    assert np.isnan(got[:, 5]).all()
    assert np.isfinite(np.delete(got, 5, axis=1)).all()


@pytest.mark.gpu
def test_w4a4_and_batched_input():
    cp = rt.require_cupy()
    a, w = _gpu_case(24, 256, 320, "nvfp4", np.float32)
    qa = quantize(a, "nvfp4")
    got = gemm.fp4_matmul(qa, w)
    assert got.dtype == np.float16
    err, bound = _check(got, qa, w)
    assert err <= bound
    a3 = cp.random.standard_normal((2, 5, 320), dtype=cp.float32).astype(cp.float16)
    got = gemm.fp4_matmul(a3, w)
    assert got.shape == (2, 5, 256)
    err, bound = _check(got.reshape(10, 256), a3.reshape(10, 320), w)
    assert err <= bound


@pytest.mark.gpu
def test_split_k_is_deterministic_and_non_contiguous_input():
    cp = rt.require_cupy()
    a, w = _gpu_case(1, 4096, 8192, "nvfp4", np.float16)
    r1 = gemm.fp4_matmul(a, w, _config=dict(gemm.TILES["mma_s"], SPLIT=8))
    r2 = gemm.fp4_matmul(a, w, _config=dict(gemm.TILES["mma_s"], SPLIT=8))
    assert bool((r1 == r2).all())
    big = cp.random.standard_normal((8, 2 * 8192), dtype=cp.float32).astype(cp.float16)
    view = big[:, ::2]
    got = gemm.fp4_matmul(view, w)
    err, bound = _check(got, cp.ascontiguousarray(view), w)
    assert err <= bound


@pytest.mark.gpu
def test_bad_gpu_input_raises_before_launch():
    cp = rt.require_cupy()
    a, w = _gpu_case(4, 64, 96, "nvfp4", np.float16)
    with pytest.raises(ValueError, match="a and w"):
        gemm.fp4_matmul(a.get(), w)
    with pytest.raises(ValueError, match="bias"):
        gemm.fp4_matmul(a, w, bias=np.zeros(64, np.float16))
    with pytest.raises(ValueError, match="K = 96"):
        gemm.fp4_matmul(cp.zeros((4, 95), cp.float16), w)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("act", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_reference_matches_an_independent_computation(fmt, act):
    """reference.fp4_matmul against ml_dtypes' own E2M1/E8M0/E4M3 decode, a float64 matmul and textbook
    activations (scipy-free), so the ground truth the GPU is held to is itself checked."""
    import math
    rng = np.random.default_rng(11)
    M, N, K = 5, 24, 100
    w = quantize(rng.standard_normal((N, K)).astype(np.float32), fmt)
    block = 32 if fmt == "mxfp4" else 16
    codes = np.stack([w.data & 15, w.data >> 4], axis=-1).reshape(N, -1)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    if fmt == "mxfp4":
        sc = w.scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    else:
        sc = w.scales.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    wd = (vals * np.repeat(sc, block, axis=1)).astype(np.float32) * np.float32(w.global_scale)
    wd = wd.astype(np.float32)[:, :K].astype(np.float64)
    a = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    z = a.astype(np.float64) @ wd.T + bias
    f = {None: lambda t: t, "relu": lambda t: max(t, 0.0), "silu": lambda t: t / (1 + math.exp(-t)),
         "gelu": lambda t: 0.5 * t * (1 + math.erf(t / math.sqrt(2))),
         "gelu_tanh": lambda t: 0.5 * t * (1 + math.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))}[act]
    want = np.vectorize(f)(z).astype(np.float32)
    got = ref.fp4_matmul(a, w, bias, act, out_dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------ W4A4 MXFP4 on FP8 tensor cores
def _hopper():
    return _device.device_arch() == 90 and rt.have_tensor_maps()


@pytest.mark.gpu
def test_fp8_operand_conversion_is_exact():
    """The FP8 path's operands (cuda_src/fp8_gemm.cu): e4m3 bytes times their scales equal the dequantized MXFP4
    values bit for bit. Weights: one scale per row, rows past 13 binades flagged. Activations: one scale per
    128-k chunk where the chunk fits, else the blocks' own scales, and the row flagged."""
    cp = rt.require_cupy()
    rs = np.random.default_rng(5)
    x = rs.standard_normal((70, 1000)).astype(np.float32)
    x *= np.exp2(rs.integers(-6, 7, size=(70, 1))).astype(np.float32)      # row magnitudes
    x[:, :500] *= np.float32(2.0 ** -5)                                     # blocks 5 binades apart in a row
    x[3, 32:64] *= np.float32(2.0 ** -20)                                   # row 3: ~20 binades in one chunk
    x[9, 700:732] *= np.float32(2.0 ** 16)                                  # row 9: likewise
    x[4] = 0.0                                                              # an all-zero row
    w = quantize(cp.asarray(x), "mxfp4")
    want = ref.dequantize(w.to_cpu(), np.float64)

    def values(q):
        return cp.asnumpy(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64)[:, :1000]

    q, row_scale, bad = gemm._fp8_rows(w, 70)
    assert cp.asnumpy(bad).tolist() == [1 if r in (3, 9) else 0 for r in range(70)]
    ok = np.setdiff1d(np.arange(70), [3, 9])
    np.testing.assert_array_equal((values(q) * cp.asnumpy(row_scale)[:, None])[ok], want[ok])
    assert float(row_scale[4]) == 1.0
    q, mult, row_bad = gemm._fp8_activations(w, 70)
    assert cp.asnumpy(row_bad).tolist() == bad.get().tolist()
    np.testing.assert_array_equal(values(q) * np.repeat(cp.asnumpy(mult), 32, axis=1)[:, :1000], want)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [4160, 14336 + 96])
def test_fp8_activation_conversion_of_long_rows(K):
    """Rows of more blocks than the conversion's CTA has threads (several rounds, the last one partial, its
    last chunk short): e4m3 bytes times the multipliers equal the dequantized values bit for bit; only the
    rows with a chunk past 13 binades, in any round, are flagged."""
    cp = rt.require_cupy()
    rs = np.random.default_rng(K)
    nb = K // 32
    x = rs.standard_normal((7, K)).astype(np.float32)
    x *= np.exp2(rs.integers(-4, 5, size=(7, nb))).repeat(32, axis=1).astype(np.float32)  # block scales vary
    x[2, (nb - 1) * 32:] *= np.float32(2.0 ** -30)      # row 2: the last (short) chunk spans > 13 binades
    x[5, 129 * 32:130 * 32] *= np.float32(2.0 ** 30)    # row 5: a chunk of the second round
    x[6, 200 * 32:] = 0.0                               # row 6: zero chunks at the end
    w = quantize(cp.asarray(x), "mxfp4")
    want = ref.dequantize(w.to_cpu(), np.float64)
    q, mult, row_bad = gemm._fp8_activations(w, 7)
    got = cp.asnumpy(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.repeat(cp.asnumpy(mult), 32, axis=1)
    np.testing.assert_array_equal(got[:, :K], want)
    assert cp.asnumpy(row_bad).tolist() == [0, 0, 1, 0, 0, 1, 0]


def _w4a4_operands(M, N, K, seed, with_bias):
    """MXFP4 a [M, K] and w [N, K] from random normals, and a float32 bias [N] or None. Tokens 128..255 have
    blocks whose scales span 2^-24..2^4 within a 128-k chunk (their tile, or k-tile, takes the per-32 path)."""
    cp = rt.require_cupy()
    rs = cp.random.RandomState(seed)
    a = rs.standard_normal((M, K), dtype=cp.float32)
    a[128:256] *= cp.exp2(cp.asarray(np.random.default_rng(K).integers(-24, 5, size=(1, -(-K // 32))))
                          .astype(cp.float32)).repeat(32, axis=1)[:, :K]
    qa = quantize(a, "mxfp4")
    w = quantize(rs.standard_normal((N, K), dtype=cp.float32), "mxfp4")
    return qa, w, (rs.standard_normal(N, dtype=cp.float32) if with_bias else None)


def _check_fp8_path(internal, qa, w, bias, act, out_dtype, public_same):
    """The FP8-tensor-core launcher `internal` (gemm._w4a4_fp8 / _w4a8_fp8) into a NaN-filled output: on Hopper it
    writes every element within the bound (and, with public_same, fp4_matmul returns the same bits); elsewhere it
    declines (None) and the public call's float32 path is checked instead."""
    cp = rt.require_cupy()
    M, N = qa.shape[0], w.shape[0]
    out = cp.full((M, N), np.nan, dtype=out_dtype)
    got = internal(qa, w, bias, act, np.dtype(out_dtype), M, N, out=out)
    if not _hopper():
        assert got is None
        got = gemm.fp4_matmul(qa, w, bias, act, out_dtype)
    else:
        assert got is out
        if public_same:
            np.testing.assert_array_equal(gemm.fp4_matmul(qa, w, bias, act, out_dtype).get().view(np.uint16),
                                          got.get().view(np.uint16))
    err, bound = _check(got, qa, w, bias=bias, act=act)
    assert err <= bound, (err, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(300, 520, 800), (1, 256, 4096), (1000, 1100, 4160), (4096, 2048, 2048),
                                   (256, 384, 14336), (200, 200, 800)])
@pytest.mark.parametrize("out_dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("bn", gemm._FP8_TILES)
@pytest.mark.parametrize("cm", (1, 2))
@pytest.mark.parametrize("act,with_bias", [("silu", True), (None, False), ("relu", True)])
def test_w4a4_mxfp4_on_fp8_tensor_cores(M, N, K, out_dtype, bn, cm, act, with_bias, monkeypatch):
    """MXFP4 x MXFP4 (FP8 tensor cores on Hopper) within the bound, every output written (NaN-filled first),
    with bias and SiLU (the epilogue's staged fp32 path), plain and with bias and relu (its register path),
    with and without clusters of two token tiles (M = 300: the last pair's second tile is past M). Tokens
    128..255 have blocks whose scales span 2^-24..2^4 within a 128-k chunk: their tile takes the per-32 path,
    the others one scale per chunk."""
    monkeypatch.setattr(gemm, "_FP8_BN", bn)
    monkeypatch.setattr(gemm, "_FP8_CM", cm)
    qa, w, bias = _w4a4_operands(M, N, K, M + N + K, with_bias)
    _check_fp8_path(gemm._w4a4_fp8, qa, w, bias, act, out_dtype, public_same=True)
    assert not _hopper() or w._cache["fp8_v1"] is not False


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(300, 520, 800), (1, 256, 4096), (1000, 1100, 4160), (4096, 2048, 2048),
                                   (256, 384, 14336), (200, 200, 1000), (130, 96, 72)])
@pytest.mark.parametrize("out_dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("cm", (1, 2))
@pytest.mark.parametrize("act,with_bias", [("silu", True), (None, False), ("gelu", False)])
def test_w4a8_fp8_activations_on_fp8_tensor_cores(M, N, K, out_dtype, cm, act, with_bias, monkeypatch):
    """FP8 activations (an FP8Tensor: E4M3, a power-of-two scale per row, row magnitudes over 2^-8..2^4, float16
    outputs stay finite) x MXFP4 weights: the codes go to the FP8 tensor cores as given (Hopper), within the bound, every output
    written (NaN-filled first); K = 1000 and 72 are not multiples of 16 (a padded copy for TMA); the public call
    takes the same path; elsewhere the float32 path on the dequantized activations."""
    cp = rt.require_cupy()
    monkeypatch.setattr(gemm, "_FP8_CM", cm)
    rs = cp.random.RandomState(M + N + K)
    a = rs.standard_normal((M, K), dtype=cp.float32) * cp.exp2(rs.uniform(-8, 4, (M, 1))).astype(cp.float32)
    qa = quantize_fp8(cp.asarray(a.get().astype(BF16)) if K % 16 else a)   # bfloat16 and float32 inputs
    w = quantize(rs.standard_normal((N, K), dtype=cp.float32), "mxfp4")
    bias = rs.standard_normal(N, dtype=cp.float32) if with_bias else None
    # fewer tokens than _QUANTIZED_GEMV_M: the public call takes the GEMV (test below)
    _check_fp8_path(gemm._w4a8_fp8, qa, w, bias, act, out_dtype, public_same=M > gemm._QUANTIZED_GEMV_M)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 17])
@pytest.mark.parametrize("wfmt", ["nvfp4", "mxfp4"])
def test_w4a8_few_tokens_take_the_gemv(M, wfmt):
    """FP8 activations of <= 16 tokens go to the W4A16 decode GEMV as bfloat16 (the FP8 kernel would read 8-bit
    weights), more tokens to the FP8 kernel (MXFP4 weights on Hopper): within the bound either way, with bias
    and SiLU, every output written."""
    cp = rt.require_cupy()
    rs = cp.random.RandomState(M)
    a = rs.standard_normal((M, 4096), dtype=cp.float32) * cp.exp2(rs.uniform(-8, 4, (M, 1))).astype(cp.float32)
    qa = quantize_fp8(a)
    w = quantize(rs.standard_normal((1000, 4096), dtype=cp.float32), wfmt)
    bias = rs.standard_normal(1000, dtype=cp.float32)
    got = gemm.fp4_matmul(qa, w, bias, "silu")
    assert got.shape == (M, 1000) and got.dtype == np.float16
    took_gemv = gemm.chosen_config(np.empty((M, 4096), BF16), w) is not None   # a bfloat16 W4A16 plan ran
    assert took_gemv == (M <= gemm._QUANTIZED_GEMV_M)
    if M > gemm._QUANTIZED_GEMV_M and wfmt == "mxfp4" and _hopper():
        assert w._cache.get("fp8_v1")                                          # the FP8 kernel's weights
    err, bound = _check(got, qa, w, bias=bias, act="silu")
    assert err <= bound, (err, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("wfmt", ["nvfp4", "mxfp4"])
def test_w4a8_other_paths(wfmt):
    """FP8 activations where the FP8 tensor-core path does not apply (NVFP4 weights; a float32 output) take the
    float32 path on the exactly dequantized activations: within the bound, every output written."""
    cp = rt.require_cupy()
    rs = cp.random.RandomState(7)
    qa = quantize_fp8(rs.standard_normal((3, 7, 300), dtype=cp.float32))   # 21 tokens: past the GEMV's 16
    w = quantize(rs.standard_normal((200, 300), dtype=cp.float32), wfmt)
    for odt in ((np.float16, np.float32) if wfmt == "nvfp4" else (np.float32,)):
        got = gemm.fp4_matmul(qa, w, out_dtype=odt)
        assert got.shape == (3, 7, 200) and got.dtype == np.dtype(odt)
        assert gemm.chosen_config(np.empty((21, 300), np.float32), w) is not None   # the float32 path's plan
        err, bound = _check(got, qa, w)
        assert err <= bound, (odt, err, bound)


@pytest.mark.gpu
def test_w4a8_arbitrary_scales_stay_in_float32():
    """An FP8Tensor built with scales that are not powers of two (absmax / 448, as other stacks make them):
    never rounded through bfloat16; within the bound at 8 tokens (float32 path) and 40 (FP8 kernel), and
    pow2_scales tells the two kinds apart."""
    cp = rt.require_cupy()
    rs = cp.random.RandomState(3)
    w = quantize(rs.standard_normal((1000, 4096), dtype=cp.float32), "mxfp4")
    for M in (8, 40):
        x = rs.standard_normal((M, 4096), dtype=cp.float32)
        s = (cp.abs(x).max(axis=1) / 448).astype(cp.float32)
        codes = cp.asarray((x / s[:, None]).get().astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        qa = FP8Tensor(codes, s, (M, 4096))
        assert not qa.pow2_scales and quantize_fp8(x).pow2_scales
        got = gemm.fp4_matmul(qa, w)
        err, bound = _check(got, qa, w)
        assert err <= bound, (M, err, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(300, 520, 800), (1, 256, 4096), (1000, 1100, 4160), (256, 384, 14336)])
@pytest.mark.parametrize("cm", (1, 2))
@pytest.mark.parametrize("bn", gemm._FP8_TILES)
@pytest.mark.parametrize("act", ["silu", None])
def test_w4a4_fp8_stream_k_tail(M, N, K, cm, bn, act, monkeypatch):
    """The persistent grid's tail split along K (forced here: half the units, the later ones, in two or three
    parts, whatever the SM count; parts that start at odd k-tiles for BN = 128's pairs; tokens 128..255 on
    the per-32 path): within the bound, every output written, and a second call (counters reset by the
    kernel) gives the same bits."""
    cp = rt.require_cupy()
    if not _hopper():
        pytest.skip("the FP8 tensor-core path runs on sm_90 only (other GPUs: the float32 path, tested above)")
    monkeypatch.setattr(gemm, "_FP8_CM", cm)
    monkeypatch.setattr(gemm, "_FP8_BN", bn)
    parts = 3 if K >= 4096 else 2
    monkeypatch.setattr(gemm, "_fp8_schedule", lambda units, clusters, nkt: (units // 2, parts))
    qa, w, bias = _w4a4_operands(M, N, K, M * 7 + K, act is not None)
    outs = []
    for _ in range(2):
        out = cp.full((M, N), np.nan, dtype=np.float16)
        assert gemm._w4a4_fp8(qa, w, bias, act, np.dtype(np.float16), M, N, out=out) is out
        outs.append(out)
    np.testing.assert_array_equal(outs[0].get().view(np.uint16), outs[1].get().view(np.uint16))
    err, bound = _check(outs[0], qa, w, bias=bias, act=act)
    assert err <= bound, (err, bound)


def test_fp8_schedule_splits_only_a_thin_last_round():
    """_fp8_schedule (no GPU): the last round is split when it is at most half full, into parts of at least 8
    k-tiles and at most 4, never more items than clusters in that round."""
    assert gemm._fp8_schedule(352, 66, 112) == (330, 3)    # 4096 x 4096 x 14336: 22 units left, 3 parts each
    assert gemm._fp8_schedule(688, 66, 64) == (660, 2)
    assert gemm._fp8_schedule(1200, 66, 32) == (1188, 4)   # at most 4 parts
    assert gemm._fp8_schedule(70, 66, 200) == (66, 4)
    assert gemm._fp8_schedule(100, 66, 200) == (100, 1)    # 34 left: more than half a round
    assert gemm._fp8_schedule(132, 66, 200) == (132, 1)    # whole rounds
    assert gemm._fp8_schedule(40, 66, 200) == (40, 1)      # one partial round: every unit already has a cluster
    assert gemm._fp8_schedule(70, 66, 15) == (70, 1)       # parts would be under 8 k-tiles
    for units, clusters, nkt in [(352, 66, 112), (70, 66, 200), (1200, 66, 32)]:
        full, split = gemm._fp8_schedule(units, clusters, nkt)
        assert (units - full) * split <= clusters and nkt // split >= 8


@pytest.mark.gpu
def test_w4a4_fp8_falls_back_for_wide_weight_rows_and_float32_output():
    cp = rt.require_cupy()
    rs = cp.random.RandomState(9)
    wf = rs.standard_normal((256, 512), dtype=cp.float32)
    wf[7, 64:96] *= 2.0 ** -20   # row 7's blocks span ~20 binades: not exact in e4m3 with one row scale
    w = quantize(wf, "mxfp4")
    qa = quantize(rs.standard_normal((64, 512), dtype=cp.float32), "mxfp4")
    got = gemm.fp4_matmul(qa, w)
    if _hopper():
        assert w._cache["fp8_v1"] is False
    err, bound = _check(got, qa, w)
    assert err <= bound
    tiny = quantize(rs.standard_normal((256, 512), dtype=cp.float32) * 2.0 ** -100, "mxfp4")  # row scales < 2^-64
    got = gemm.fp4_matmul(qa, tiny, out_dtype=ml_dtypes.bfloat16)
    if _hopper():
        assert tiny._cache["fp8_v1"] is False
    err, bound = _check(got, qa, tiny)
    assert err <= bound
    w2 = quantize(rs.standard_normal((256, 512), dtype=cp.float32), "mxfp4")
    got = gemm.fp4_matmul(qa, w2, out_dtype=np.float32)   # float32 output: the exact path
    assert "fp8_v1" not in w2._cache
    err, bound = _check(got, qa, w2, out_dtype=np.float32)
    assert err <= bound


def test_invalidate_forgets_derived_layouts():
    w = quantize(np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32), "mxfp4")
    w._cache["gemm_v1_plans"] = object()
    w.invalidate()
    assert w._cache == {}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M", [1, 300])
def test_gpu_weights_changed_in_place_then_invalidated(fmt, M):
    """w.data / w.scales overwritten in place, then w.invalidate(): the next call multiplies by the new values
    (the re-laid-out copy and the plans are rebuilt), equal to a fresh tensor holding them."""
    import cupy as cp
    rng = np.random.default_rng(11)
    N, K = 96, 512
    a = cp.asarray(rng.standard_normal((M, K)).astype(np.float16))
    w = quantize(cp.asarray(rng.standard_normal((N, K)).astype(np.float32)), fmt)
    w2 = quantize(cp.asarray(0.5 * rng.standard_normal((N, K)).astype(np.float32)), fmt,
                  global_scale=w.global_scale if fmt == "nvfp4" else None)
    gemm.fp4_matmul(a, w)                      # builds w's layout and plans
    w.data[...] = w2.data
    w.scales[...] = w2.scales
    w.invalidate()
    got = cp.asnumpy(gemm.fp4_matmul(a, w)).astype(np.float32)
    want = cp.asnumpy(gemm.fp4_matmul(a, FP4Tensor(w2.data.copy(), w2.scales.copy(), w2.global_scale, fmt,
                                                   (N, K)))).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_m1_default_is_the_in_cta_split_kernel():
    """M = 1 defaults to mmvk (measured against mmvd on nine shapes on the H100) on every architecture."""
    from vbw_cupy import autotune
    for arch in (80, 86, 90):
        for N in (4096, 8192, 14336, 32000):
            cfg = autotune.default_config("fp4_gemm_m1", arch, {"M": 1, "N": N, "K": 4096, "format": "nvfp4"})
            assert cfg["KIND"] == "mmvk" and cfg["STAGES"] == 1, (arch, N, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_swiglu_gemv_equals_gemm_then_silu_mul(fmt):
    """The decode GEMV's fused gate / up epilogue (gemm.swiglu_gemv, the model's decode step) equals, bit for
    bit, fp4_matmul followed by the model's silu_mul kernel on the same interleaved weight, into pool memory
    that held NaN; calls it cannot take give None."""
    cp = rt.require_cupy()
    from vbw_cupy.models import gpu as mg
    rng = np.random.default_rng(7)
    for dtype, H, K in ((np.float16, 1000, 4104), (BF16, 688, 1000), (np.float16, 11008 // 2, 4096)):
        w1, w3 = (cp.asarray(rng.standard_normal((H, K), dtype=np.float32)) for _ in range(2))
        w = quantize(mg._interleave8(w1, w3), fmt)
        a = cp.asarray(rng.standard_normal((1, K)).astype(dtype))
        poison = cp.full((1, H), np.nan, dtype=dtype)
        del poison
        fused = gemm.swiglu_gemv(a, w)
        gu = gemm.fp4_matmul(a, w, _config=dict(gemm.TILES["mmvk"], SPLIT=0))   # the fused path's config
        want = cp.empty((1, H), dtype=dtype)
        rt.launch(rt.get_kernel("model.cu", f"vbw_model::silu_mul<{rt.ctype(dtype)}>"), (-(-H // 256),), (256,),
                  (gu, want, np.int32(H), np.int64(H), np.int32(1)))
        assert fused.shape == (1, H) and fused.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(fused.get().view(np.uint16), want.get().view(np.uint16))
        assert bool(cp.isfinite(fused).all())
    assert gemm.swiglu_gemv(a.astype(cp.float32), w) is None                    # float32 activations
    assert gemm.swiglu_gemv(cp.concatenate([a, a]), w) is None                   # two tokens
    assert gemm.swiglu_gemv(a, quantize(cp.ones((24, K), cp.float32), fmt)) is None   # N % 16 != 0
    with pytest.raises(ValueError, match="mmvk only"):   # no other kernel has the epilogue
        gemm._plan(w, 1, K, "float16", K, 0, "swiglu8", np.dtype(np.float16), dict(gemm.TILES["mmvd"], SPLIT=0))
