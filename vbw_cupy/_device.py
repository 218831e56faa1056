"""Facts about the CUDA device: architecture, SM count, attributes, the limits the tuner and plans read.
Each is cached per device (CuPy's Device().attributes reads every attribute, ~0.1 ms)."""
from __future__ import annotations

import functools

from . import _runtime as rt


def device_arch(device_id: int | None = None) -> int:
    """Compute capability as an int, e.g. 90 for H100."""
    cp = rt.require_cupy()
    return _device_arch(cp.cuda.Device(device_id).id)


@functools.lru_cache(maxsize=None)
def _device_arch(device_id: int) -> int:
    return int(rt.cupy.cuda.Device(device_id).compute_capability)


def device_attributes() -> dict:
    """cupy's Device().attributes of the current device, cached: the query reads every attribute (~0.1 ms)."""
    return _device_attributes(rt.require_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_attributes(device_id: int) -> dict:
    return dict(rt.cupy.cuda.Device(device_id).attributes)


def num_sms() -> int:
    """SM count of the current device (cached: Device().attributes queries every attribute, ~0.1 ms)."""
    return _num_sms(rt.require_cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _num_sms(device_id: int) -> int:
    return int(rt.cupy.cuda.runtime.deviceGetAttribute(rt.cupy.cuda.runtime.cudaDevAttrMultiProcessorCount,
                                                      device_id))
