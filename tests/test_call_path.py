"""The call path around the kernels: bad index values checked on the device, and every op in a CUDA graph.

GPU: paged_attention and flash_attention_varlen given bad block ids, lengths and offsets write NaN rows for those
sequences only, flag the device error word, and `check_errors()` raises ValueError naming the argument and the
sequence; the process stays usable. Each public op is captured in a CUDA graph, replayed on new input values
and compared with the eager call; arrays the pool hands out after the capture are not touched by a replay.
(bench/sanitize.sh runs the bad-index tests under compute-sanitizer memcheck with the pool off: VBW_TEST_NO_POOL=1,
which conftest.py honours for every GPU test.)
"""

import ml_dtypes
import numpy as np
import pytest

import vbw_cupy as vc
from vbw_cupy import _errors, attention, paged

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")
    yield
    if _errors._buffers:
        _errors.pending()  # a failed test must not leave flags for the next one


def _assert_nan_rows(o, bad):
    o = np.asarray(o, dtype=np.float32)
    for b in range(o.shape[0]):
        if b in bad:
            assert np.isnan(o[b]).all(), f"sequence {b}: expected NaN rows"
        else:
            assert np.isfinite(o[b]).all(), f"sequence {b}: expected finite rows"


# ------------------------------------------------------------------------------------- paged, bad values
PAGED_BAD = [  # (what, sequence, how to break it)
    ("block id 2^24", 1, lambda t, l, nb: t.__setitem__((1, 0), 1 << 24)),
    ("block id 2^27 + 5 (wraps to 5 in int32 row math)", 1, lambda t, l, nb: t.__setitem__((1, 1), (1 << 27) + 5)),
    ("block id -1", 2, lambda t, l, nb: t.__setitem__((2, 0), -1)),
    ("block id num_blocks", 0, lambda t, l, nb: t.__setitem__((0, 0), nb)),
    ("seq_len 1000x capacity", 1, lambda t, l, nb: l.__setitem__(1, 1000 * t.shape[1] * 16)),
    ("seq_len capacity + 1", 2, lambda t, l, nb: l.__setitem__(2, t.shape[1] * 16 + 1)),
    ("seq_len 0", 0, lambda t, l, nb: l.__setitem__(0, 0)),
    ("seq_len -7", 2, lambda t, l, nb: l.__setitem__(2, -7)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [(300, 70, 45), (9000, 4000, 20000)], ids=["one-split", "split-k"])
@pytest.mark.parametrize("bad", PAGED_BAD, ids=[b[0] for b in PAGED_BAD])
def test_gpu_paged_bad_values_give_nan_rows_and_an_error(bad, lens):
    import cupy as cp
    what, seq, breaker = bad
    h = list(paged.make_case(np.random.default_rng(5), 3, np.asarray(lens), 32, 8, 128, 16, F16))
    table, lens_h = h[3].copy(), h[4].copy()
    table[table < 0] = 0
    breaker(table, lens_h, h[1].shape[0])
    d = [cp.asarray(a) for a in h[:3]] + [cp.asarray(table), cp.asarray(lens_h)]
    out = cp.full(h[0].shape, np.nan, dtype=F16)
    _errors.check_errors()                                   # nothing pending before
    paged.paged_attention(*d, out=out)                       # default check="device": no raise, no sync
    o = out.get()
    _assert_nan_rows(o, {seq})
    arg = "seq_lens" if "seq_len" in what else "block_table"
    with pytest.raises(ValueError, match=rf"paged_attention: {arg}: .*sequence {seq}\b"):
        vc.check_errors()
    vc.check_errors()                                        # cleared
    good = [b for b in range(3) if b != seq]
    sub = [h[0][good], h[1], h[2], h[3][good], h[4][good]]
    err, base, bound = paged.reference_errors(*sub, o[good])
    assert err <= bound
    # the context is alive: a clean call works and agrees
    o2 = paged.paged_attention(*[cp.asarray(a) for a in sub]).get()
    assert paged.reference_errors(*sub, o2)[0] <= bound
    vc.check_errors()
    # check="host" raises at once, before any launch
    with pytest.raises(ValueError, match=arg):
        paged.paged_attention(*d, check="host")


@pytest.mark.gpu
def test_gpu_host_check_raises_errors_flagged_earlier():
    import cupy as cp
    h = paged.make_case(np.random.default_rng(6), 2, np.asarray([40, 50]), 8, 2, 64, 16, F16)
    d = [cp.asarray(a) for a in h]
    bad = d[4].copy()
    bad[0] = 10 ** 6
    paged.paged_attention(*d[:4], bad)
    with pytest.raises(ValueError, match="seq_lens.*sequence 0"):
        paged.paged_attention(*d, check="host")              # the earlier flag, although these values are fine
    paged.paged_attention(*d, check="host")


# ------------------------------------------------------------------------------------ varlen, bad offsets
GOOD_Q, GOOD_K = [0, 100, 137, 387], [0, 300, 337, 587]   # sequence lengths q (100, 37, 250), k (300, 37, 250)
VARLEN_BAD = [  # (what, argument, bad sequence, cu_q, cu_k)
    ("decreasing q", "cu_seqlens_q", 2, [0, 100, 137, 120], GOOD_K),
    ("q past the tokens", "cu_seqlens_q", 2, [0, 100, 137, 10 ** 9], GOOD_K),
    ("q longer than max_seqlen_q", "cu_seqlens_q", 2, [0, 100, 137, 387 + 200], GOOD_K),
    ("q not starting at 0", "cu_seqlens_q", 0, [3, 100, 137, 387], GOOD_K),
    ("negative k", "cu_seqlens_k", 0, GOOD_Q, [-50, 300, 337, 587]),
    ("k past the tokens", "cu_seqlens_k", 2, GOOD_Q, [0, 300, 337, 2 ** 31 - 1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bad", VARLEN_BAD, ids=[b[0] for b in VARLEN_BAD])
def test_gpu_varlen_bad_offsets_give_nan_rows_and_an_error(bad):
    import cupy as cp
    what, arg, seq, cu_q, cu_k = bad
    rng = np.random.default_rng(8)
    tq, tk = 587 if "max_seqlen" in what else 387, 587
    q = cp.asarray(rng.standard_normal((tq, 8, 64), dtype=np.float32).astype(F16))
    k = cp.asarray(rng.standard_normal((tk, 2, 64), dtype=np.float32).astype(F16))
    v = cp.asarray(rng.standard_normal((tk, 2, 64), dtype=np.float32).astype(F16))
    o = attention.flash_attention_varlen(q, k, v, cp.asarray(cu_q, dtype=cp.int32), cp.asarray(cu_k, dtype=cp.int32),
                                         max_seqlen_q=250, max_seqlen_k=300, causal=True)
    with pytest.raises(ValueError, match=rf"flash_attention_varlen: {arg}: .*sequence {seq}\b"):
        vc.check_errors()
    o = o.get().astype(np.float32)
    for b in range(3):
        if b == seq:
            continue
        rows, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert np.isfinite(o[rows]).all(), f"sequence {b} should be untouched"
        want = vc.reference.flash_attention(q.get()[rows][None].astype(np.float32),
                                            k.get()[ks][None].astype(np.float32),
                                            v.get()[ks][None].astype(np.float32), causal=True)[0]
        assert vc.reference.rel_error(o[rows], want) < 2e-3
    lo, hi = max(0, cu_q[seq]), min(tq, cu_q[seq + 1])
    if hi > lo:
        assert np.isnan(o[lo:hi]).all(), "the bad sequence's rows should be NaN"
    # the same call with check="host" raises before the launch
    with pytest.raises(ValueError, match="cu_seqlens|max_seqlen_q"):
        attention.flash_attention_varlen(q, k, v, cp.asarray(cu_q, dtype=cp.int32), cp.asarray(cu_k, dtype=cp.int32),
                                         max_seqlen_q=250, max_seqlen_k=300, causal=True, check="host")


@pytest.mark.gpu
def test_gpu_nvfp4_nan_with_global_scale_is_flagged_without_a_sync():
    import cupy as cp
    x = cp.ones((64, 256), dtype=cp.float16)
    x[5, 7] = cp.nan
    vc.quantize(x, "nvfp4", global_scale=1.0)               # no raise here: no sync
    with pytest.raises(ValueError, match="quantize: x: NaN or Inf"):
        vc.check_errors()
    with pytest.raises(ValueError, match="NaN or Inf"):     # without a global_scale: raised at once
        vc.quantize(x, "nvfp4")


# ------------------------------------------------------------------------------------------ CUDA graphs
def _capture(fn):
    """Capture fn() on a new stream (after one eager call there, which builds the plans): (graph, its result)."""
    import cupy as cp
    cp.cuda.Device().synchronize()  # inputs were written on the legacy stream, which `s` does not wait for
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        res = fn()
        g = s.end_capture()
    return g, res, s


def _replay(g, s):
    import cupy as cp
    cp.cuda.Device().synchronize()  # new input values were written on the legacy stream
    g.launch(stream=s)
    s.synchronize()


def _fill_(a, rng):
    """New random values into a GPU array in place (graph inputs keep their addresses)."""
    import cupy as cp
    a[...] = cp.asarray(rng.standard_normal(a.shape, dtype=np.float32)).astype(a.dtype)


def _graph_case(make_inputs, call, compare):
    """Capture call(*inputs), replay with new input values, compare with an eager call; also allocate arrays
    after the capture and check a replay leaves them alone."""
    import cupy as cp
    rng = np.random.default_rng(11)
    inputs = make_inputs(rng)
    g, res, s = _capture(lambda: call(*inputs))
    sentinels = [cp.full(n, 7.0, dtype=cp.float32) for n in (1 << 10, 1 << 16, 1 << 20, 3 << 20)]
    for _ in range(2):
        for a in inputs:
            if isinstance(a, cp.ndarray) and a.dtype.kind == "f":
                _fill_(a, rng)
        _replay(g, s)
        with s:
            want = call(*inputs)
            s.synchronize()
        compare(res, want)
    for t in sentinels:
        assert bool((t == 7.0).all()), "a graph replay wrote into memory allocated after the capture"


def _same(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    for x, y in zip(a, b):
        if hasattr(x, "data") and hasattr(x, "scales"):      # FP4Tensor
            np.testing.assert_array_equal(x.data.get(), y.data.get())
            np.testing.assert_array_equal(x.scales.get(), y.scales.get())
        else:
            np.testing.assert_array_equal(x.get(), y.get())


def _rand(shape, dtype=F16):
    import cupy as cp
    return lambda rng: cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _fp8_attention(q, k, v, heads=None):
    """quantize_e4m3 of each input (heads: one descale a KV head), then flash_attention_fp8; returns every array
    the graph writes (so none goes back to the pool while the graph lives)."""
    import cupy as cp
    qs = [vc.quantize_e4m3(x, heads=heads) for x in (q, k, v)]
    ds = (cp.concatenate if heads is None else cp.stack)([d for _, d in qs])
    return (vc.flash_attention_fp8(*[c for c, _ in qs], ds, causal=True), ds) + tuple(c for c, _ in qs)


GRAPH_CASES = {
    "quantize mxfp4": (lambda r: [_rand((256, 1000))(r)], lambda x: vc.quantize(x, "mxfp4")),
    "quantize nvfp4 given scale": (lambda r: [_rand((64, 4096), BF16)(r)],
                                   lambda x: vc.quantize(x, "nvfp4", global_scale=0.01)),
    "quantize_fp8": (lambda r: [_rand((300, 1000))(r)], lambda x: vc.quantize_fp8(x)),
    "flash_attention causal": (lambda r: [_rand((2, 300, 8, 128))(r), _rand((2, 300, 2, 128))(r),
                                          _rand((2, 300, 2, 128))(r)],
                               lambda q, k, v: attention.flash_attention(q, k, v, causal=True, return_lse=True)),
    "flash_attention D=80 window": (lambda r: [_rand((1, 200, 4, 80), BF16)(r), _rand((1, 333, 4, 80), BF16)(r),
                                               _rand((1, 333, 4, 80), BF16)(r)],
                                    lambda q, k, v: attention.flash_attention(q, k, v, window=(50, 3))),
    "quantize_e4m3 + flash_attention_fp8": (lambda r: [_rand((1, 300, 4, 128))(r) for _ in range(3)], _fp8_attention),
    "quantize_e4m3 heads + flash_attention_fp8": (lambda r: [_rand((2, 300, 4, 128))(r), _rand((2, 300, 2, 128))(r),
                                                             _rand((2, 300, 2, 128))(r)],
                                                  lambda q, k, v: _fp8_attention(q, k, v, heads=2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_gpu_graph_capture_and_replay(name):
    make, call = GRAPH_CASES[name]
    _graph_case(make, call, _same)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_graph_dequantize(fmt):
    import cupy as cp
    w = vc.quantize(cp.asarray(np.random.default_rng(1).standard_normal((128, 512), dtype=np.float32)), fmt)
    g, res, s = _capture(lambda: vc.dequantize(w, cp.float16))
    rng = np.random.default_rng(2)
    w.data[...] = cp.asarray(rng.integers(0, 256, w.data.shape, dtype=np.uint8))  # new codes, same addresses
    _replay(g, s)
    np.testing.assert_array_equal(res.get(), vc.dequantize(w, cp.float16).get())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 256])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_graph_fp4_matmul(M, fmt):
    import cupy as cp
    rng = np.random.default_rng(M)
    w = vc.quantize(cp.asarray(rng.standard_normal((1000, 4096), dtype=np.float32)).astype(cp.float16), fmt)
    bias = cp.asarray(rng.standard_normal(1000, dtype=np.float32)).astype(cp.float16)
    _graph_case(lambda r: [_rand((M, 4096))(r)], lambda a: vc.fp4_matmul(a, w, bias=bias, activation="silu"),
                _same)


@pytest.mark.gpu
@pytest.mark.parametrize("act_fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("K", [4096, 1000])
def test_gpu_graph_fp4_matmul_quantized_activations(act_fmt, K):
    """W4A8 and W4A4: quantize the activations and multiply in one captured graph (the FP8 tensor-core path on
    Hopper, with its conversion and padded copies in scratch; the float32 path on the dequantized activations
    elsewhere). The quantized activations are part of the result, so the graph's intermediate stays alive."""
    import cupy as cp
    rng = np.random.default_rng(K)
    w = vc.quantize(cp.asarray(rng.standard_normal((520, K), dtype=np.float32)), "mxfp4")

    def call(a):
        qa = vc.quantize_fp8(a) if act_fmt == "fp8" else vc.quantize(a, "mxfp4")
        return qa, vc.fp4_matmul(qa, w, activation="silu")
    _graph_case(lambda r: [_rand((300, K))(r)], call, _same)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [(40, 3000, 17), (32000,)], ids=["ragged", "split-k"])
def test_gpu_graph_paged_attention_as_sequences_grow(lens):
    """The pool bug of the issue: capture, then let the pool hand memory to others, then replay with the
    sequences one token longer each time."""
    import cupy as cp
    B = len(lens)
    cap = max(lens) + 40
    h = paged.make_case(np.random.default_rng(3), B, np.asarray([cap] * B), 32, 8, 128, 16, F16)
    d = [cp.asarray(a) for a in h]
    seq = cp.asarray(np.asarray(lens, dtype=np.int32))
    q = d[0]
    g, res, s = _capture(lambda: paged.paged_attention(q, d[1], d[2], d[3], seq))
    sentinels = [cp.full(n, 7.0, dtype=cp.float32) for n in (1 << 12, 1 << 18, 1 << 22)]
    for step in range(3):
        seq += 1
        _fill_(q, np.random.default_rng(step))
        _replay(g, s)
        with s:
            want = paged.paged_attention(q, d[1], d[2], d[3], seq)
            s.synchronize()
        np.testing.assert_array_equal(res.get(), want.get())
        hl = seq.get()
        err, base, bound = paged.reference_errors(q.get(), h[1], h[2], h[3], hl, res.get())
        assert err <= bound
    for t in sentinels:
        assert bool((t == 7.0).all()), "a graph replay wrote into memory allocated after the capture"
    vc.check_errors()


@pytest.mark.gpu
def test_gpu_graph_varlen():
    import cupy as cp
    cu_q = cp.asarray([0, 100, 137, 387], dtype=cp.int32)
    cu_k = cp.asarray([0, 300, 337, 587], dtype=cp.int32)
    _graph_case(lambda r: [_rand((387, 8, 64))(r), _rand((587, 2, 64))(r), _rand((587, 2, 64))(r)],
                lambda q, k, v: attention.flash_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=250,
                                                                 max_seqlen_k=300, causal=True),
                _same)
    vc.check_errors()


@pytest.mark.gpu
def test_gpu_graph_paged_cache_attention():
    import cupy as cp
    cache = paged.PagedKVCache(64, 16, 2, 64, cp.float16, max_batch=2, max_blocks_per_seq=32)
    rng = np.random.default_rng(4)
    cache.append(*(cp.asarray(rng.standard_normal((2, 100, 2, 64), dtype=np.float32)).astype(cp.float16)
                   for _ in range(2)))
    q = cp.asarray(rng.standard_normal((2, 8, 64), dtype=np.float32)).astype(cp.float16)
    g, res, s = _capture(lambda: cache.attention(q))
    _fill_(q, rng)
    _replay(g, s)
    np.testing.assert_array_equal(res.get(), cache.attention(q).get())


@pytest.mark.gpu
def test_gpu_paged_cache_append_float32_matches_numpy():
    """The append kernel copies 4-byte elements too: the same appends on the GPU and on NumPy give equal caches."""
    import cupy as cp
    rng = np.random.default_rng(6)
    caches = [paged.PagedKVCache(20, 8, 2, 16, np.float32, max_batch=3, max_blocks_per_seq=6, xp=xp) for xp in (cp, np)]
    for T, seqs in ((5, None), (1, [2, 0]), (11, [1]), (1, [0, 1, 2])):
        k, v = (rng.standard_normal((len(seqs or range(3)), T, 2, 16), dtype=np.float32) for _ in range(2))
        caches[0].append(cp.asarray(k), cp.asarray(v), seqs=seqs)
        caches[1].append(k, v, seqs=seqs)
    for name in ("k_cache", "v_cache", "block_table", "seq_lens"):
        np.testing.assert_array_equal(getattr(caches[0], name).get(), getattr(caches[1], name))


@pytest.mark.gpu
def test_gpu_graph_paged_cache_append_and_attention():
    dtype = np.float16
    """A captured decode step (append one token to sequences 2 and 0, attend) replayed step after step writes at
    the device lengths, crossing block boundaries, and equals the same steps run eagerly on a second cache."""
    import cupy as cp
    rng = np.random.default_rng(5)
    new = lambda *shape: cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    caches = [paged.PagedKVCache(64, 16, 2, 64, dtype, max_batch=3, max_blocks_per_seq=8) for _ in range(2)]
    prompt = [new(3, 13, 2, 64) for _ in range(2)]
    for c in caches:
        c.append(*prompt)
        c.reserve(12)
    k, v, q = new(2, 2, 64), new(2, 2, 64), new(2, 8, 64)
    seqs = [2, 0]

    def step(c):
        c.append(k, v, seqs=seqs)
        return c.attention(q, seqs=seqs, max_seqlen=128)

    g, res, s = _capture(lambda: step(caches[0]))    # the eager warm-up runs step 1; the capture runs nothing
    step(caches[1])
    for i in range(8):
        for a in (k, v, q):
            _fill_(a, rng)
        _replay(g, s)
        want = step(caches[1]).get()
        np.testing.assert_array_equal(res.get(), want)
    assert caches[0].sync_lengths().tolist() == [13 + 9, 13, 13 + 9]
    np.testing.assert_array_equal(caches[0].k_cache.get(), caches[1].k_cache.get())
    vc.check_errors()


@pytest.mark.gpu
def test_gpu_graph_time_ms_times_a_replayed_kernel():
    """_timing.graph_time_ms (the benchmarks' graph timer): a 64 MB fill takes about its bandwidth's time."""
    import cupy as cp
    from vbw_cupy import _timing
    a = cp.empty(16 << 20, dtype=cp.float32)
    ms = _timing.graph_time_ms([lambda: a.fill(1.0)], target_ms=5.0, reps=3)
    assert 1e-3 < ms < 5.0 and float(a[-1]) == 1.0


@pytest.mark.gpu
def test_gpu_steady_ms_times_sustained_calls_and_reads_the_clock():
    """_timing.steady_ms (the benchmarks' sustained timer): warm-up, then windows; a 64 MB fill takes about its
    bandwidth's time. Where the driver's NVML is mounted (the benchmark machines), the info dict gets the SM
    clock and board power it read."""
    import ctypes
    import cupy as cp
    from vbw_cupy import _device, _timing
    a = cp.empty(16 << 20, dtype=cp.float32)
    info = {}
    ms = _timing.steady_ms(lambda: a.fill(2.0), warm_s=0.2, time_s=0.2, info=info)
    assert 1e-3 < ms < 5.0 and float(a[-1]) == 2.0
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert info == {} and _device.clock_and_power() is None
        pytest.skip("the timing is checked; NVML (libnvidia-ml) is not mounted here, so no clock to check")
    assert 100 <= info["mhz"] <= 4000 and 0 < info["watts"] < 2000, info
    mhz, watts = _device.clock_and_power()
    assert 100 <= mhz <= 4000 and 0 < watts < 2000


def test_steady_pair_flips_the_order_and_reports_each_sides_clock(monkeypatch):
    """_timing.steady_pair (no GPU; steady_ms stubbed): two rounds, each side first once, every timing
    sustained with its own clock reading; the ratio is the per-round b / a and the clocks each side's median."""
    from vbw_cupy import _timing
    calls = []

    def fake_steady(fn, info=None, **kw):
        side = fn()
        calls.append(side)
        info["mhz"] = 1500.0 if side == "a" else 1400.0 + len(calls)
        return 1.0 if side == "a" else 1.3
    monkeypatch.setattr(_timing, "steady_ms", fake_steady)
    r = _timing.steady_pair(lambda: "a", lambda: "b")
    assert calls == ["a", "b", "b", "a"]
    assert abs(r["ratio"] - 1.3) < 1e-12 and r["a_ms"] == 1.0 and r["b_ms"] == 1.3
    assert r["a_mhz"] == 1500.0 and r["b_mhz"] == 1402.5
    monkeypatch.setattr(_timing, "steady_ms", lambda fn, info=None, **kw: 1.0)  # no clock readable (no NVML)
    r = _timing.steady_pair(lambda: "a", lambda: "b")
    assert r["ratio"] == 1.0 and np.isnan(r["a_mhz"]) and np.isnan(r["b_mhz"])


class _FakeNvml:
    """The four NVML entry points clock_and_power calls, answering through their ctypes pointers."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def _ret(self, name, *args):
        self.calls.append((name, args))
        return 999 if name in self.fail else 0

    def nvmlInit_v2(self):
        return self._ret("init")

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, handle):
        handle._obj.value = 0xABC
        return self._ret("handle", bus)

    def nvmlDeviceGetClockInfo(self, h, clock_type, out):
        out._obj.value = 1575
        return self._ret("clock", h.value, clock_type)

    def nvmlDeviceGetPowerUsage(self, h, out):
        out._obj.value = 698_500  # milliwatts
        return self._ret("power", h.value)


@pytest.mark.parametrize("fail", [(), ("init",), ("handle",), ("clock",), ("power",), ("no library",)])
def test_clock_and_power_reads_nvml_or_gives_none(monkeypatch, fail):
    """_device.clock_and_power against a fake NVML: the SM clock (NVML_CLOCK_SM = 1) in MHz and the power in W
    (NVML gives mW), the device found by its PCI bus id; None (never an exception) when the library is missing
    or any call fails, so a benchmark still times on a machine without NVML."""
    import ctypes
    from vbw_cupy import _device
    from tests import fake_cupy
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(fake_cupy.cuda.runtime, "deviceGetPCIBusId", lambda dev: f"0000:{dev + 0x1b:02x}:00.0",
                        raising=False)
    lib = _FakeNvml(fail)

    def cdll(name):
        if "no library" in fail:
            raise OSError(f"{name}: cannot open shared object file")
        assert name == "libnvidia-ml.so.1"
        return lib
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    _device._nvml_handle.cache_clear()
    try:
        got = _device.clock_and_power()
    finally:
        _device._nvml_handle.cache_clear()
    if fail:
        assert got is None
        return
    assert got == (1575.0, 698.5)
    assert lib.calls == [("init", ()), ("handle", (b"0000:1b:00.0",)), ("clock", (0xABC, 1)), ("power", (0xABC,))]


@pytest.mark.gpu
def test_gpu_programmatic_launches_equal_plain_launches():
    """Programmatic dependent launch (cuda_src/pdl.cuh; the model's decode graph uses it): a chain where each
    kernel reads what the one before wrote (M = 1 GEMV -> paged attention -> GEMV ...), launched plainly,
    as programmatic dependents, and as programmatic dependents in a CUDA graph, gives the same bits."""
    import cupy as cp
    from vbw_cupy import _device, _runtime as rt
    rng = np.random.default_rng(12)
    H, D = 32, 128
    ws = [vc.quantize(cp.asarray(rng.standard_normal((H * D, H * D), dtype=np.float32) / 64), "nvfp4")
          for _ in range(3)]
    kc, vcache = (cp.asarray(rng.standard_normal((64, 16, 8, D), dtype=np.float32)).astype(cp.float16)
                  for _ in range(2))
    table = cp.asarray(rng.permutation(64)[:40].astype(np.int32).reshape(1, 40))
    lens = cp.asarray(np.array([611], dtype=np.int32))
    x0 = cp.asarray(rng.standard_normal((1, H * D), dtype=np.float32)).astype(cp.float16)

    keep = []  # every array a captured graph writes must outlive the graph

    def chain():
        x = x0
        for w in ws:
            x = vc.fp4_matmul(x, w)                          # M = 1: the decode GEMV (mmvk)
            keep.append(x)
            x = paged.paged_attention(x.reshape(1, H, D), kc, vcache, table, lens).reshape(1, H * D)
            keep.append(x)
        return x

    plain = chain().get()
    if _device.device_arch() >= 90:
        with rt.programmatic_launches():
            assert rt.pdl_enabled()
            assert rt.get_kernel("model.cu", "vbw_model::silu_mul<__half>").pdl
            assert rt.get_kernel("fp4_gemm_sm80.cu", "vbw_fp4gemm::fp4_gemm_mmvk<__half, 16, 1>").pdl
            eager = chain().get()
            g, res, s = _capture(chain)
        _replay(g, s)
        np.testing.assert_array_equal(eager, plain)
        np.testing.assert_array_equal(res.get(), plain)
    assert np.isfinite(plain).all()
    vc.check_errors()



@pytest.mark.gpu
def test_gpu_flash_fast_path_new_addresses_each_call(monkeypatch):
    """The fast path keeps one packed launch per (q, k, v) addresses under a plan (the wgmma kernel's tensor maps
    hold them), at most attention._LAUNCHES_PER_PLAN, least recently used out: after the first call every call
    takes it, and each reads its own inputs."""
    cp = pytest.importorskip("cupy")
    from vbw_cupy import reference as ref
    full = []
    real = attention._flash_gpu
    monkeypatch.setattr(attention, "_flash_gpu", lambda *a, **k: full.append(1) or real(*a, **k))
    attention._fast_plans.clear()
    rng = np.random.default_rng(3)
    n = attention._LAUNCHES_PER_PLAN + 5
    cases = [[cp.asarray(rng.standard_normal((1, 200, 4, 64)).astype(np.float16)) for _ in range(3)]
             for _ in range(n)]
    order = cases + cases[::-1]  # each address twice, the second pass past the cache's size again
    outs = [vc.flash_attention(q, k, v, causal=True) for q, k, v in order]
    assert len(full) == 1, "the fast path missed"
    for (q, k, v), o in zip(order, outs):
        want = ref.flash_attention(*(x.get().astype(np.float32) for x in (q, k, v)), causal=True)
        assert ref.rel_error(o.get().astype(np.float32), want) <= 2e-3
    (plan,) = attention._fast_plans.values()
    assert len(plan[-1]) == attention._LAUNCHES_PER_PLAN
    kept = {p for p in plan[-1]}
    assert {tuple(x.data.ptr for x in c) for c in cases[:attention._LAUNCHES_PER_PLAN]} == kept  # the recent ones


def test_check_errors_rejects_an_unknown_op():
    with pytest.raises(ValueError, match=r"op: expected one of .*'paged_attention'.* got 'nonsense'"):
        vc.check_errors(op="nonsense")
    vc.check_errors(op="paged_attention")  # (a known name: nothing flagged, no error)
    with pytest.raises(ValueError, match=r"op: expected one of .* got \['quantize'\]"):
        vc.check_errors(op=["quantize"])
    for bad in ("abc", [0], 1.5, True, -1):
        with pytest.raises(ValueError, match="device: expected None or a device id"):
            vc.check_errors(device=bad)


def test_alternating_flips_the_order_and_takes_median_ratios():
    """_timing.alternating (no GPU): each side goes first in half the rounds; the result is each side's median
    and the median of the per-round ratios (here b is always 2x a, though both drift)."""
    from vbw_cupy import _timing
    order = []

    def a():
        order.append("a")
        return 1.1 ** ((len(order) - 1) // 2)    # the card drifts from round to round

    def b():
        order.append("b")
        return 2 * 1.1 ** ((len(order) - 1) // 2)
    ma, mb, ratio = _timing.alternating(a, b, rounds=6)
    firsts = order[::2]
    assert firsts.count("a") == firsts.count("b") == 3 and len(order) == 12
    assert abs(ratio - 2.0) < 1e-12 and ma < mb
