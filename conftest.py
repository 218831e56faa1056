"""Skip tests and benchmarks marked `gpu` where no CUDA device exists (tests/ and bench/ alike).

VBW_TEST_NO_POOL=1 turns CuPy's memory pools off for every test (and the pytest subprocesses of GPU tests), so each array is its own cudaMalloc and
compute-sanitizer sees an access past an array's end (bench/sanitize.sh sets it)."""
import os

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


def pytest_configure(config):
    # before any test allocates; also in the subprocesses some GPU tests start (they inherit the variable)
    if _GPU and os.environ.get("VBW_TEST_NO_POOL"):
        cp = rt.require_cupy()
        cp.cuda.set_allocator(None)
        cp.cuda.set_pinned_memory_allocator(None)
