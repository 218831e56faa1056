"""cuBLAS GEMM that can be captured in a CUDA graph.

CuPy refuses every cuBLAS call while a stream is being captured (its setStream wrapper raises), although cuBLAS
itself supports capture when the handle has a workspace of its own (cublasSetWorkspace; otherwise it may
allocate one during the capture). This module calls the same library CuPy loaded, through ctypes, on CuPy's
handle for the current device, with a per-(device, stream) workspace from `_plans.scratch` that is never freed.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import _plans
from . import _runtime as rt

_WORKSPACE = 32 << 20            # cuBLAS's own recommendation for Hopper
_CUDA_R = {"float16": 2, "bfloat16": 14, "float32": 0}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
_lock = threading.Lock()
_lib = None


def _library():
    """The libcublas CuPy has loaded (found in this process's memory map), as a ctypes library."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                rt.require_cupy().cuda.device.get_cublas_handle()   # makes CuPy load libcublas
                path = None
                with open("/proc/self/maps") as f:
                    for line in f:
                        name = line.rsplit(None, 1)[-1]
                        if "/libcublas.so" in name:
                            path = name
                            break
                lib = ctypes.CDLL(path or "libcublas.so")
                for fn in ("cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
                    getattr(lib, fn).restype = ctypes.c_int
                _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"vbw_cupy: {what} failed with cuBLAS status {status}")


def matmul_nt(x, w, out_dtype=None):
    """x [M, K] @ w[N, K].T -> [M, N] (float16 / bfloat16 operands of one dtype, float32 accumulation, output
    `out_dtype`: x's dtype or float32), on the current stream, capturable. x and w C-contiguous."""
    cp = rt.require_cupy()
    M, K = x.shape
    N = w.shape[0]
    if w.ndim != 2 or w.shape[1] != K or w.dtype != x.dtype or x.dtype.name not in ("float16", "bfloat16"):
        raise ValueError(f"matmul_nt: x {x.shape} {x.dtype} and w {w.shape} {w.dtype}: expected w [N, {K}] of x's "
                         "dtype, float16 or bfloat16")
    if not (x.flags.c_contiguous and w.flags.c_contiguous):
        raise ValueError("matmul_nt: x and w must be C-contiguous")
    odt = np.dtype(out_dtype or x.dtype)
    out = cp.empty((M, N), dtype=odt)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    lib = _library()
    stream = cp.cuda.get_current_stream()
    handle = cp.cuda.device.get_cublas_handle()
    ws = _plans.scratch("cublas_workspace", _WORKSPACE)
    _check(lib.cublasSetStream_v2(ctypes.c_void_p(handle), ctypes.c_void_p(stream.ptr)), "cublasSetStream")
    _check(lib.cublasSetWorkspace_v2(ctypes.c_void_p(handle), ctypes.c_void_p(ws.data.ptr),
                                     ctypes.c_size_t(ws.nbytes)), "cublasSetWorkspace")
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    t_in, t_out = _CUDA_R[np.dtype(x.dtype).name], _CUDA_R[odt.name]
    # column-major view: out^T [N, M] = w [N, K] (stored as col-major [K, N], transposed) @ x^T (col-major [K, M])
    _check(lib.cublasGemmEx(ctypes.c_void_p(handle), _OP_T, _OP_N, N, M, K, ctypes.byref(one),
                            ctypes.c_void_p(w.data.ptr), t_in, K, ctypes.c_void_p(x.data.ptr), t_in, K,
                            ctypes.byref(zero), ctypes.c_void_p(out.data.ptr), t_out, N, _COMPUTE_32F,
                            _GEMM_DEFAULT), "cublasGemmEx")
    return out
