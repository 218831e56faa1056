"""Facts about the CUDA device: architecture, SM count, attributes, the limits the tuner and plans read, each
cached per device (CuPy's Device().attributes reads every attribute, ~0.1 ms); and one live reading, the SM
clock and board power (NVML), for the benchmarks."""
from __future__ import annotations

import ctypes
import functools

from . import _runtime as rt


MIN_ARCH = 80  # cp.async, bf16 mma.sync and the FP4 decode paths need Ampere or newer


def device_arch(device_id: int | None = None) -> int:
    """Compute capability as an int, e.g. 90 for H100. A RuntimeError for a GPU older than sm_80: every op asks
    this before it compiles anything, so an old GPU gets one clear line instead of an NVRTC dump."""
    cp = rt.require_cupy()
    return _device_arch(cp.cuda.Device(device_id).id)


@functools.lru_cache(maxsize=None)
def _device_arch(device_id: int) -> int:
    arch = int(rt.cupy.cuda.Device(device_id).compute_capability)
    if arch < MIN_ARCH:
        raise RuntimeError(f"vbw_cupy needs an sm_{MIN_ARCH} or newer GPU (Ampere+); this is sm_{arch} "
                           f"{device_name(device_id)} (GPU {device_id}). NumPy inputs still run the reference.")
    return arch


def device_name(device_id: int) -> str:
    """The device's marketing name, e.g. "NVIDIA H100 80GB HBM3"."""
    name = rt.require_cupy().cuda.runtime.getDeviceProperties(device_id)["name"]
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).strip()


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


_device_cache: dict[int, dict] = {}


def query_device() -> dict:
    """id, name, arch, nvrtc version and the limits autotune's `fits` reads, of the current device (cached)."""
    cp = rt.require_cupy()
    dev = cp.cuda.Device()
    if dev.id in _device_cache:
        return _device_cache[dev.id]
    arch = device_arch(dev.id)
    a = dev.attributes
    info = {
        "id": dev.id,
        "name": device_name(dev.id),
        "arch": arch,
        "nvrtc": rt.nvrtc_version(),
        "limits": {
            "arch": arch,
            "smem_optin": int(a.get("MaxSharedMemoryPerBlockOptin", a.get("MaxSharedMemoryPerBlock", 49152))),
            "smem_per_sm": int(a.get("MaxSharedMemoryPerMultiprocessor", 0)),
            "max_threads": int(a.get("MaxThreadsPerBlock", 1024)),
            "regs_per_block": int(a.get("MaxRegistersPerBlock", 65536)),
            "num_sms": int(a.get("MultiProcessorCount", 1)),
            "l2_bytes": int(a.get("L2CacheSize", 0)),
        },
    }
    _device_cache[dev.id] = info
    return info


_NVML_CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM


def clock_and_power(device_id: int | None = None) -> tuple[float, float] | None:
    """(SM clock in MHz, board power in W) of a device now, through NVML (the driver's libnvidia-ml; on Hopper
    the power is NVML's one-second trailing average); None where NVML cannot be loaded or read (a container
    without the driver's utility libraries, no GPU). The benchmarks print it beside sustained timings: a
    power-capped card runs each kernel at the clock its own power draw allows."""
    cp = rt.require_cupy()
    try:
        handle = _nvml_handle(cp.cuda.Device(device_id).id)
    except Exception:  # (no usable GPU or driver: a reading, never a failure)
        return None
    if handle is None:
        return None
    lib, h = handle
    mhz, mw = ctypes.c_uint(), ctypes.c_uint()
    if lib.nvmlDeviceGetClockInfo(h, _NVML_CLOCK_SM, ctypes.byref(mhz)) != 0:
        return None
    if lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(mw)) != 0:  # milliwatts
        return None
    return float(mhz.value), mw.value / 1e3


@functools.lru_cache(maxsize=None)
def _nvml_handle(device_id: int):
    """(library, device handle) for CUDA device `device_id`, matched by PCI bus id (CUDA and NVML may number
    devices differently), or None (kept for the process, as the handle is)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        bus = rt.cupy.cuda.runtime.deviceGetPCIBusId(device_id)
        h = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode() if isinstance(bus, str) else bus, ctypes.byref(h)) != 0:
            return None
        return lib, h
    except Exception:  # (no NVML, no such device: a reading, never a failure)
        return None
