"""Tensors past 2^31 elements on the GPU: every kernel indexes them in 64 bits.

Each case puts the data it checks beyond element 2^31 (an int32 offset there would wrap and read or write
somewhere else) and compares those rows with the float64 reference (the FP4 codecs bit for bit). Marked `slow`
as well as `gpu`: each allocates 5-20 GB and takes a few seconds on an H100; a GPU with less free memory skips
them and says so.
"""
import numpy as np
import pytest

import vbw_cupy as vc
from vbw_cupy import paged
from vbw_cupy import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
BIG = 2**31


def _need(gb):
    import cupy as cp
    free = cp.cuda.runtime.memGetInfo()[0] / 2**30
    if free < gb:
        pytest.skip(f"needs {gb} GB of free GPU memory, {free:.0f} GB free")


@pytest.fixture(autouse=True)
def _release():
    yield
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()


def _fill(a, seed):
    """Standard normal values into a large GPU array, a slab at a time (no float32 copy of the whole)."""
    import cupy as cp
    rs = cp.random.RandomState(seed)
    flat = a.reshape(-1)
    step = 1 << 28
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rs.standard_normal(n, dtype=cp.float32).astype(a.dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_dequantize_past_2_31_elements(fmt):
    import cupy as cp
    _need(16)
    K = 4096
    R = BIG // K + 512                       # 2^31 + 2^21 elements
    x = cp.empty((R, K), dtype=cp.float16)
    _fill(x, 1)
    t = vc.quantize(x, fmt)
    rows = np.r_[0:4, R - 8:R]               # the last rows start past element 2^31
    want = vc.quantize(x[rows].get(), fmt, global_scale=t.global_scale if fmt == "nvfp4" else None)
    np.testing.assert_array_equal(t.data[rows].get(), want.data)
    np.testing.assert_array_equal(t.scales[rows].get(), want.scales)
    back = vc.dequantize(t, np.float16)
    del x
    np.testing.assert_array_equal(back[rows].get(), ref.dequantize(want, np.float16))
    vc.check_errors()


def test_fp4_matmul_output_past_2_31_elements():
    import cupy as cp
    _need(12)
    M, N, K = (1 << 16) + 3, (1 << 15) + 8, 64      # M * N = 2^31 + 786456 outputs
    rs = cp.random.RandomState(2)
    w = vc.quantize(rs.standard_normal((N, K), dtype=cp.float32), "nvfp4")
    a = rs.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
    out = vc.fp4_matmul(a, w)
    assert out.shape == (M, N)
    rows = np.r_[0:2, M - 4:M]
    z = a[rows].get().astype(np.float64) @ ref.dequantize(w.to_cpu(), np.float64).T
    got = out[rows].get().astype(np.float64)
    err = np.linalg.norm(got - z) / np.linalg.norm(z)
    bound = 2 * np.linalg.norm(z.astype(np.float16).astype(np.float64) - z) / np.linalg.norm(z) + 1e-6
    assert err <= bound, (err, bound)


def test_paged_attention_cache_past_2_31_elements():
    import cupy as cp
    _need(14)
    bs, Hkv, Hq, D = 16, 16, 32, 128
    nblocks = BIG // (bs * Hkv * D) + 1000          # 2^31 + ~33M elements a cache
    kc = cp.empty((nblocks, bs, Hkv, D), dtype=cp.float16)
    vcache = cp.empty_like(kc)
    lens = np.array([300, 77], dtype=np.int32)
    need = -(-lens // bs)
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.arange(nblocks - 900, nblocks))[:need.sum()].astype(np.int32)  # all past 2^31
    table = np.full((2, need.max()), -1, dtype=np.int32)
    table[0, :need[0]], table[1, :need[1]] = ids[:need[0]], ids[need[0]:]
    for c in (kc, vcache):                            # only the last 1000 blocks get values (the ones in use)
        c[nblocks - 1000:] = cp.asarray(rng.standard_normal((1000, bs, Hkv, D), dtype=np.float32)).astype(cp.float16)
    q = rng.standard_normal((2, Hq, D), dtype=np.float32).astype(np.float16)
    out = paged.paged_attention(cp.asarray(q), kc, vcache, cp.asarray(table), cp.asarray(lens))
    vc.check_errors()
    small_k, small_v = kc[cp.asarray(ids)].get(), vcache[cp.asarray(ids)].get()   # the used blocks, renumbered
    small_table = np.full_like(table, -1)
    small_table[0, :need[0]] = np.arange(need[0])
    small_table[1, :need[1]] = np.arange(need[0], need.sum())
    err, base, bound = paged.reference_errors(q, small_k, small_v, small_table, lens, out.get())
    assert err <= bound, (err, base, bound)


def test_flash_attention_past_2_31_elements():
    import cupy as cp
    _need(24)
    B, S, H, D = 1, (1 << 20) + 4096, 16, 128         # 2^31 + 2^23 elements a tensor
    q, k, v = (cp.empty((B, S, H, D), dtype=cp.float16) for _ in range(3))
    for a, seed in ((q, 6), (k, 7), (v, 8)):
        _fill(a, seed)
    left = 127                                        # a sliding window keeps the work small
    o = vc.flash_attention(q, k, v, window=(left, 0))
    n = 48                                            # the last query rows, past element 2^31
    qs, ks, vs = q[:, S - n:].get(), k[:, S - n - left:].get(), v[:, S - n - left:].get()
    want = ref.flash_attention(qs, ks, vs, window=(left, 0))   # bottom-right aligned: the same keys
    base = ref.rel_error(ref.sdpa_lowp(qs, ks, vs, window=(left, 0)), want)
    err = ref.rel_error(o[:, S - n:].get(), want)
    assert err <= min(2 * base, 2e-3) + 1e-7, (err, base)
