"""A stand-in for the few CuPy pieces the launch layer touches, so host-side code (argument checks, launch
plans, the fast paths) runs and can be timed on a machine without a GPU.

Arrays are NumPy arrays behind CuPy's attribute names (`.data.ptr` is the NumPy buffer address, so views are
misaligned exactly as on the device); kernels record their launches instead of running. `install(monkeypatch)`
puts the fake in place of `vbw_cupy._runtime.cupy` and the device queries (`vbw_cupy._device`); nothing here computes results.
"""
from __future__ import annotations

import types

import numpy as np

_state = {"device": 0, "stream": 0}


class _Mem:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


class Device:
    def __init__(self, device_id=None):
        self.id = _state["device"] if device_id is None else int(device_id)
        self.attributes = {"MaxSharedMemoryPerBlockOptin": 232448, "MaxSharedMemoryPerMultiprocessor": 233472,
                           "MaxRegistersPerMultiprocessor": 65536, "MaxThreadsPerMultiProcessor": 2048,
                           "MultiProcessorCount": 132}
        self.compute_capability = "90"

    def __enter__(self):
        self._prev = _state["device"]
        _state["device"] = self.id
        return self

    def __exit__(self, *exc):
        _state["device"] = self._prev

    def synchronize(self):
        pass


class ndarray:
    """NumPy array `a` posing as a CuPy array on device `device_id`."""

    def __init__(self, a, device_id=None):
        self.a = a
        self._dev = _state["device"] if device_id is None else device_id
        self._mem = None

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    itemsize = property(lambda self: self.a.itemsize)
    nbytes = property(lambda self: self.a.nbytes)
    flags = property(lambda self: self.a.flags)
    @property
    def data(self):  # (made once: CuPy's is an attribute read, and the timed host paths read it several times)
        if self._mem is None:
            self._mem = _Mem(self.a.__array_interface__["data"][0], self._dev)
        return self._mem
    device = property(lambda self: Device(self._dev))

    def get(self):
        return self.a.copy()

    def fill(self, value):
        self.a[...] = value

    def copy(self):
        return ndarray(self.a.copy(), self._dev)

    def reshape(self, *shape):
        return ndarray(self.a.reshape(*shape), self._dev)

    def view(self, dtype):
        return ndarray(self.a.view(dtype), self._dev)

    def __getitem__(self, idx):
        return ndarray(self.a[_host_index(idx)], self._dev)

    def __setitem__(self, idx, value):
        self.a[_host_index(idx)] = value.a if isinstance(value, ndarray) else value


def _host_index(idx):
    """An index as NumPy takes it (fake arrays among the index arrays unwrapped)."""
    if isinstance(idx, tuple):
        return tuple(x.a if isinstance(x, ndarray) else x for x in idx)
    return idx.a if isinstance(idx, ndarray) else idx


class Kernel:
    """Records (grid, block, args, shared_mem) of each launch in `calls`."""

    def __init__(self, name):
        self.name = name
        self.calls = []
        self.attributes = {"num_regs": 96, "shared_size_bytes": 0}
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        assert type(grid) is tuple and type(block) is tuple
        self.calls.append((grid, block, tuple(args), int(shared_mem)))


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr

    def is_capturing(self):
        return False


POOL = {}  # timing only: (shape, dtype) -> one reused buffer, so NumPy's allocator (mmap for large arrays) stays out


def _empty(shape, dtype=np.float32):
    if POOL.get("on"):
        key = (tuple(shape) if isinstance(shape, tuple) else (shape,), np.dtype(dtype))
        if key not in POOL:
            POOL[key] = np.empty(shape, dtype=dtype)
        return ndarray(POOL[key])
    return ndarray(np.empty(shape, dtype=dtype))


def _zeros(shape, dtype=np.float32):
    return ndarray(np.zeros(shape, dtype=dtype))


def _full(shape, value, dtype=None):
    return ndarray(np.full(shape, value, dtype=dtype))


def _take(a, idx, axis=None, out=None):
    r = np.take(a.a, idx.a if isinstance(idx, ndarray) else idx, axis=axis)
    if out is None:
        return ndarray(r, a._dev)
    out.a[...] = r
    return out


def _ascontiguousarray(x):
    return ndarray(np.ascontiguousarray(x.a), x._dev)


def _asarray(x, dtype=None, blocking=False):
    return x if isinstance(x, ndarray) else ndarray(np.asarray(x, dtype=dtype))


cuda = types.SimpleNamespace(
    Device=Device,
    runtime=types.SimpleNamespace(getDevice=lambda: _state["device"], cudaDevAttrMultiProcessorCount=16,
                                  deviceGetAttribute=lambda attr, dev: 132, getDeviceCount=lambda: 1),
    get_current_stream=lambda: _Stream(_state["stream"]),
)
def _array(x, dtype=None):
    return ndarray(np.array(x.a if isinstance(x, ndarray) else x, dtype=dtype))


empty, zeros, full, take, ascontiguousarray, asarray, array = (_empty, _zeros, _full, _take, _ascontiguousarray,
                                                                _asarray, _array)
float32, int32, uint8, uint32 = np.float32, np.int32, np.uint8, np.uint32


def asgpu(a, device_id=0):
    return ndarray(np.asarray(a), device_id)


def install(monkeypatch):
    """Use this module as vbw_cupy's CuPy for the rest of the test: returns {kernel name: Kernel}."""
    from vbw_cupy import _device, _errors, _plans
    from vbw_cupy import _runtime as rt
    from vbw_cupy import autotune
    import sys
    kernels = {}
    # the process-wide caches of device objects start empty and are put back afterwards: a real GPU test in the
    # same process (a whole-suite run on a GPU machine) must not hand its arrays to fake launches, nor find fake
    # error words (of fake device ids) afterwards
    for mod, name in ((_errors, "_buffers"), (_errors, "_slots"), (_plans, "_scratch")):
        monkeypatch.setattr(mod, name, {})

    def get_kernel(filename, name, extra_options=()):
        key = (_state["device"], name)
        if key not in kernels:
            kernels[key] = Kernel(name)
        return kernels[key]

    _state.update(device=0, stream=0)
    monkeypatch.setattr(rt, "cupy", sys.modules[__name__])
    monkeypatch.setattr(rt, "get_kernel", get_kernel)
    monkeypatch.setattr(_device, "device_attributes", lambda: Device().attributes)
    monkeypatch.setattr(_device, "num_sms", lambda: 132)
    monkeypatch.setattr(autotune, "_device_info", lambda: {
        "id": _state["device"], "name": "fake H200", "arch": 90, "nvrtc": "12.8",
        "limits": {"arch": 90, "smem_optin": 232448, "smem_per_sm": 233472, "max_threads": 1024,
                   "regs_per_block": 65536, "num_sms": 132, "l2_bytes": 50 << 20}})
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")
    return kernels


def set_device(i):
    _state["device"] = int(i)


def set_stream(ptr):
    _state["stream"] = int(ptr)
