"""Peers of the attention kernel: what `vbw-cupy selftest` and bench/bench_attention.py time flash_attention
against, chosen by what is importable here, in this order (`attention_peer`):

1. cuDNN's SDPA through the nvidia-cudnn-frontend package (``pip install vbw_cupy[cudnn]``): its Python graph API
   takes DLPack arrays, so CuPy arrays go in directly and no torch is needed. Label `CUDNN`.
2. torch's ``scaled_dot_product_attention`` where torch with CUDA is importable (torch picks its backend: FLASH,
   cuDNN or memory-efficient). Label `TORCH`.
3. A CuPy matmul-softmax-matmul (fp32 scores, the S x S matrix materialized). Label `NAIVE`: it is not a tuned
   kernel, and a ratio against it says nothing about how fast flash_attention is.

Each builder returns a ready callable (built, run once, synchronized) or None when its library is missing or
turns the shape down; every import is guarded, so a missing or broken optional package costs nothing but its
row. Inputs: q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D], CuPy, float16 / bfloat16, contiguous; causal is aligned at
the bottom right (query i sees keys j <= i + Sk - Sq), as flash_attention's.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Callable

import numpy as np

from . import _runtime as rt
from . import _timing

log = logging.getLogger(__name__)

CUDNN = "cuDNN SDPA (cudnn-frontend)"
TORCH = "torch SDPA"
NAIVE = "naive CuPy (not a tuned kernel)"
KINDS = ("cudnn", "torch", "naive")  # the order of preference
LABELS = {"cudnn": CUDNN, "torch": TORCH, "naive": NAIVE}


def _import(name: str):
    """importlib.import_module, or None when the package is missing or fails to import (tests replace this)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - an optional package that is broken is as good as absent
        log.debug("vbw_cupy peers: cannot import %s (%s)", name, e)
        return None


@dataclasses.dataclass
class Peer:
    """A peer ready to time: kind ("cudnn" / "torch" / "naive"), its printed label, and run() (one call on the
    arrays it was built for, enqueued on the current stream)."""
    kind: str
    label: str
    run: Callable[[], object]
    torch: object = None  # the torch module for a torch peer: timed with torch's events on torch's stream

    @property
    def naive(self) -> bool:
        return self.kind == "naive"

    def time_ms(self, warmup: int = 3, rep: int = 10) -> float:
        """Median ms of run(), CUDA events on the stream the peer runs on."""
        if self.torch is None:
            return _timing.time_ms(self.run, warmup=warmup, rep=rep)
        torch = self.torch
        for _ in range(warmup):
            self.run()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(rep):
            start.record()
            self.run()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return float(np.median(times))


# ---------------------------------------------------------------------------------------------- cuDNN
_cudnn_handles: dict = {}


def _cudnn_data_type(cudnn, dtype):
    name = np.dtype(dtype).name
    return {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}.get(name)


def cudnn_sdpa(q, k, v, causal: bool, scale: float):
    """cuDNN's fused SDPA forward (inference: no softmax stats) as a callable returning o [B, Sq, Hq, D], or None.

    Graph API as in cudnn-frontend's samples/python/50_sdpa_forward: tensors in BHSD logical order with the
    strides of our BSHD arrays, sdpa(..., attn_scale, causal mask), validate / build_operation_graph /
    create_execution_plans([heur_mode.A, heur_mode.FALLBACK]) / check_support / build_plans, then
    execute({tensor: array}, workspace, handle) with the handle bound to CuPy's current stream."""
    cudnn = _import("cudnn")
    if cudnn is None:
        return None
    cp = rt.require_cupy()
    dt = _cudnn_data_type(cudnn, q.dtype)
    if dt is None:
        return None
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dev = cp.cuda.Device().id
    if dev not in _cudnn_handles:
        _cudnn_handles[dev] = cudnn.create_handle()
    handle = _cudnn_handles[dev]
    stream = cp.cuda.get_current_stream()
    cudnn.set_stream(handle, stream.ptr)

    def bhsd(S, H):  # dims and strides of a contiguous [B, S, H, D] array seen as [B, H, S, D]
        return [B, H, S, D], [S * H * D, D, H * D, 1]

    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    qt = g.tensor(name="q", dim=bhsd(Sq, Hq)[0], stride=bhsd(Sq, Hq)[1], data_type=dt)
    kt = g.tensor(name="k", dim=bhsd(Sk, Hkv)[0], stride=bhsd(Sk, Hkv)[1], data_type=dt)
    vt = g.tensor(name="v", dim=bhsd(Sk, Hkv)[0], stride=bhsd(Sk, Hkv)[1], data_type=dt)
    kw = dict(name="sdpa", q=qt, k=kt, v=vt, attn_scale=float(scale))
    if causal:  # top-left and bottom-right alignment agree when Sq == Sk
        kw["use_causal_mask" if Sq == Sk else "use_causal_mask_bottom_right"] = True
    try:
        ot, _ = g.sdpa(generate_stats=False, **kw)  # newer frontends
    except TypeError:
        ot, _ = g.sdpa(is_inference=True, **kw)     # older ones
    ot.set_output(True).set_dim(bhsd(Sq, Hq)[0]).set_stride(bhsd(Sq, Hq)[1])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = cp.empty(max(1, int(g.get_workspace_size())), dtype=cp.uint8)
    out = cp.empty_like(q)
    pack = {qt: q, kt: k, vt: v, ot: out}

    def run():
        g.execute(pack, workspace, handle=handle)
        return out
    run()
    stream.synchronize()
    return run


# ---------------------------------------------------------------------------------------------- torch
def torch_sdpa(q, k, v, causal: bool, scale: float):
    """torch.nn.functional.scaled_dot_product_attention on the same memory (DLPack, no copy), or None.
    Returns (torch module, callable)."""
    torch = _import("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if causal and Sq != Sk:  # torch's is_causal is aligned at the top left
        return None
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    F = torch.nn.functional
    gqa = {"enable_gqa": True} if Hkv != Hq else {}

    def run():
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=bool(causal), scale=float(scale), **gqa)
    run()
    torch.cuda.synchronize()
    return torch, run


def torch_cuda_graph(warm: Callable[[], object], body: Callable[[], object]):
    """A torch CUDA graph of body(), captured after warm() ran on a side stream (torch's recipe: first-call
    allocations and lazy initialization stay out of the capture). Replay with .replay()."""
    torch = _import("torch")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


# ---------------------------------------------------------------------------------------------- naive
def naive_attention(q, k, v, causal: bool, scale: float):
    """CuPy matmul-softmax-matmul with an fp32 softmax: the plain path a fused kernel replaces (S x S scores
    in memory). Not a tuned kernel: a ratio against it is no performance claim."""
    cp = rt.require_cupy()
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qt = q.transpose(0, 2, 1, 3).astype(cp.float32)
    kt = cp.repeat(k.transpose(0, 2, 1, 3), g, axis=1).astype(cp.float32)
    vt = cp.repeat(v.transpose(0, 2, 1, 3), g, axis=1).astype(cp.float32)
    s = cp.matmul(qt, kt.transpose(0, 1, 3, 2)) * scale
    if causal:
        i = cp.arange(Sq)[:, None] + (Sk - Sq)
        s = cp.where(cp.arange(Sk)[None, :] <= i, s, -cp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p, vt).astype(q.dtype).transpose(0, 2, 1, 3)


NAIVE_MAX_SCORE_BYTES = 4 << 30  # the naive peer's fp32 S x S scores must fit


def _naive(q, k, v, causal, scale):
    B, Sq, Hq, _ = q.shape
    if 4 * B * Hq * Sq * k.shape[1] > NAIVE_MAX_SCORE_BYTES:
        return None
    return lambda: naive_attention(q, k, v, causal, scale)


def _build(kind, q, k, v, causal, scale) -> Peer | None:
    try:
        if kind == "cudnn":
            fn = cudnn_sdpa(q, k, v, causal, scale)
            return None if fn is None else Peer("cudnn", CUDNN, fn)
        if kind == "torch":
            r = torch_sdpa(q, k, v, causal, scale)
            return None if r is None else Peer("torch", TORCH, r[1], torch=r[0])
        if kind == "naive":
            fn = _naive(q, k, v, causal, scale)
            return None if fn is None else Peer("naive", NAIVE, fn)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is skipped, not fatal
        rt.warn_once(f"peer:{kind}", f"vbw_cupy: the {LABELS[kind]} peer cannot run q {tuple(q.shape)} "
                                     f"{np.dtype(q.dtype).name} ({type(e).__name__}: {e}); trying the next peer")
        return None
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def attention_peer(q, k, v, causal: bool, scale: float, kinds=KINDS) -> Peer | None:
    """The first peer of `kinds` (default: cuDNN frontend, torch, naive CuPy) that builds and runs on these
    arrays, or None (no peer could run, e.g. the naive one's scores do not fit)."""
    for kind in kinds:
        p = _build(kind, q, k, v, causal, scale)
        if p is not None:
            return p
    return None


def available_kinds() -> tuple[str, ...]:
    """The tuned peers whose packages import here ("cudnn", "torch" with CUDA), in order of preference; just
    ("naive",) when there are none. A cheap check: whether a peer runs a given shape is known only by building
    it (`attention_peer`)."""
    kinds = []
    if _import("cudnn") is not None:
        kinds.append("cudnn")
    torch = _import("torch")
    if torch is not None and torch.cuda.is_available():
        kinds.append("torch")
    return tuple(kinds) or ("naive",)
