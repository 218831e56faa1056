"""What every op's launch path shares: the bounded cache of launch plans and stream-owned scratch memory.

A launch plan is what a call with a given signature (shapes, dtypes, options, device, stream, tuning state)
launches: kernels, grids, shared memory and scalar arguments, built once by the op's full, checked path and
replayed by its fast path with the new arrays. `PlanCache` keeps them, least recently used out first.

Scratch memory (split-K partials, counters) never comes from CuPy's pool inside a call: a CUDA graph captured
around the call would keep addresses that the pool hands to someone else later. `scratch()` gives each
(device, stream, name) one buffer that only grows; a buffer it replaces is kept for the life of the process,
because a captured graph may still write to it.

Threads: plans and scratch are per stream (`stream_key`), so threads that launch on streams of their own never
share them; CuPy's per-thread default stream (one handle, 2, for a different stream in every thread) counts as
each thread's own. Threads sharing one stream share its plans; their launches are still safe (a `Launch`
replays under a lock), and the stream orders their use of its scratch.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _runtime as rt

# the bounded plan cache (defined in _runtime, whose tensor-map cache is one too)
PlanCache, MAX_PLANS = rt.PlanCache, rt.MAX_PLANS


_PER_THREAD_STREAM = 2  # cudaStreamPerThread: the handle of every thread's own default stream


def stream_key(stream=None):
    """What plan and scratch keys hold for the current (or the given CuPy) stream: its handle, or with CuPy's
    per-thread default stream (the same handle in every thread, a different stream in each) the handle and the
    calling thread."""
    ptr = (stream if stream is not None else rt.cupy.cuda.get_current_stream()).ptr
    return ptr if ptr != _PER_THREAD_STREAM else (ptr, threading.get_ident())


_scratch_lock = threading.Lock()
_scratch: dict = {}   # (device, stream, name) -> CuPy uint8 array
_retired: list = []   # replaced buffers: a captured graph may still use them
_captured: set = set()  # keys of per-call buffers handed out during a capture


def scratch(name: str, nbytes: int, zeroed: bool = False, per_call: bool = False):
    """A CuPy uint8 array of at least `nbytes` for this (device, current stream, name), reused by every call.

    `zeroed`: the buffer is zero when first made (for counters that the kernels reset themselves). Growing a
    buffer while a CUDA graph is captured raises: make the largest call once before capturing.
    `per_call`: the caller asks for the buffer on every call and keeps its address in no plan (the staged
    copies of fp4_matmul's activations): then a buffer that no capture has used goes back to the pool when it
    is replaced, instead of being kept for the life of the process."""
    cp = rt.require_cupy()
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.runtime.getDevice(), stream_key(stream), name)
    buf = _scratch.get(key)
    if per_call and buf is not None and key not in _captured and stream.is_capturing():
        _captured.add(key)
    if buf is not None and buf.nbytes >= nbytes:
        return buf
    with _scratch_lock:
        buf = _scratch.get(key)
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        if stream.is_capturing():
            raise RuntimeError(f"vbw_cupy: {name} needs {nbytes} bytes of scratch while a CUDA graph is being "
                               "captured; make the same call once before capturing")
        size = max(int(nbytes), 1 << 16, 0 if buf is None else 2 * buf.nbytes)
        new = cp.zeros(size, dtype=cp.uint8) if zeroed else cp.empty(size, dtype=cp.uint8)
        if buf is not None and (not per_call or key in _captured):
            _retired.append(buf)
        _scratch[key] = new
        return new


def frozen(x):
    """A hashable form of an A/B switch's value (dicts and lists as tuples), for plan keys."""
    if x == () or x is True or x is False:  # the values in use: the fast paths ask on every call
        return x
    if isinstance(x, dict):
        return tuple(sorted((k, frozen(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(frozen(v) for v in x)
    return x


def kernel_ptr(kernel) -> int | None:
    """The driver handle (CUfunction) of a CuPy kernel: a `RawKernel` (what `RawModule.get_function` returns,
    holding a `Function` as `.kernel`) or a `Function`; None when neither exposes one."""
    ptr = getattr(kernel, "ptr", None)
    if ptr is None:
        ptr = getattr(getattr(kernel, "kernel", None), "ptr", None)
    return int(ptr) if ptr else None


class Launch:
    """One kernel launch with its argument block packed once: a replay rewrites only the pointers of the
    arrays that change from call to call and calls the driver, skipping CuPy's per-argument packing (most of
    the host cost of a short call).

    `args` are the launch's arguments as CuPy takes them (CuPy arrays, NumPy scalars, NumPy records such as
    tensor maps); `dynamic` the indices of the arrays a call replaces (their new device pointers are passed to
    `__call__` in that order); other arrays (scratch, the error word) stay as packed. Threads may replay the same
    Launch: the pointers are written and the kernel launched under a lock (the driver copies the argument
    block when the launch is issued)."""
    __slots__ = ("fptr", "dims", "smem", "buf", "words", "params", "pptr", "slots", "empty", "driver", "pdl",
                 "lock")

    def __init__(self, kernel, grid, block, args, dynamic=(), shared_mem: int = 0):
        from cupy_backends.cuda.api import driver
        cp = rt.require_cupy()
        self.driver = driver
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self.empty = min(grid) <= 0
        if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = int(shared_mem)
        parts, where, off = [], {}, 0
        for i, a in enumerate(args):
            if isinstance(a, cp.ndarray):
                raw, align = np.uint64(a.data.ptr).tobytes(), 8
            elif isinstance(a, (np.ndarray, np.generic)):
                raw = np.ascontiguousarray(a).tobytes()
                align = 64 if len(raw) >= 64 else max(1, min(8, len(raw)))
            else:
                raise TypeError(f"Launch: argument {i} is a {type(a).__name__} (expected a CuPy array or a NumPy value)")
            off = -(-off // align) * align
            parts.append((off, raw))
            where[i] = off // 8
            off += len(raw)
        # 64-byte aligned storage (tensor maps need it), kept alive by this object
        self.buf = np.zeros(off + 128, dtype=np.uint8)
        base = -(-self.buf.ctypes.data // 64) * 64 - self.buf.ctypes.data
        for o, raw in parts:
            self.buf[base + o:base + o + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.words = self.buf[base:base + -(-off // 8) * 8].view(np.uint64)
        self.params = np.array([self.buf.ctypes.data + base + o for o, _ in parts], dtype=np.uint64)
        self.pptr = int(self.params.ctypes.data)
        self.slots = tuple(where[i] for i in dynamic)
        self.fptr = kernel_ptr(kernel)
        self.pdl = bool(getattr(kernel, "pdl", False))  # launched as a programmatic dependent when enabled
        self.dims = grid + block
        self.smem = int(shared_mem)
        self.lock = threading.Lock()

    def __call__(self, ptrs, stream_ptr: int) -> None:
        if self.empty:
            return
        w = self.words
        with self.lock:
            for i, p in zip(self.slots, ptrs):
                w[i] = p
            if self.pdl and rt.pdl_enabled():
                rt.launch_programmatic(self.fptr, self.dims, self.smem, stream_ptr, self.pptr)
                return
            g0, g1, g2, b0, b1, b2 = self.dims
            self.driver.launchKernel(self.fptr, g0, g1, g2, b0, b1, b2, self.smem, stream_ptr, self.pptr, 0)
