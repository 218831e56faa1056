"""The host fast paths of flash_attention, paged_attention and quantize (launch plans cached per call
signature), on the CPU.

tests/fake_cupy.py stands in for CuPy: kernels record their launches instead of running, so these tests check
that a call served from a cached plan launches exactly what the fully checked call launches, that anything
that can differ between same-signature calls is still checked (bad values, option types, contiguity,
alignment, devices), and that FP4Tensor's private constructor builds what the checked one builds. The GPU
halves (results against the reference) are in test_attention.py, test_paged.py and test_fp4.py.
"""
import dataclasses

import numpy as np
import pytest

import fake_cupy as fc
from vbw_cupy import _checks, _errors
from vbw_cupy import _runtime as rt
from vbw_cupy import _plans, attention, autotune, fp4, gemm, paged
from vbw_cupy import reference as ref


@pytest.fixture
def kernels(monkeypatch):
    paged._sigs.clear()
    fp4._q_plans.clear()
    attention._fast_plans.clear()
    ks = fc.install(monkeypatch)
    full_calls.clear()
    for mod, name in ((_checks, "check_paged_args"), (fp4, "_quantize_gpu"), (attention, "_flash_gpu")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: full_calls.append(_name) or
                            _real(*a, **k))
    yield ks
    # plans hold fake kernels: none may survive into a real GPU run in the same process
    paged._sigs.clear()
    fp4._q_plans.clear()
    attention._fast_plans.clear()


full_calls = []  # names of the full-path functions called (check_paged_args, _quantize_gpu, _flash_gpu)


def _launches(ks):
    """Every recorded launch so far, in order, then forget them: [(kernel name, grid, block, args, smem)]."""
    out = [(k.name, *c) for k in ks.values() for c in k.calls]
    for k in ks.values():
        k.calls.clear()
    return out


def _same_launches(a, b, inputs):
    """Launch lists equal up to the freshly allocated buffers (same shape and dtype there): kernels, grids,
    blocks, shared memory and scalar arguments identical; the input arrays passed as the same objects."""
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert la[0] == lb[0] and la[1] == lb[1] and la[2] == lb[2] and la[4] == lb[4]
        assert len(la[3]) == len(lb[3])
        for x, y in zip(la[3], lb[3]):
            if isinstance(x, fc.ndarray):
                assert isinstance(y, fc.ndarray) and x.shape == y.shape and x.dtype == y.dtype
                if any(x is i for i in inputs):
                    assert y is x
            else:
                assert type(x) is type(y) and x == y


def _paged_case(B=3, lens=(5, 40, 17), Hq=8, Hkv=2, D=64, bs=4, dtype=np.float16, device=0):
    h = paged.make_case(np.random.default_rng(0), B, np.asarray(lens), Hq, Hkv, D, bs, dtype)
    return [fc.asgpu(a, device) for a in h]


# ------------------------------------------------------------------------------------------ paged_attention
@pytest.mark.parametrize("kw", [dict(check=False), dict(check=True), dict(check=False, max_seqlen=40),
                                dict(check=False, softcap=30.0, window=(10, 0), softmax_scale=0.2),
                                dict(check=True, long=True)])
def test_paged_second_call_replays_the_first(kernels, kw):
    kw = dict(kw)
    d = _paged_case(B=2, lens=(3000, 20), Hq=32, Hkv=8, D=128, bs=16) if kw.pop("long", False) else _paged_case()
    o1 = paged.paged_attention(*d, **kw)
    first = _launches(kernels)
    assert len(paged._sigs) == 1
    assert full_calls == ["check_paged_args"]
    o2 = paged.paged_attention(*d, **kw)
    assert full_calls == ["check_paged_args"]  # served by the plan
    second = _launches(kernels)
    assert o2 is not o1 and o2.shape == o1.shape and o2.dtype == o1.dtype
    _same_launches(first, second, d)
    assert len(first) in (1, 2)


def test_paged_long_context_uses_the_combine_kernel(kernels):
    d = _paged_case(B=1, lens=(32768,), Hq=32, Hkv=8, D=128, bs=16)
    for _ in range(2):
        paged.paged_attention(*d, check=False)
        names = [c[0] for c in _launches(kernels)]
        assert names[0].startswith("paged_decode<") and names[1].startswith("paged_decode_combine<")


def test_paged_host_check_plans_follow_the_longest_sequence(kernels):
    d = _paged_case()
    paged.paged_attention(*d, check="host")
    _launches(kernels)
    d[4].a[:] = [5, 3, 1]                     # shorter sequences: same signature, another plan
    paged.paged_attention(*d, check="host")
    sig, = paged._sigs.values()
    assert sorted(sig.plans) == [5, 40]
    a = _launches(kernels)
    paged._sigs.clear()
    paged.paged_attention(*d, check="host")   # the full path agrees
    _same_launches(_launches(kernels), a, d)


def test_paged_device_check_plan_ignores_the_values(kernels):
    d = _paged_case()
    paged.paged_attention(*d)                 # default check="device": one plan, sized by the table
    first = _launches(kernels)
    d[4].a[:] = [5, 3, 1]
    paged.paged_attention(*d)
    sig, = paged._sigs.values()
    assert sig.plans is None and sig.plan is not None
    _same_launches(first, _launches(kernels), d)


def test_paged_bad_values_still_raise_after_a_good_call(kernels):
    d = _paged_case()
    paged.paged_attention(*d, check="host")
    _launches(kernels)
    table, lens = d[3].a.copy(), d[4].a.copy()
    d[3].a[1, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        paged.paged_attention(*d, check="host")
    assert full_calls == ["check_paged_args"]  # raised by the fast path's value check
    d[3].a[:] = table
    d[4].a[1] = 0
    with pytest.raises(ValueError, match="seq_lens"):
        paged.paged_attention(*d, check="host")
    d[4].a[:] = lens
    d[4].a[2] = 10_000
    with pytest.raises(ValueError, match="seq_lens"):
        paged.paged_attention(*d, check="host")
    assert _launches(kernels) == []           # nothing launched for bad input


@pytest.mark.parametrize("good, bad, exc", [
    (dict(softmax_scale=1.0), dict(softmax_scale=True), TypeError),
    (dict(softmax_scale=1), dict(softmax_scale=True), TypeError),
    (dict(softcap=1.0), dict(softcap=True), TypeError),
    (dict(window=(1, 0)), dict(window=(True, 0)), TypeError),
    (dict(window=(0, 0)), dict(window=(False, False)), TypeError),
    (dict(check=True), dict(check=1), TypeError),
    (dict(check=False), dict(check=0), TypeError),
    (dict(check=False, max_seqlen=1), dict(check=False, max_seqlen=True), ValueError),
    (dict(check=False), dict(check=False, softmax_scale=float("nan")), ValueError),
    (dict(window=(-1, -1)), dict(window=[-1, -1, 0]), TypeError),
])
def test_paged_option_types_are_part_of_the_signature(kernels, good, bad, exc):
    d = _paged_case()
    paged.paged_attention(*d, **good)
    paged.paged_attention(*d, **good)
    _launches(kernels)
    with pytest.raises(exc):
        paged.paged_attention(*d, **bad)
    assert _launches(kernels) == []


def test_check_errors_reports_every_device(kernels):
    # flags of different ops on two devices: one check names both and clears both (the loop once reused the `op`
    # argument's name, so the second device was filtered to the first one's op and stayed flagged)
    w0, w1 = np.zeros(_errors._WORDS, np.int32), np.zeros(_errors._WORDS, np.int32)
    w0[5] = 1
    w1[1] = 0x7fffffff - 3
    _errors._buffers.update({0: fc.ndarray(w0, 0), 1: fc.ndarray(w1, 1)})
    with pytest.raises(ValueError) as e:
        _errors.check_errors()
    assert _errors.CODES[5][0] in str(e.value) and "(device 0)" in str(e.value)
    msg = str(e.value)
    assert "paged_attention: seq_lens" in msg and "sequence 3" in msg and "(device 1)" in msg
    assert not w0.any() and not w1.any()
    _errors.check_errors()  # nothing left


def test_paged_structural_errors_after_a_good_call(kernels):
    d = _paged_case()
    paged.paged_attention(*d, check=False)
    _launches(kernels)
    with pytest.raises(TypeError, match="k_cache"):                     # a host array among GPU ones
        paged.paged_attention(d[0], d[1].a, d[2], d[3], d[4], check=False)
    with pytest.raises(ValueError, match="out"):                        # wrong dtype
        paged.paged_attention(*d, check=False, out=fc.empty(d[0].shape, np.float32))
    out = fc.ndarray(np.empty(d[0].shape[:2] + (2 * d[0].shape[2],), np.float16))[:, :, ::2]
    paged.paged_attention(*d, check=False, out=fc.empty(d[0].shape, np.float16))
    with pytest.raises(ValueError, match="out"):                        # same shape, not contiguous
        paged.paged_attention(*d, check=False, out=out)
    other = [d[0], d[1], fc.ndarray(d[2].a, 1), d[3], d[4]]             # v_cache on GPU 1
    with pytest.raises(ValueError, match="different devices"):
        paged.paged_attention(*other, check=False)
    _launches(kernels)
    with pytest.raises(ValueError, match="out"):
        paged.paged_attention(*d, check=False, out=fc.ndarray(np.empty(d[0].shape, np.float16), 1))
    assert _launches(kernels) == []


def test_paged_views_and_misalignment_take_the_full_path(kernels):
    d = _paged_case()
    paged.paged_attention(*d, check=False)
    ref_launch, = _launches(kernels)
    # q of the same shape but strided: the full path launches on a contiguous copy
    big = fc.ndarray(np.repeat(d[0].a, 2, axis=2))
    qv = big[:, :, ::2]
    assert qv.shape == d[0].shape and not qv.flags.c_contiguous
    paged.paged_attention(qv, *d[1:], check=False)
    (_, grid, block, args, smem), = _launches(kernels)
    assert args[0] is not qv and args[0].flags.c_contiguous and np.array_equal(args[0].a, d[0].a)
    assert args[8:] == ref_launch[3][8:]
    # k_cache 2 bytes off 16-byte alignment: the scalar-load flag (vec16, argument 19) turns off
    flat = np.empty(d[1].size + 1, np.float16)
    kc = fc.ndarray(flat[1:].reshape(d[1].shape))
    kc.a[...] = d[1].a
    assert kc.data.ptr % 16
    paged.paged_attention(d[0], kc, *d[2:], check=False)
    (_, _, _, args, _), = _launches(kernels)
    assert args[1] is kc and int(args[19]) == 0 and int(ref_launch[3][19]) == 1
    paged.paged_attention(*d, check=False)                              # and the aligned plan is intact
    _same_launches([ref_launch], _launches(kernels), d)


def test_paged_other_device_or_stream_is_another_signature(kernels):
    d = _paged_case()
    paged.paged_attention(*d, check=False)
    _launches(kernels)
    d1 = [fc.ndarray(a.a, 1) for a in d]                               # the same arrays "on GPU 1"
    paged.paged_attention(*d1, check=False)                             # current device 0: full path on 1
    assert [k[0] for k in kernels if kernels[k].calls] == [1]
    _launches(kernels)
    fc.set_device(1)
    paged.paged_attention(*d, check=False)                              # current 1, arrays on 0
    assert [k[0] for k in kernels if kernels[k].calls] == [0]
    _launches(kernels)
    fc.set_device(0)
    fc.set_stream(1234)
    n = len(paged._sigs)
    paged.paged_attention(*d, check=False)
    assert len(paged._sigs) == n + 1


def test_per_thread_default_stream_keeps_plans_and_scratch_per_thread(kernels):
    """CuPy's per-thread default stream has one handle (2) for a different stream in every thread: plans and
    scratch are keyed by the thread too there, so two threads never share split-K partials; an explicit stream
    shared by threads keys by its handle alone."""
    import threading
    d = _paged_case(B=2, lens=(3000, 20), Hq=32, Hkv=8, D=128, bs=16)   # long: split-K partials (scratch)
    fc.set_stream(2)
    keys, bufs = [], []
    both = threading.Barrier(2)  # both threads alive at once (an ended thread's id can be reused)
    turn = threading.Lock()      # the fake CuPy is not thread-safe: one call at a time

    def call():
        both.wait()
        with turn:
            keys.append(_plans.stream_key())
            paged.paged_attention(*d, check=False)
            bufs.append(_plans.scratch("paged_attention partials", 4).data.ptr)
        both.wait()

    n = len(paged._sigs)
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert keys[0] != keys[1] and all(k[0] == 2 for k in keys)
    assert len(paged._sigs) == n + 2 and bufs[0] != bufs[1]
    fc.set_stream(77)
    keys.clear()
    for _ in range(2):
        t = threading.Thread(target=lambda: keys.append(_plans.stream_key()))
        t.start()
        t.join()
    assert keys == [77, 77]
    fc.set_stream(0)


def test_launch_replays_under_a_lock():
    """Two threads replaying one packed launch cannot interleave pointer writes and the launch."""
    assert "lock" in _plans.Launch.__slots__
    import inspect
    src = inspect.getsource(_plans.Launch.__call__)
    assert src.index("with self.lock") < src.index("w[i] = p") < src.index("launchKernel")


def test_paged_retune_invalidates_plans(kernels, monkeypatch):
    calls = []
    real_pick = autotune.pick
    monkeypatch.setattr(autotune, "pick", lambda *a, **k: calls.append(1) or real_pick(*a, **k))
    monkeypatch.setattr(autotune, "_generation", getattr(autotune, "_generation", 0), raising=False)
    d = _paged_case()
    paged.paged_attention(*d, check=False)
    paged.paged_attention(*d, check=False)
    assert len(calls) == 1
    autotune._generation += 1
    paged.paged_attention(*d, check=False)
    assert len(calls) == 2
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "pick", lambda *a, **k: calls.append(1) or autotune.default_config("paged_decode"))
    paged.paged_attention(*d, check=False)
    assert len(calls) == 3


def test_plan_caches_are_bounded(kernels):
    d = _paged_case()
    for i in range(300):
        paged.paged_attention(*d, check=False, softmax_scale=0.1 + i * 1e-3)
    assert 1 <= len(paged._sigs) <= _plans.MAX_PLANS
    x = fc.asgpu(np.ones((4, 64), np.float16))
    for i in range(300):
        fp4.quantize(x, "nvfp4", 1.0 + i)
    assert 1 <= len(fp4._q_plans) <= _plans.MAX_PLANS
    d = _attn_case(Sq=8, Sk=8)
    for i in range(300):
        attention.flash_attention(*d, softmax_scale=0.1 + i * 1e-3)
    assert 1 <= len(attention._fast_plans) <= _plans.MAX_PLANS


def test_paged_numpy_inputs_still_use_the_reference(kernels):
    h = paged.make_case(np.random.default_rng(1), 2, np.asarray([5, 9]), 4, 2, 16, 4, np.float32)
    a = paged.paged_attention(*h)
    b = paged.paged_attention(*h)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, ref.paged_attention(*h))
    assert _launches(kernels) == [] and not paged._sigs


def test_paged_unreachable_left_window_is_unbounded(kernels):
    """window=(2**40, 0) reaches past any sequence (capacity 40 here): launched as unbounded, no OverflowError."""
    d = _paged_case()
    paged.paged_attention(*d, window=(2 ** 40, 0))
    huge = _launches(kernels)
    paged.paged_attention(*d, window=(-1, 0))
    _same_launches(huge, _launches(kernels), d)


def test_fp4_matmul_unhashable_out_dtype_on_the_fast_path(kernels):
    from vbw_cupy import gemm
    w = fp4.quantize(np.ones((24, 40), np.float32), "nvfp4")
    w._cache["gemm_v1_fast"] = {"an earlier call": None}  # what a checked GPU call leaves: the fast path is tried
    a = fc.asgpu(np.ones((3, 40), np.float16))
    with pytest.raises(TypeError, match=r"out_dtype: expected float16, bfloat16 or float32, got \[1\]"):
        gemm.fp4_matmul(a, w, out_dtype=[1])


def _gpu_fp4(N=256, K=512, fmt="nvfp4", scale=1.0):
    h = fp4.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(np.float32), fmt)
    return fp4.FP4Tensor(fc.asgpu(h.data), fc.asgpu(h.scales), h.global_scale * scale, h.format, h.shape)


def test_fp4_matmul_batched_activations_replay_with_a_tensor_map(kernels, monkeypatch):
    # a [2, 64, K] on Hopper takes a plan with a TMA map of a (wgrs, M = 128): its replay encoded the map from the
    # 3-d array and failed ("too many values to unpack") on every call after the first
    from vbw_cupy import gemm
    monkeypatch.setattr(rt, "have_tensor_maps", lambda: True)
    monkeypatch.setattr(rt, "tensor_map", lambda *a, **kw: rt.NO_TENSOR_MAP)
    w = _gpu_fp4()
    a = fc.asgpu(np.ones((2, 64, 512), np.float16))
    o1 = gemm.fp4_matmul(a, w)
    assert gemm.chosen_config(a, w)["KIND"] == "wgrs"
    first = _launches(kernels)
    o2 = gemm.fp4_matmul(a, w)
    second = _launches(kernels)
    assert o1.shape == o2.shape == (2, 64, 256) and len(second) == 1 and first[-1][:3] == second[0][:3]


def test_fp4tensor_copies_have_their_own_derived_layouts(kernels):
    # dataclasses.replace / copy shared the original's cache: the copy replayed its plans (its scale, its
    # re-laid-out weight)
    import copy
    import dataclasses
    from vbw_cupy import gemm
    w = _gpu_fp4(32, 64)
    a = fc.asgpu(np.ones((4, 64), np.float16))
    gemm.fp4_matmul(a, w)
    _launches(kernels)
    for other in (dataclasses.replace(w, global_scale=w.global_scale * 4), copy.copy(w), copy.deepcopy(w)):
        assert other._cache is not w._cache and not other._cache
    gemm.fp4_matmul(a, dataclasses.replace(w, global_scale=w.global_scale * 4))
    got = _launches(kernels)
    gemm.fp4_matmul(a, _gpu_fp4(32, 64, scale=4.0))
    want = _launches(kernels)
    assert [x[3][6:] for x in got] == [x[3][6:] for x in want]   # the scalars, out_scale among them


def test_packed_gemm_launches_go_with_their_weight(kernels, monkeypatch):
    # the packed launches were kept in a module-wide cache holding each plan (and its re-laid-out weight, as
    # large as w): invalidate() or dropping w left that copy on the GPU
    import gc
    import weakref
    from vbw_cupy import gemm

    class Launch:   # (fake kernels have no driver handle: a stand-in for the packed launch)
        def __init__(self, *args):
            pass

        def __call__(self, ptrs, stream):
            pass

    monkeypatch.setattr(_plans, "kernel_ptr", lambda k: 1)
    monkeypatch.setattr(_plans, "Launch", Launch)
    for drop in ("invalidate", "del"):
        w = _gpu_fp4()
        a = fc.asgpu(np.ones((4, 512), np.float16))
        gemm.fp4_matmul(a, w)
        gemm.fp4_matmul(a, w)   # the fast path: packs the launch
        assert w._cache.get("gemm_v1_launches")
        prepared = weakref.ref(w._cache["gemm_v1_sir"][0])
        _launches(kernels)   # (the fake kernels' records hold the arguments too)
        if drop == "invalidate":
            w.invalidate()
        else:
            del w
        gc.collect()
        assert prepared() is None, drop


def test_fp8_attention_from_another_device_is_not_replayed(kernels, monkeypatch):
    # inputs on GPU 0, GPU 1 current: the replay allocated o on GPU 1 and launched on its stream
    import sys
    import types
    from vbw_cupy import attention_fp8 as af
    af._fast_plans.clear()
    monkeypatch.setattr(rt, "have_tensor_maps", lambda: True)
    monkeypatch.setattr(rt, "tensor_map", lambda *a, **kw: rt.NO_TENSOR_MAP)
    monkeypatch.setattr(_plans, "kernel_ptr", lambda k: 1)
    monkeypatch.setattr(_plans.Launch, "__call__", lambda self, p, s: None)
    api = types.ModuleType("cupy_backends.cuda.api")
    api.driver = None
    for n in ("cupy_backends", "cupy_backends.cuda"):
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.api", api)
    rng = np.random.default_rng(0)
    q, k, v = (fc.asgpu(rng.integers(0, 120, (1, 64, 2, 64)).astype(np.uint8), 0) for _ in range(3))
    fc.set_device(1)
    try:
        o1 = af.flash_attention_fp8(q, k, v)
        o2 = af.flash_attention_fp8(q, k, v)
        assert o1.device.id == o2.device.id == 0 and not af._fast_plans
        many = [fc.asgpu(np.ones((1, 1, 65536, 16), np.uint8), 0) for _ in range(3)]
        with pytest.raises(ValueError, match="k: 65536 KV heads, more than the 65535"):
            af.flash_attention_fp8(*many)
    finally:
        fc.set_device(0)
        af._fast_plans.clear()


def test_paged_cache_runs_on_its_own_device(kernels):
    # the cache's methods ran on the caller's current device: kernels fetched and launched there with another
    # device's arrays, and the slot / gather buffers made then stayed on it for the cache's life
    c = paged.PagedKVCache(16, 4, 2, 64, np.float16, max_batch=2, max_blocks_per_seq=4, xp=fc)   # on GPU 0
    kn = fc.asgpu(np.ones((2, 2, 64), np.float16), 0)
    q = fc.asgpu(np.ones((2, 4, 64), np.float16), 0)
    fc.set_device(1)
    try:
        c.append(kn, kn, seqs=[1, 0])
        c.attention(q, seqs=[1, 0])
        assert {dev for (dev, _), k in kernels.items() if k.calls} == {0}
        with pytest.raises(ValueError, match="arrays on different devices: k_cache on GPU 0, k_new on GPU 1"):
            c.append(fc.asgpu(np.ones((2, 2, 64), np.float16), 1), fc.asgpu(np.ones((2, 2, 64), np.float16), 1))
    finally:
        fc.set_device(0)
    c.attention(q, seqs=[1, 0])   # (its buffers are the cache device's: still usable from there)
    big = paged.PagedKVCache(70000, 1, 1, 8, np.float16, max_batch=70000, max_blocks_per_seq=1, xp=fc)
    kn = fc.asgpu(np.ones((70000, 1, 8), np.float16))
    with pytest.raises(ValueError, match="k_new: at most 65535 sequences a call on the GPU, got 70000"):
        big.append(kn, kn)   # (a grid row a sequence: past CUDA's 65535 the launch failed in the driver)
    big.append(kn[:3], kn[:3])


def test_paged_cache_bookkeeping_refused_during_a_capture(kernels, monkeypatch):
    # reserve / free change the host's block lists at once; their device writes would run only at a replay
    c = paged.PagedKVCache(16, 4, 2, 64, np.float16, max_batch=2, max_blocks_per_seq=4, xp=fc)
    c.append(fc.asgpu(np.ones((2, 2, 64), np.float16)), fc.asgpu(np.ones((2, 2, 64), np.float16)))
    monkeypatch.setattr(fc._Stream, "is_capturing", lambda self: True)
    for call, what in ((lambda: c.reserve(4), "reserve"), (lambda: c.free(0), "free")):
        with pytest.raises(RuntimeError, match=f"PagedKVCache.{what}: not while a CUDA graph is being captured"):
            call()
    assert c.lengths().tolist() == [1, 1] and c.num_free_blocks == 14


def test_varlen_errors_name_the_argument(kernels):
    rng = np.random.default_rng(0)
    q = fc.asgpu(rng.standard_normal((10, 2, 64)).astype(np.float16))
    k = fc.asgpu(rng.standard_normal((12, 2, 64)).astype(np.float16))
    cq, ck = np.array([0, 4, 10], np.int32), fc.asgpu(np.array([0, 5, 12], np.int32), 1)   # host q, GPU 1 k
    with pytest.raises(ValueError, match="cu_seqlens_k on GPU 1"):   # (it said cu_seqlens_q)
        attention.flash_attention_varlen(q, k, k, cq, ck)
    cq, ck = fc.asgpu(np.array([0, 4, 10], np.int32)), fc.asgpu(np.array([0, 5, 12], np.int32))
    with pytest.raises(ValueError, match="max_seqlen_q: expected sequence lengths up to"):   # (cu_seqlens_q)
        attention.flash_attention_varlen(q, k, k, cq, ck, max_seqlen_q=2**31, max_seqlen_k=12)


def test_paged_max_seqlen_must_bound_checked_lengths(kernels):
    """Where seq_lens' values are read (check="host", NumPy inputs), a max_seqlen below the longest sequence is
    an error, on the full path and on a replay alike; otherwise it only bounds the split count."""
    d = _paged_case()                                          # room for 40 tokens a sequence
    d[4].a[1] = 30                                             # longest sequence: 30
    paged.paged_attention(*d, max_seqlen=35, check="host")
    _launches(kernels)
    d[4].a[1] = 38                                             # same signature, a sequence past max_seqlen
    with pytest.raises(ValueError, match="max_seqlen: 35 is below the longest sequence in seq_lens \\(38\\)"):
        paged.paged_attention(*d, max_seqlen=35, check="host")
    paged._sigs.clear()
    with pytest.raises(ValueError, match="max_seqlen: 35 is below"):
        paged.paged_attention(*d, max_seqlen=35, check="host")
    assert _launches(kernels) == []
    paged.paged_attention(*d, max_seqlen=35)                   # not read (check="device"): launches
    assert _launches(kernels)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_seqlen: expected a positive int"):
            paged.paged_attention(*d, max_seqlen=bad)
    h = paged.make_case(np.random.default_rng(1), 2, np.asarray([5, 9]), 4, 2, 16, 4, np.float32)
    with pytest.raises(ValueError, match="max_seqlen: 8 is below"):
        paged.paged_attention(*h, max_seqlen=8)
    np.testing.assert_array_equal(paged.paged_attention(*h, max_seqlen=9), ref.paged_attention(*h))


def test_check_paged_values_matches_check_paged_args():
    h = paged.make_case(np.random.default_rng(2), 3, np.asarray([5, 40, 17]), 8, 2, 16, 4, np.float16)
    s = _checks.check_paged_args(*h)
    table, lens = _checks.check_paged_values(h[3], h[4], s.num_blocks, s.block_size)
    np.testing.assert_array_equal(table, s.block_table)
    np.testing.assert_array_equal(lens, s.seq_lens)
    bad = h[3].copy()
    bad[2, 4] = -1
    for fn in (lambda: _checks.check_paged_args(h[0], h[1], h[2], bad, h[4]),
               lambda: _checks.check_paged_values(bad, h[4], s.num_blocks, s.block_size)):
        with pytest.raises(ValueError, match=r"block_table: .* got -1 at \[2, 4\]"):
            fn()


# ------------------------------------------------------------------------------------------ flash_attention
def _attn_case(B=2, Sq=100, Sk=130, Hq=4, Hkv=2, D=64, device=0):
    rng = np.random.default_rng(0)
    return [fc.asgpu(rng.standard_normal((B, S, H, D)).astype(np.float16), device)
            for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv))]


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, return_lse=True),
                                dict(window=(10, 0), softcap=30.0, softmax_scale=0.2)])
def test_flash_second_call_replays_the_first(kernels, kw):
    d = _attn_case()
    r1 = attention.flash_attention(*d, **kw)
    first = _launches(kernels)
    assert full_calls == ["_flash_gpu"] and len(attention._fast_plans) == 1 and len(first) == 1
    r2 = attention.flash_attention(*d, **kw)
    assert full_calls == ["_flash_gpu"]  # served by the plan
    _same_launches(first, _launches(kernels), d)
    if kw.get("return_lse"):
        (o1, l1), (o2, l2) = r1, r2
        assert l2 is not l1 and l2.shape == l1.shape == (2, 4, 100) and l2.dtype == np.float32
    else:
        o1, o2 = r1, r2
    assert o2 is not o1 and o2.shape == o1.shape and o2.dtype == o1.dtype


def test_zero_d_array_options_launch_as_their_scalars(kernels):
    # softmax_scale / softcap as 0-d NumPy arrays (as global_scale takes them): the launch of the Python floats
    d = _attn_case()
    attention.flash_attention(*d, softmax_scale=0.2, softcap=30.0)
    want = _launches(kernels)
    attention.flash_attention(*d, softmax_scale=np.array(0.2), softcap=np.float64(30.0))
    got = _launches(kernels)
    assert [g[4] for g in got] and [len(g[3]) for g in got] == [len(w[3]) for w in want]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for g, w in zip(got, want)
               for x, y in zip(g[3][7:], w[3][7:]) if isinstance(x, (np.generic, int, float)))
    p = _paged_case()
    paged.paged_attention(*p, softmax_scale=0.3, check=False)
    want = _launches(kernels)
    paged.paged_attention(*p, softmax_scale=np.array(0.3), check=False)
    got = _launches(kernels)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for g, w in zip(got, want)
               for x, y in zip(g[3], w[3]) if isinstance(x, (np.generic, int, float)))


def test_flash_plan_made_during_a_capture_is_not_kept(kernels, monkeypatch):
    """A first call made while a graph is being captured is not stored as the fast plan (its persistent tile
    would lack the balanced schedule, which is not built during a capture, and keep replaying without it); the
    first call after the capture takes the full path and stores its plan."""
    attention.flash_attention(*_attn_case(Sq=7))   # the device's first call (not allowed during a capture)
    full_calls.clear()
    d = _attn_case()
    capturing = {"on": True}
    monkeypatch.setattr(fc._Stream, "is_capturing", lambda self: capturing["on"])
    attention.flash_attention(*d)
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"] * 2 and len(attention._fast_plans) == 1   # (the first call's)
    capturing["on"] = False
    attention.flash_attention(*d)
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"] * 3 and len(attention._fast_plans) == 2


def test_flash_ab_switches_are_plan_variants(kernels, monkeypatch):
    """Flipping an A/B switch (attention._EXTRA_OPTIONS here) builds a new plan instead of replaying the old."""
    d = _attn_case()
    attention.flash_attention(*d)
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"]
    monkeypatch.setattr(attention, "_EXTRA_OPTIONS", {64: ("-DVBW_AB_PROBE",)})
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu", "_flash_gpu"] and len(attention._fast_plans) == 2
    monkeypatch.setattr(attention, "_EXTRA_OPTIONS", ())
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu", "_flash_gpu"]  # the first plan again


def test_a_tuning_store_replans_only_its_own_op(kernels, monkeypatch, tmp_path):
    """Plan keys hold autotune.generation(family): a store for paged decode's or fp4_matmul's Tunables leaves
    flash_attention's plan in use (every op used to replan after any store); a store for an attention head
    dim's Tunable (the family "attention_fwd"), or autotune.reset(), replans it."""
    monkeypatch.setattr(autotune, "_generations", {})
    monkeypatch.setattr(autotune, "_memory", {})
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path))
    d = _attn_case()   # D = 64
    attention.flash_attention(*d)
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"]
    for other in ("paged_decode", gemm._TUNABLES[0][1].name):
        autotune._store(f"{other}|key", {"config": {}, "ms": 1.0}, other)
        attention.flash_attention(*d)
        assert full_calls == ["_flash_gpu"], other
    autotune._store("attention_fwd_d128|key", {"config": {}, "ms": 1.0}, attention._tunable_name(128))
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"] * 2
    monkeypatch.setattr(autotune, "_generation", autotune._generation + 1)   # reset() / register()
    attention.flash_attention(*d)
    assert full_calls == ["_flash_gpu"] * 3


def test_store_bumps_only_its_tunable_and_forgets_only_its_picks(monkeypatch, tmp_path):
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_generations", {"a": 3})
    monkeypatch.setattr(autotune, "_memory", {})
    monkeypatch.setattr(autotune, "_picked", {("a", 0, "f16", (), False): {"X": 1}, ("b", 0, "f16", (), False): {}})
    g = autotune.generation("b")
    autotune._store("b|key", {"config": {"X": 2}, "ms": 1.0}, "b")
    assert autotune.generation("a") == (autotune._generation, 3) and autotune.generation("b") == (g[0], 1)
    assert list(autotune._picked) == [("a", 0, "f16", (), False)]


@pytest.mark.parametrize("good, bad", [
    (dict(window=(1, 0)), dict(window=(True, 0))),
    (dict(window=(1, 0)), dict(window=(1.0, 0))),
    (dict(window=(0, 0)), dict(window=(False, False))),
    (dict(window=(-1, -1)), dict(window=[-1, -1, 0])),
    (dict(causal=True), dict(causal=1)),
    (dict(return_lse=False), dict(return_lse=0)),
    (dict(softmax_scale=1.0), dict(softmax_scale=True)),
    (dict(softcap=1.0), dict(softcap=True)),
])
def test_flash_option_types_are_part_of_the_signature(kernels, good, bad):
    d = _attn_case()
    attention.flash_attention(*d, **good)
    attention.flash_attention(*d, **good)
    _launches(kernels)
    with pytest.raises(TypeError):
        attention.flash_attention(*d, **bad)
    assert _launches(kernels) == []


def test_flash_views_and_misalignment_take_the_full_path(kernels):
    d = _attn_case()
    attention.flash_attention(*d)
    (name, _, _, args, _), = _launches(kernels)
    # k of the same shape but strided: the full path launches on a contiguous copy
    kv = fc.ndarray(np.repeat(d[1].a, 2, axis=3))[..., ::2]
    assert kv.shape == d[1].shape and not kv.flags.c_contiguous
    attention.flash_attention(d[0], kv, d[2])
    (name2, _, _, args2, _), = _launches(kernels)
    assert args2[1] is not kv and args2[1].flags.c_contiguous and name2 == name
    # q 2 bytes off 16-byte alignment: the element-wise (VEC = false) mma.sync kernel
    flat = np.empty(d[0].size + 1, np.float16)
    qm = fc.ndarray(flat[1:].reshape(d[0].shape))
    qm.a[...] = d[0].a
    assert qm.data.ptr % 16
    attention.flash_attention(qm, *d[1:])
    (name3, _, _, args3, _), = _launches(kernels)
    assert args3[0] is qm and name3.startswith("attn_fwd<") and name3.endswith("false>")
    assert full_calls == ["_flash_gpu"] * 3


# ------------------------------------------------------------------------------------------------ quantize
@pytest.mark.parametrize("fmt, gs", [("mxfp4", None), ("nvfp4", 0.01), ("nvfp4", np.float32(2.0)), ("nvfp4", 3)])
@pytest.mark.parametrize("shape", [(64, 256), (3, 100), (2, 3, 48)])
def test_quantize_second_call_replays_the_first(kernels, fmt, gs, shape):
    x = fc.asgpu(np.random.default_rng(0).standard_normal(shape).astype(np.float16))
    t1 = fp4.quantize(x, fmt, gs)
    first = _launches(kernels)
    assert len(fp4._q_plans) == 1
    t2 = fp4.quantize(x, fmt, gs)
    assert full_calls == ["_quantize_gpu"]  # the second call was served by the plan
    _same_launches(first, _launches(kernels), [x])
    for t in (t1, t2):
        assert type(t) is fp4.FP4Tensor and t.shape == shape and t.format == fmt
        assert type(t.global_scale) is np.float32 and t.global_scale == (1.0 if gs is None else np.float32(gs))
        assert t.data.shape == t1.data.shape and t.scales.shape == t1.scales.shape and t._cache == {}
    assert t2.data is not t1.data and t2._cache is not t1._cache


def test_quantize_nvfp4_without_global_scale_is_never_replayed(kernels):
    x = fc.asgpu(np.ones((4, 64), np.float32))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(fp4, "_global_scale_gpu", lambda x: np.float32(0.5))
    try:
        fp4.quantize(x, "nvfp4")
        fp4.quantize(x, "nvfp4")
    finally:
        monkey.undo()
    assert not fp4._q_plans


@pytest.mark.parametrize("good, bad, exc, match", [
    (("mxfp4", None), ("mxfp4", 0.5), ValueError, "global_scale"),
    (("nvfp4", 1.0), ("nvfp4", float("nan")), ValueError, "global_scale"),
    (("nvfp4", 1.0), ("nvfp4", -1.0), ValueError, "global_scale"),
    (("nvfp4", 1.0), ("nvfp4", [1.0]), TypeError, "global_scale"),
    (("nvfp4", 1.0), (["nvfp4"], 1.0), ValueError, "format"),
    (("mxfp4", None), ("MXFP4", None), ValueError, "format"),
])
def test_quantize_bad_arguments_still_raise_after_a_good_call(kernels, good, bad, exc, match):
    x = fc.asgpu(np.ones((4, 64), np.float16))
    fp4.quantize(x, *good)
    fp4.quantize(x, *good)
    _launches(kernels)
    with pytest.raises(exc, match=match):
        fp4.quantize(x, *bad)
    assert _launches(kernels) == []


def test_quantize_views_misalignment_and_devices(kernels):
    x = fc.asgpu(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float16))
    fp4.quantize(x, "mxfp4")
    (_, grid, block, args, _), = _launches(kernels)
    # strided view of the same shape and dtype: quantized from a dense copy
    xv = fc.ndarray(np.repeat(x.a, 2, axis=1))[:, ::2]
    fp4.quantize(xv, "mxfp4")
    (_, g2, _, a2, _), = _launches(kernels)
    assert a2[0] is not xv and a2[0].flags.c_contiguous and np.array_equal(a2[0].a, x.a) and g2 == grid
    # 2 bytes off 16-byte alignment: an aligned copy
    flat = np.empty(x.size + 1, np.float16)
    xm = fc.ndarray(flat[1:].reshape(x.shape))
    xm.a[...] = x.a
    assert xm.data.ptr % 16
    fp4.quantize(xm, "mxfp4")
    (_, _, _, a3, _), = _launches(kernels)
    assert a3[0] is not xm and a3[0].data.ptr % 16 == 0
    # on another device than the current one: the full path, on that device's kernel
    t = fp4.quantize(fc.ndarray(x.a, 1), "mxfp4")
    assert [k[0] for k in kernels if kernels[k].calls] == [1] and t.data.device.id == 1
    # dtype and empty input still refused
    for bad, exc in ((fc.asgpu(np.ones((8, 64), np.int32)), TypeError), (fc.asgpu(np.ones((0, 64), np.float16)),
                                                                           ValueError)):
        with pytest.raises(exc, match="x"):
            fp4.quantize(bad, "mxfp4")


def test_quantize_numpy_dtype_check_keeps_other_byte_orders():
    x = np.array([[0.3, -1.2, 5.0, 6.5]], dtype=">f4")
    t = fp4.quantize(x, "mxfp4")
    np.testing.assert_array_equal(fp4.dequantize(t), [[0.5, -1.0, 4.0, 6.0]])
    with pytest.raises(TypeError, match="x: expected dtype"):
        fp4.quantize(np.ones((2, 4), np.float64), "mxfp4")


# -------------------------------------------------------------------------------------------- FP4Tensor
@pytest.mark.parametrize("fmt, K", [("mxfp4", 64), ("nvfp4", 40), ("nvfp4", 1)])
def test_trusted_fp4tensor_equals_the_checked_one(fmt, K):
    t = fp4.quantize(np.random.default_rng(3).standard_normal((5, K)).astype(np.float32), fmt)
    u = fp4.FP4Tensor._trusted(t.data, t.scales, t.global_scale, t.format, t.shape)
    v = fp4.FP4Tensor(t.data, t.scales, t.global_scale, t.format, t.shape)
    for f in dataclasses.fields(fp4.FP4Tensor):
        a, b = getattr(u, f.name), getattr(v, f.name)
        assert type(a) is type(b) and (a is b or a == b), f.name
    assert repr(u) == repr(v) and u.block_size == v.block_size and u.nbytes == v.nbytes and not u.is_gpu
    assert u._cache == {} and u._cache is not fp4.FP4Tensor._trusted(t.data, t.scales, t.global_scale, t.format,
                                                                     t.shape)._cache
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.format = "mxfp4"
    np.testing.assert_array_equal(fp4.dequantize(u), fp4.dequantize(v))
    c = u.to_cpu()
    assert c.data is u.data and c.global_scale == u.global_scale


def test_user_built_fp4tensor_is_still_checked():
    with pytest.raises(TypeError, match="global_scale"):
        fp4.FP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), True, "nvfp4", (2, 16))
    with pytest.raises(ValueError, match="data"):
        fp4.FP4Tensor(np.zeros((2, 7), np.uint8), np.zeros((2, 1), np.uint8), 1.0, "nvfp4", (2, 16))
    t = fp4.FP4Tensor(np.zeros((4, 8), np.uint8)[::2], np.zeros((2, 1), np.uint8), 1, "nvfp4", [2, 16])
    assert t.data.flags.c_contiguous and t.shape == (2, 16) and type(t.global_scale) is np.float32


def test_ctype_memo():
    import ml_dtypes
    for dt, name in ((np.float16, "__half"), (np.dtype(np.float16), "__half"), ("float32", "float"),
                     (np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16"), (np.dtype(">f2"), "__half")):
        assert rt.ctype(dt) == name and rt.ctype(dt) == name
    for _ in range(2):
        with pytest.raises(TypeError, match="no CUDA type"):
            rt.ctype(np.int32)


@pytest.mark.parametrize("driver,want", [(12020, False), (12030, True), (13000, True)])
def test_programmatic_launches_need_a_cuda_12_3_driver(monkeypatch, driver, want):
    """Older drivers cannot capture programmatic launches into a graph: the model's capture stays plain there."""
    monkeypatch.setattr(rt, "_driver_version", lambda: driver)
    monkeypatch.setattr(rt, "_launch_kernel_ex", lambda: ("fn", "Config", "Attr"))
    rt._pdl_driver_ok.cache_clear()
    try:
        assert not rt.pdl_enabled()
        with rt.programmatic_launches():
            assert rt.pdl_enabled() is want
        assert not rt.pdl_enabled()
    finally:
        rt._pdl_driver_ok.cache_clear()


def test_scratch_keeps_replaced_buffers_only_where_a_capture_may_use_them(kernels, monkeypatch):
    """A replaced scratch buffer stays alive for the process when a captured graph may hold its address: always
    for buffers whose address plans keep, and for per-call buffers once one was handed out during a capture;
    a per-call buffer no capture has seen goes back to the pool."""
    monkeypatch.setattr(_plans, "_scratch", {})
    monkeypatch.setattr(_plans, "_retired", [])
    monkeypatch.setattr(_plans, "_captured", set())
    capturing = {"on": False}
    monkeypatch.setattr(fc._Stream, "is_capturing", lambda self: capturing["on"])
    small = _plans.scratch("staged", 100, per_call=True)
    assert _plans.scratch("staged", 100, per_call=True) is small           # reused while it is large enough
    _plans.scratch("staged", 1 << 20, per_call=True)                       # grows: no capture saw it
    assert _plans._retired == []
    capturing["on"] = True
    big = _plans.scratch("staged", 100, per_call=True)                     # handed out during a capture
    capturing["on"] = False
    _plans.scratch("staged", 1 << 22, per_call=True)
    assert len(_plans._retired) == 1 and _plans._retired[0] is big         # a graph may still use it
    planned = _plans.scratch("partials", 100)
    _plans.scratch("partials", 1 << 20)
    assert _plans._retired[-1] is planned                                  # plans keep addresses: always kept
    capturing["on"] = True
    with pytest.raises(RuntimeError, match="make the same call once before capturing"):
        _plans.scratch("staged", 1 << 24, per_call=True)


def test_persistent_schedule_kept_and_bounded(kernels, monkeypatch):
    """The persistent tile's schedule is made once a signature and never dropped (a captured graph holds its
    address); none is made while a graph is being captured or past _SCHEDULE_BYTES: the kernel then walks its
    static rounds (rt.NULL)."""
    monkeypatch.setattr(attention, "_schedules", {})
    monkeypatch.setattr(attention, "_schedule_bytes", [0])
    q = fc.asgpu(np.zeros((2, 300, 4, 128), np.float16))
    launch = attention._Launch.dense(q, q, q, scale=0.1, window=(-1, 0), softcap=0.0, out=q, lse=None)
    cfg = attention._wsp(128)
    s = launch.schedule(3, cfg, 5)
    assert isinstance(s, fc.ndarray) and s.shape == (-(-3 * 8 // 5) + 1, 5) and s.dtype == np.int32
    assert launch.schedule(3, cfg, 5) is s                       # one a signature, reused
    np.testing.assert_array_equal(s.get(), attention._persistent_schedule(3, 8, launch.sect_heads, 300, 300, -1, 0,
                                                                          128, 128, 5))
    monkeypatch.setattr(attention, "_SCHEDULE_BYTES", attention._schedule_bytes[0])
    assert launch.schedule(3, cfg, 7) is rt.NULL                 # a new signature past the bound
    assert launch.schedule(3, cfg, 5) is s                       # made ones stay
    monkeypatch.setattr(attention, "_SCHEDULE_BYTES", 1 << 30)
    dec = fc.asgpu(np.zeros((2, 1, 4, 128), np.float16))        # a decode step: every tile alike
    kv = fc.asgpu(np.zeros((2, 300, 4, 128), np.float16))
    plans = []
    monkeypatch.setattr(attention, "_persistent_schedule", lambda *a, _p=attention._persistent_schedule:
                        plans.append(a) or _p(*a))
    step = attention._Launch.dense(dec, kv, kv, scale=0.1, window=(-1, 0), softcap=0.0, out=dec, lse=None)
    assert step.schedule(1, cfg, 5) is rt.NULL and step.schedule(1, cfg, 5) is rt.NULL
    assert len(plans) == 1                                        # planned once, the answer remembered
    monkeypatch.setattr(fc._Stream, "is_capturing", lambda self: True)
    assert launch.schedule(3, cfg, 9) is rt.NULL                 # none made during a capture


def test_tensor_map_cache_drops_the_least_recently_used(monkeypatch):
    """rt.tensor_map's cache is bounded and least recently used out (it forgot every map at once when full): a
    map in use stays cached while new ones come and go; the driver is asked once a map."""
    encoded = []

    def encoder(out, dtype, rank, ptr, *rest):
        encoded.append(ptr)
        return 0
    monkeypatch.setattr(rt, "_tensor_map_encoder", lambda: encoder)
    monkeypatch.setattr(rt, "_tmap_cache", rt.PlanCache(4))

    def get(ptr):
        return rt.tensor_map(ptr, (64, 8), (128,), (64, 8))
    hot = get(1 << 20)
    for i in range(20):
        assert get(1 << 20) is hot          # used between the others: never dropped, never encoded again
        get((2 + i) << 20)
    assert encoded.count(1 << 20) == 1 and len(rt._tmap_cache) == 4
    get(2 << 20)                             # dropped long ago: encoded again
    assert encoded.count(2 << 20) == 2
