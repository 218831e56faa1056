"""The attention peer of selftest and bench_attention (vbw_cupy._peers): which one is chosen, with the optional
packages (cudnn-frontend, torch) mocked, so no GPU, cuDNN or torch is needed."""
import io
import types

import numpy as np
import pytest

from vbw_cupy import _peers, cli
from vbw_cupy import _runtime as rt


class _Arr:
    """Just the .shape / .dtype the builders read."""

    def __init__(self, shape, dtype=np.float16):
        self.shape, self.dtype = shape, np.dtype(dtype)


Q, KV = _Arr((2, 128, 8, 64)), _Arr((2, 128, 2, 64))


def _fake_imports(monkeypatch, **mods):
    """_peers._import returns mods[name] (None: not installed)."""
    monkeypatch.setattr(_peers, "_import", lambda name: mods.get(name))


def _torch(cuda=True):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: cuda))


def _stub_builders(monkeypatch, ok=("cudnn", "torch", "naive"), calls=None):
    calls = [] if calls is None else calls

    def make(kind, result):
        def build(q, k, v, causal, scale):
            calls.append(kind)
            if kind not in ok:
                return None
            return result
        return build
    monkeypatch.setattr(_peers, "cudnn_sdpa", make("cudnn", lambda: "cudnn out"))
    monkeypatch.setattr(_peers, "torch_sdpa", make("torch", ("torch module", lambda: "torch out")))
    monkeypatch.setattr(_peers, "_naive", make("naive", lambda: "naive out"))
    return calls


def test_available_kinds_prefers_cudnn_then_torch(monkeypatch):
    _fake_imports(monkeypatch, cudnn=object(), torch=_torch())
    assert _peers.available_kinds() == ("cudnn", "torch")
    _fake_imports(monkeypatch, torch=_torch())
    assert _peers.available_kinds() == ("torch",)
    _fake_imports(monkeypatch, cudnn=object())
    assert _peers.available_kinds() == ("cudnn",)


def test_available_kinds_falls_back_to_naive(monkeypatch):
    _fake_imports(monkeypatch)
    assert _peers.available_kinds() == ("naive",)
    _fake_imports(monkeypatch, torch=_torch(cuda=False))  # a CPU-only torch is no peer
    assert _peers.available_kinds() == ("naive",)


def test_import_guard_swallows_broken_packages(monkeypatch):
    def boom(name):
        raise OSError(f"{name}: libcudnn.so.9 not found")
    monkeypatch.setattr(_peers.importlib, "import_module", boom)
    assert _peers._import("cudnn") is None
    assert _peers.available_kinds() == ("naive",)


def test_attention_peer_order(monkeypatch):
    calls = _stub_builders(monkeypatch)
    p = _peers.attention_peer(Q, KV, KV, True, 0.125)
    assert (p.kind, p.label, p.naive) == ("cudnn", _peers.CUDNN, False) and p.run() == "cudnn out"
    assert calls == ["cudnn"]

    calls = _stub_builders(monkeypatch, ok=("torch", "naive"))
    p = _peers.attention_peer(Q, KV, KV, True, 0.125)
    assert (p.kind, p.label, p.torch) == ("torch", _peers.TORCH, "torch module") and p.run() == "torch out"
    assert calls == ["cudnn", "torch"]

    calls = _stub_builders(monkeypatch, ok=("naive",))
    p = _peers.attention_peer(Q, KV, KV, True, 0.125)
    assert (p.kind, p.label, p.naive) == ("naive", _peers.NAIVE, True) and p.run() == "naive out"
    assert "not a tuned kernel" in p.label and calls == ["cudnn", "torch", "naive"]

    _stub_builders(monkeypatch, ok=())
    assert _peers.attention_peer(Q, KV, KV, True, 0.125) is None


def test_a_failing_peer_is_skipped(monkeypatch):
    _stub_builders(monkeypatch)
    rt.forget_warnings()

    def cudnn_fails(*a):
        raise RuntimeError("cudnnGraphNotSupportedError: no engine for this shape")
    monkeypatch.setattr(_peers, "cudnn_sdpa", cudnn_fails)
    with pytest.warns(RuntimeWarning, match="cuDNN SDPA.*no engine for this shape"):
        assert _peers.attention_peer(Q, KV, KV, False, 0.125).kind == "torch"
    assert _peers.attention_peer(Q, KV, KV, False, 0.125, kinds=("cudnn",)) is None
    with pytest.raises(ValueError, match="kind"):
        _peers.attention_peer(Q, KV, KV, False, 0.125, kinds=("tvm",))


def test_builders_return_none_without_their_package(monkeypatch):
    _fake_imports(monkeypatch)
    assert _peers.cudnn_sdpa(Q, KV, KV, True, 0.125) is None
    assert _peers.torch_sdpa(Q, KV, KV, True, 0.125) is None
    _fake_imports(monkeypatch, torch=_torch(cuda=False))
    assert _peers.torch_sdpa(Q, KV, KV, True, 0.125) is None


def test_naive_peer_declines_scores_that_do_not_fit():
    big = _Arr((32, 16384, 16, 128))
    assert _peers._naive(big, big, big, False, 0.1) is None
    assert _peers._naive(Q, KV, KV, False, 0.1) is not None


class _FakeTensor:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def set_output(self, flag):
        self.log.append(("set_output", self.name, flag))
        return self

    def set_dim(self, dim):
        self.log.append(("set_dim", self.name, list(dim)))
        return self

    def set_stride(self, stride):
        self.log.append(("set_stride", self.name, list(stride)))
        return self


def _fake_cudnn(log, new_sdpa=True):
    """The slice of cudnn-frontend's Python graph API that cudnn_sdpa uses (samples/python/50_sdpa_forward)."""
    dt = types.SimpleNamespace(HALF="HALF", BFLOAT16="BFLOAT16", FLOAT="FLOAT")

    class Graph:
        def __init__(self, **kw):
            log.append(("pygraph", kw))

        def tensor(self, name, dim, stride, data_type):
            log.append(("tensor", name, dim, stride, data_type))
            return _FakeTensor(log, name)

        def sdpa(self, name, q, k, v, attn_scale, generate_stats=None, is_inference=None, **mask):
            if new_sdpa and is_inference is not None or not new_sdpa and generate_stats is not None:
                raise TypeError("sdpa(): incompatible function arguments")
            log.append(("sdpa", q.name, k.name, v.name, attn_scale, generate_stats, is_inference, mask))
            return _FakeTensor(log, "o"), None

        def __getattr__(self, step):  # validate, build_operation_graph, ... : record the call
            if step == "get_workspace_size":
                return lambda: 4096
            return lambda *a, **kw: log.append((step,) + a + tuple(kw.items()))

    return types.SimpleNamespace(data_type=dt, pygraph=Graph, create_handle=lambda: "handle",
                                 set_stream=lambda h, s: log.append(("set_stream", h, s)),
                                 heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"))


def _fake_cp(log):
    stream = types.SimpleNamespace(ptr=1234, synchronize=lambda: log.append(("sync",)))
    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0), get_current_stream=lambda: stream),
        uint8=np.uint8, empty=lambda n, dtype: ("workspace", n), empty_like=lambda a: "out")


@pytest.mark.parametrize("new_sdpa", [True, False])
def test_cudnn_graph_follows_the_frontend_samples(monkeypatch, new_sdpa):
    log = []
    _fake_imports(monkeypatch, cudnn=_fake_cudnn(log, new_sdpa))
    monkeypatch.setattr(rt, "require_cupy", lambda: _fake_cp(log))
    monkeypatch.setattr(_peers, "_cudnn_handles", {})
    B, S, Hq, Hkv, D = 2, 128, 8, 2, 64
    run = _peers.cudnn_sdpa(_Arr((B, S, Hq, D)), _Arr((B, S, Hkv, D)), _Arr((B, S, Hkv, D)), True, 0.125)
    assert run is not None
    assert ("set_stream", "handle", 1234) in log
    assert ("tensor", "q", [B, Hq, S, D], [S * Hq * D, D, Hq * D, 1], "HALF") in log  # BSHD memory, BHSD dims
    assert ("tensor", "k", [B, Hkv, S, D], [S * Hkv * D, D, Hkv * D, 1], "HALF") in log
    sd = [e for e in log if e[0] == "sdpa"][0]
    assert sd[1:5] == ("q", "k", "v", 0.125) and sd[7] == {"use_causal_mask": True}
    assert (sd[5], sd[6]) == ((False, None) if new_sdpa else (None, True))  # no softmax stats either way
    assert ("set_output", "o", True) in log and ("set_dim", "o", [B, Hq, S, D]) in log
    steps = [e[0] for e in log]
    order = ["validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans",
             "execute", "sync"]
    assert [s for s in steps if s in order] == order  # built, then run once and synchronized
    assert ("create_execution_plans", ["A", "FALLBACK"]) in log
    ex = [e for e in log if e[0] == "execute"][0]
    pack = ex[1]
    assert sorted(t.name for t in pack) == ["k", "o", "q", "v"] and ex[2] == ("workspace", 4096)
    assert ex[3] == ("handle", "handle")
    assert run() == "out"


def test_cudnn_causal_with_sq_ne_sk_is_bottom_right(monkeypatch):
    log = []
    _fake_imports(monkeypatch, cudnn=_fake_cudnn(log))
    monkeypatch.setattr(rt, "require_cupy", lambda: _fake_cp(log))
    monkeypatch.setattr(_peers, "_cudnn_handles", {})
    _peers.cudnn_sdpa(_Arr((1, 100, 4, 64)), _Arr((1, 300, 4, 64)), _Arr((1, 300, 4, 64)), True, 0.125)
    assert [e for e in log if e[0] == "sdpa"][0][7] == {"use_causal_mask_bottom_right": True}


def test_cudnn_declines_other_dtypes(monkeypatch):
    _fake_imports(monkeypatch, cudnn=_fake_cudnn([]))
    monkeypatch.setattr(rt, "require_cupy", lambda: _fake_cp([]))
    f32 = _Arr((1, 64, 4, 64), np.float32)
    assert _peers.cudnn_sdpa(f32, f32, f32, False, 0.125) is None


def test_selftest_table_marks_a_naive_ratio():
    rows = [{"op": "flash_attention", "shape": "s", "error": 1e-4, "bound": 1e-3, "ok": True, "time_ms": 1.0,
             "peer": _peers.NAIVE, "peer_ms": 25.0, "peer_naive": True},
            {"op": "flash_attention", "shape": "s", "error": 1e-4, "bound": 1e-3, "ok": True, "time_ms": 1.0,
             "peer": _peers.CUDNN, "peer_ms": 0.9}]
    out = io.StringIO()
    cli.print_table(rows, out=out)
    text = out.getvalue()
    assert "naive CuPy (not a tuned kernel)" in text and "(25.00x)" in text
    assert " 0.90x" in text and "(0.90x)" not in text
    assert "no performance claim" in text
    out = io.StringIO()
    cli.print_table(rows[1:], out=out)
    assert "no performance claim" not in out.getvalue()


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind", _peers.KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_peer_agrees_with_flash_attention(kind, causal, dtype):
    """Each importable peer computes the same attention as flash_attention (grouped-query, Sq == Sk); a peer
    whose package is missing is skipped."""
    cp = pytest.importorskip("cupy")
    import ml_dtypes
    from vbw_cupy import attention as A
    if kind != "naive" and kind not in _peers.available_kinds():
        pytest.skip(f"{_peers.LABELS[kind]}: package not importable here")
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(7)
    q = cp.asarray(rng.standard_normal((2, 203, 8, 64)).astype(dt))
    k, v = (cp.asarray(rng.standard_normal((2, 203, 2, 64)).astype(dt)) for _ in range(2))
    p = _peers.attention_peer(q, k, v, causal, 0.125, kinds=(kind,))
    assert p is not None and p.kind == kind
    out = p.run()
    if kind == "torch":
        out = cp.from_dlpack(out.transpose(1, 2).contiguous())
    ours = A.flash_attention(q, k, v, causal=causal, softmax_scale=0.125)
    err = float(cp.linalg.norm(out.astype(cp.float32) - ours.astype(cp.float32)) /
                cp.linalg.norm(ours.astype(cp.float32)))
    assert err < (4e-3 if dtype == "float16" else 2e-2), err
    assert p.time_ms(warmup=1, rep=2) > 0
