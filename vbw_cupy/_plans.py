"""What every op's launch path shares: the bounded cache of launch plans and stream-owned scratch memory.

A launch plan is what a call with a given signature (shapes, dtypes, options, device, stream, tuning state)
launches: kernels, grids, shared memory and scalar arguments, built once by the op's full, checked path and
replayed by its fast path with the new arrays. `PlanCache` keeps them, least recently used out first.

Scratch memory (split-K partials, counters) never comes from CuPy's pool inside a call: a CUDA graph captured
around the call would keep addresses that the pool hands to someone else later. `scratch()` gives each
(device, stream, name) one buffer that only grows; a buffer it replaces is kept for the life of the process,
because a captured graph may still write to it.
"""
from __future__ import annotations

import collections
import threading

from . import _runtime as rt


MAX_PLANS = 256  # plans a cache keeps by default


class PlanCache:
    """A bounded mapping key -> plan; a hit moves the key to the back, a full cache drops the oldest."""

    def __init__(self, maxsize: int = MAX_PLANS):
        self.maxsize = int(maxsize)
        self._d: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        d = self._d
        plan = d.get(key)
        if plan is not None:
            try:
                d.move_to_end(key)
            except KeyError:  # dropped by another thread in between
                pass
        return plan

    def put(self, key, plan) -> None:
        with self._lock:
            self._d[key] = plan
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __iter__(self):
        return iter(list(self._d))

    def values(self) -> list:
        return list(self._d.values())

    def __len__(self) -> int:
        return len(self._d)


_scratch_lock = threading.Lock()
_scratch: dict = {}   # (device, stream, name) -> CuPy uint8 array
_retired: list = []   # replaced buffers: a captured graph may still use them


def scratch(name: str, nbytes: int, zeroed: bool = False):
    """A CuPy uint8 array of at least `nbytes` for this (device, current stream, name), reused by every call.

    `zeroed`: the buffer is zero when first made (for counters that the kernels reset themselves). Growing a
    buffer while a CUDA graph is captured raises: make the largest call once before capturing."""
    cp = rt.require_cupy()
    stream = cp.cuda.get_current_stream()
    key = (cp.cuda.runtime.getDevice(), stream.ptr, name)
    buf = _scratch.get(key)
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
        if buf is not None:
            _retired.append(buf)
        _scratch[key] = new
        return new
