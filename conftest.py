"""Skip tests and benchmarks marked `gpu` where no CUDA device exists (tests/ and bench/ alike)."""
import pytest

from vbw_cupy import _runtime as rt

_GPU = rt.gpu_available()
_REASON = ("no CUDA device: GPU tests run on a machine with one (see README, 'GPU tests')"
           if rt.have_cupy() else "CuPy is not installed: GPU tests need vbw_cupy[cuda12] or [cuda13]")


def pytest_collection_modifyitems(config, items):
    if _GPU:
        return
    skip = pytest.mark.skip(reason=_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
