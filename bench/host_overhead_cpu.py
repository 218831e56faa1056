"""The Python (host) cost of the short calls, measured without a GPU: tests/fake_cupy.py stands in for CuPy
(kernels record their launches, arrays are NumPy), so what is timed is vbw_cupy's own argument checks,
launch planning and launch calls, not CuPy's allocator or the driver (bench/host_overhead.py measures the
real thing on a GPU).

    python bench/host_overhead_cpu.py
"""
import os
import sys
import timeit

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]
import fake_cupy as fc  # noqa: E402

from vbw_cupy import _checks, attention, fp4, gemm, paged  # noqa: E402


def us(fn, n=2000):
    fn()
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main():
    mp = pytest.MonkeyPatch()
    fc.install(mp)
    fc.POOL["on"] = True
    rng = np.random.default_rng(0)
    B, ctx, bs = 8, 4096, 16
    nb = B * ctx // bs
    f16 = np.float16
    kc = fc.asgpu(np.zeros((nb, bs, 8, 128), f16))
    vcache = fc.asgpu(np.zeros((nb, bs, 8, 128), f16))
    table = fc.asgpu(rng.permutation(nb).astype(np.int32).reshape(B, -1))
    lens = fc.asgpu(np.full(B, ctx, np.int32))
    q = fc.asgpu(np.zeros((B, 32, 128), f16))
    x = fc.asgpu(np.zeros((4096, 4096), f16))
    qa, ka = (fc.asgpu(np.zeros((4, 1024, 16, 64), f16)) for _ in range(2))
    # fp4_matmul's weights: the fake's kernels never run, so the plan timed is whatever the planner picks from
    # what they leave
    w = fp4.quantize(fc.asgpu(np.zeros((8192, 8192), f16)), "nvfp4", 1.0)
    a1, a16 = fc.asgpu(np.zeros((1, 8192), f16)), fc.asgpu(np.zeros((16, 8192), f16))
    data = np.zeros((4096, 2048), np.uint8)
    scales = np.zeros((4096, 256), np.uint8)
    # "first call" rows: the full (checking) path, plans forgotten before every call
    rows = [
        ("flash_attention 4x1024x16x64", lambda: attention.flash_attention(qa, ka, ka)),
        ("  first call (no plan)", lambda: attention._fast_plans.clear() or attention.flash_attention(qa, ka, ka)),
        ("paged_attention B=8 ctx=4096 check=False",
         lambda: paged.paged_attention(q, kc, vcache, table, lens, check=False)),
        ("  first call (no plan)", lambda: paged._sigs.clear() or
         paged.paged_attention(q, kc, vcache, table, lens, check=False)),
        ("paged_attention B=8 ctx=4096 check=True",
         lambda: paged.paged_attention(q, kc, vcache, table, lens)),
        ("fp4_matmul M=1 8192^2 nvfp4", lambda: gemm.fp4_matmul(a1, w)),
        ("fp4_matmul M=16 8192^2 nvfp4", lambda: gemm.fp4_matmul(a16, w)),
        ("quantize mxfp4 4096^2 fp16", lambda: fp4.quantize(x, "mxfp4")),
        ("  first call (no plan)", lambda: fp4._q_plans.clear() or fp4.quantize(x, "mxfp4")),
        ("quantize nvfp4 4096^2 fp16 global_scale=0.01", lambda: fp4.quantize(x, "nvfp4", 0.01)),
        ("FP4Tensor(...) validated (NumPy arrays)",
         lambda: fp4.FP4Tensor(data, scales, np.float32(1.0), "nvfp4", (4096, 4096))),
        ("FP4Tensor._trusted(...) (library-built)",
         lambda: fp4.FP4Tensor._trusted(data, scales, np.float32(1.0), "nvfp4", (4096, 4096))),
        ("_checks.check_paged_args check_values=False",
         lambda: _checks.check_paged_args(q, kc, vcache, table, lens, dtypes=_checks.GPU_ATTENTION_DTYPES,
                                          check_values=False)),
    ]
    print(f"{'call (fake CuPy: Python cost only)':52s} {'us/call':>8s}")
    for name, fn in rows:
        print(f"{name:52s} {us(fn):8.2f}", flush=True)
    for plans in (attention._fast_plans, paged._sigs, fp4._q_plans):  # they hold fake kernels
        plans.clear()
    mp.undo()


if __name__ == "__main__":
    main()
