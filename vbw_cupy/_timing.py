"""Timing on the device: CUDA events on the current stream, sustained (steady-state) timing of compute-bound
work on a power-capped card, and the copy bandwidth that is the peer of a memory-bound kernel."""
from __future__ import annotations

import time

import numpy as np

from . import _device
from . import _runtime as rt


def time_ms(fn, warmup: int = 3, rep: int = 20, inner: int = 1, before=None) -> float:
    """Median time of fn() in milliseconds, CUDA events on the current stream, after warm-up.

    `inner` > 1 times that many back-to-back calls between one pair of events and divides: the launch
    queue stays full, so a short kernel is timed without the host's per-call launch gap. `before()` runs
    before each sample, outside the timed interval (the autotuner flushes the L2 there)."""
    cp = rt.require_cupy()
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(rep):
        if before is not None:
            before()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(inner):
            fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / inner)
    return float(np.median(times))


def alternating(time_a, time_b, rounds: int = 6) -> tuple[float, float, float]:
    """(a, b, b / a): two timings (callables returning a time each) in `rounds` rounds, the order flipped every
    round (an even count: each goes first equally often); each side's median and the median of the per-round
    ratios. On a power-capped card the side timed first after a pause runs cooler: timed once each, ours first,
    fp4_matmul's ratio to cuBLAS read up to 27% higher on the H100 (notes/session-2026-11-27n.md)."""
    ta, tb = [], []
    for r in range(rounds):
        for fn, out in ((time_a, ta), (time_b, tb))[::1 if r % 2 == 0 else -1]:
            out.append(fn())
    return float(np.median(ta)), float(np.median(tb)), float(np.median([b / a for a, b in zip(ta, tb)]))


def steady_ms(fn, warm_s: float = 1.0, time_s: float = 1.0, window_ms: float = 50.0,
              info: dict | None = None) -> float:
    """fn's milliseconds per call in sustained use: back-to-back calls for `warm_s` seconds first, so that a
    power-capped card's clock settles where this work's own power draw puts it, then timed by CUDA events over
    windows of about `window_ms` for `time_s` seconds; the median window. A short timing instead inherits the
    clock that the previous work left: on the H100 (700 W cap) cuBLAS fp16 settles 170-300 MHz below our FP8
    GEMM, so timed right after it our call ran up to 10% slow (notes/session-2026-11-27o.md). `info`, if given,
    receives the median SM clock ("mhz") and board power ("watts", NVML's trailing average) over readings taken
    once per window while it runs (NVML; absent where it cannot be read)."""
    cp = rt.require_cupy()
    stream = cp.cuda.get_current_stream()
    fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    fn()
    stop.record(stream)
    stop.synchronize()
    batch = max(1, int(window_ms / max(cp.cuda.get_elapsed_time(start, stop), 1e-3)))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        for _ in range(batch):
            fn()
        stream.synchronize()
    times, clocks = [], []
    t0 = time.perf_counter()
    while not times or time.perf_counter() - t0 < time_s:
        start.record(stream)
        for _ in range(batch):
            fn()
        stop.record(stream)
        reading = _device.clock_and_power() if info is not None else None  # while the window still runs
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / batch)
        if reading is not None:
            clocks.append(reading)
    if info is not None and clocks:
        info["mhz"] = float(np.median([c[0] for c in clocks]))
        info["watts"] = float(np.median([c[1] for c in clocks]))
    return float(np.median(times))


def steady_pair(fn_a, fn_b, rounds: int = 2, **steady_kw) -> dict:
    """Two callables timed sustained (`steady_ms`) in `rounds` rounds of flipped order (`alternating`): each
    side's median ms ("a_ms", "b_ms"), the median per-round ratio b / a ("ratio") and each side's median SM clock
    ("a_mhz", "b_mhz"; NaN where NVML cannot be read)."""
    clocks = ([], [])

    def timer(fn, side):
        def run():
            info = {}
            clocks[side].append(info)
            return steady_ms(fn, info=info, **steady_kw)
        return run
    a, b, ratio = alternating(timer(fn_a, 0), timer(fn_b, 1), rounds=rounds)
    mhz = [float(np.median([c.get("mhz", np.nan) for c in side])) for side in clocks]
    return {"a_ms": a, "b_ms": b, "ratio": ratio, "a_mhz": mhz[0], "b_mhz": mhz[1]}


def graph_time_ms(fns, target_ms: float = 30.0, reps: int = 5) -> float:
    """Median milliseconds per call of back-to-back calls of `fns` (rotated) replayed from one CUDA graph on a
    private stream: no host launch cost at all. Each fn must be capturable; they run once eagerly first."""
    cp = rt.require_cupy()
    for f in fns:
        f()
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    with s:
        start.record(s)
        for f in fns:
            f()
        stop.record(s)
        stop.synchronize()
        est = max(cp.cuda.get_elapsed_time(start, stop) / len(fns), 1e-3)
        rounds = max(1, min(400 // len(fns), -(-int(target_ms / est) // len(fns))))
        s.begin_capture()
        for _ in range(rounds):
            for f in fns:
                f()
        g = s.end_capture()
        g.upload(s)
        g.launch(s)
        s.synchronize()
        times = []
        for _ in range(reps):
            start.record(s)
            g.launch(s)
            stop.record(s)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / (rounds * len(fns)))
    return float(np.median(times))


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written, for a copy that
    moves `nbytes` in all (at least 256 MB, so the copy cannot run from the L2 cache)."""
    cp = rt.require_cupy()
    a = cp.empty(max(nbytes, 256 << 20) // 2, dtype=cp.uint8)
    b = cp.empty_like(a)
    ms = time_ms(lambda: b.__setitem__(Ellipsis, a), warmup=2, rep=10, inner=10)
    return 2 * a.nbytes / ms / 1e6


def copy_time_ms(nbytes: int) -> float:
    """What moving `nbytes` (read + written) costs at the device's copy bandwidth: the peer of a
    memory-bound kernel in the self-check."""
    return nbytes / copy_bandwidth_gbs(nbytes) / 1e6
