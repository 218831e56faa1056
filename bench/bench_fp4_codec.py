"""FP4 quantize / dequantize bandwidth against the device-to-device copy bandwidth of the same run.

Two timings: the kernel alone (preallocated outputs, replayed from a CUDA graph, so no host launch cost: the
bandwidth figure; `nvfp4+amax` syncs to read its amax, so it is timed as 10 back-to-back calls between two
events) and the public call (allocations and argument checks; `nvfp4+amax` adds the amax pass and its sync).

pytest bench/bench_fp4_codec.py --benchmark-only      (pytest-benchmark)
python bench/bench_fp4_codec.py                        (prints the table)
Bytes counted: quantize reads the input and writes packed data + scales; dequantize the reverse.
NVFP4 is timed with a given global_scale (one pass); `nvfp4+amax` adds the amax pass of global_scale=None.
"""
import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy") if __name__ != "__main__" else __import__("cupy")
import ml_dtypes  # noqa: E402

import vbw_cupy as vc  # noqa: E402
from vbw_cupy import _timing  # noqa: E402

SHAPE = (8192, 8192)  # 64M elements
CASES = [(fmt, dt) for fmt in ("mxfp4", "nvfp4", "nvfp4+amax") for dt in (np.float16, ml_dtypes.bfloat16, np.float32)]


def _setup(fmt, dtype, kernel_only=True):
    from vbw_cupy import fp4
    x = cp.random.standard_normal(SHAPE, dtype=cp.float32).astype(dtype)
    f = fmt.split("+")[0]
    gs = 1.0 if fmt == "nvfp4" else None
    t = vc.quantize(x, f, gs)
    out = cp.empty(SHAPE, dtype=dtype)
    flag = cp.zeros(8, dtype=cp.int32)  # the NaN word and, 3 words on, the saturation word
    nbytes = x.nbytes + t.nbytes
    if not kernel_only or fmt == "nvfp4+amax":  # the amax pass is part of the call, time it whole
        return (lambda: vc.quantize(x, f, gs)), (lambda: vc.dequantize(t, dtype)), nbytes
    q = lambda: fp4._launch_quantize(x, t.data, t.scales, f, t.global_scale, flag)  # noqa: E731
    d = lambda: fp4._launch_dequantize(t, out)  # noqa: E731
    return q, d, nbytes


def measure(fmt, dtype):
    q, d, nbytes = _setup(fmt, dtype)
    qc, dc, _ = _setup(fmt, dtype, kernel_only=False)
    copy_gbs = _timing.copy_bandwidth_gbs(nbytes)
    tq = _timing.time_ms(q, inner=10) if fmt == "nvfp4+amax" else _timing.graph_time_ms([q])
    td = _timing.time_ms(d, inner=10) if fmt == "nvfp4+amax" else _timing.graph_time_ms([d])
    return {"format": fmt, "dtype": np.dtype(dtype).name, "copy_GBs": copy_gbs,
            "quantize_GBs": nbytes / tq / 1e6, "dequantize_GBs": nbytes / td / 1e6, "q_ms": tq, "d_ms": td,
            "q_call_ms": _timing.time_ms(qc), "d_call_ms": _timing.time_ms(dc)}


def _run_benchmark(benchmark, fn, nbytes):
    copy_gbs = _timing.copy_bandwidth_gbs(nbytes)
    fn()

    def timed():
        fn()
        cp.cuda.get_current_stream().synchronize()
    benchmark.pedantic(timed, rounds=20, warmup_rounds=3)
    ms = benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update({"GB/s": nbytes / ms / 1e6, "copy GB/s": copy_gbs,
                                 "fraction of copy": nbytes / ms / 1e6 / copy_gbs})


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dtype", CASES, ids=[f"{f}-{np.dtype(d).name}" for f, d in CASES])
def test_quantize(benchmark, fmt, dtype):
    q, _, nbytes = _setup(fmt, dtype)
    _run_benchmark(benchmark, q, nbytes)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,dtype", CASES[:6], ids=[f"{f}-{np.dtype(d).name}" for f, d in CASES[:6]])
def test_dequantize(benchmark, fmt, dtype):
    _, d, nbytes = _setup(fmt, dtype)
    _run_benchmark(benchmark, d, nbytes)


if __name__ == "__main__":
    print(f"{'format':11} {'dtype':9} {'copy GB/s':>9} {'quant GB/s':>10} {'%copy':>6} {'dequant GB/s':>12} "
          f"{'%copy':>6} {'quant call ms':>13} {'dequant call ms':>15}")
    for fmt, dt in CASES:
        r = measure(fmt, dt)
        print(f"{r['format']:11} {r['dtype']:9} {r['copy_GBs']:9.0f} {r['quantize_GBs']:10.0f} "
              f"{100 * r['quantize_GBs'] / r['copy_GBs']:5.0f}% {r['dequantize_GBs']:12.0f} "
              f"{100 * r['dequantize_GBs'] / r['copy_GBs']:5.0f}% {r['q_call_ms']:13.4f} {r['d_call_ms']:15.4f}")
    sys.exit(0)
