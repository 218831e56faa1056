"""What a user's first call of each op costs (`vbw-cupy selftest --cold`, the bars of README's cold-start section).

Each op's first call runs in a fresh Python process, its inputs made before the clock starts (whatever they
compile is not counted) and the clock stopped after a device synchronize: once on an empty cache directory
(every kernel the call needs compiled, its tuning run: autotuning on), once more in another fresh process on
the cache the first one filled (the disk cache loaded, nothing compiled or tuned). Each op gets its own
temporary VBW_CUPY_CACHE_DIR (and CUPY_CACHE_DIR), so the user's own caches are neither read nor changed. The
bars are targets, reported as "OVER" when missed; they do not change selftest's exit status. Bars (H100): <= 3 s on the empty cache, <= 0.1 s with the warm disk cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

COLD_BAR_S = 3.0
WARM_BAR_S = 0.1

_PRELUDE = """
import json, sys, time
import cupy as cp, numpy as np
import vbw_cupy as vc
rs = cp.random.RandomState(0)
def h(*shape):
    return rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
"""

# op -> (inputs, the first call); the inputs are made (and synchronized) before the clock starts
OPS = {
    "quantize nvfp4 4096x4096": ("x = h(4096, 4096)", "vc.quantize(x, 'nvfp4')"),
    "dequantize mxfp4 4096x4096": ("t = vc.quantize(h(4096, 4096), 'mxfp4')", "vc.dequantize(t, np.float16)"),
    "fp4_matmul M=16 4096x4096": ("a = h(16, 4096); w = vc.quantize(h(4096, 4096), 'nvfp4')", "vc.fp4_matmul(a, w)"),
    "fp4_matmul M=2048 4096x4096": ("a = h(2048, 4096); w = vc.quantize(h(4096, 4096), 'nvfp4')",
                                    "vc.fp4_matmul(a, w)"),
    "flash_attention 1x4096x32x128 causal": ("q, k, v = h(1, 4096, 32, 128), h(1, 4096, 8, 128), h(1, 4096, 8, 128)",
                                            "vc.flash_attention(q, k, v, causal=True)"),
    "paged_attention B=8 ctx 2048": (
        "q = h(8, 32, 128); kc = h(1024, 16, 8, 128); vcache = h(1024, 16, 8, 128); "
        "table = cp.arange(1024, dtype=cp.int32).reshape(8, 128); lens = cp.full(8, 2048, dtype=cp.int32)",
        "vc.paged_attention(q, kc, vcache, table, lens)"),
}


def _script(setup: str, call: str) -> str:
    return (_PRELUDE + setup + "\ncp.cuda.Device().synchronize()\nt0 = time.perf_counter()\n" + call +
            "\ncp.cuda.Device().synchronize()\ndt = time.perf_counter() - t0\n"
            "from vbw_cupy import autotune\nprint(json.dumps([dt, autotune.stats()]))\n")


def first_call_s(op: str, cache_dir: str, autotune: bool = True, timeout: float = 600.0) -> tuple[float, dict]:
    """Seconds of `op`'s first call in a fresh process with VBW_CUPY_CACHE_DIR = cache_dir, and the autotuner's
    counters (autotune.stats()) after it."""
    setup, call = OPS[op]
    env = dict(os.environ, VBW_CUPY_CACHE_DIR=cache_dir, VBW_CUPY_AUTOTUNE="1" if autotune else "0",
               CUPY_CACHE_DIR=os.path.join(cache_dir, "cupy"))  # CuPy's own kernels start cold too
    res = subprocess.run([sys.executable, "-c", _script(setup, call)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{op}: the first-call process failed:\n{res.stderr[-2000:]}")
    try:
        dt, stats = json.loads(res.stdout.strip().splitlines()[-1])
        return float(dt), stats
    except (IndexError, ValueError, TypeError):  # (no output, or something other than its last line printed)
        raise RuntimeError(f"{op}: the first-call process printed no timing (stdout: {res.stdout[-300:]!r})") \
            from None


def measure(ops=None, progress=print) -> list[dict]:
    """One row per op: its first call on an empty cache and in a new process on the warm disk cache."""
    rows = []
    for op in ops or OPS:
        progress(f"cold start: {op} ...")
        row = {"op": op, "cold_s": None, "warm_s": None, "ok": False, "error": None, "compile_s": None,
               "timing_s": None}
        try:
            with tempfile.TemporaryDirectory(prefix="vbw_cupy_cold_") as d:  # an empty cache for each op
                row["cold_s"], st = first_call_s(op, d)
                row["compile_s"], row["timing_s"] = st["compile_s"], st["timing_s"]
                row["warm_s"] = first_call_s(op, d)[0]
            row["ok"] = row["cold_s"] <= COLD_BAR_S and row["warm_s"] <= WARM_BAR_S
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one op's failure must not hide the others
            row["error"] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        rows.append(row)
    return rows


def print_rows(rows, out=None) -> None:
    out = out or sys.stdout
    print(f"{'first call of':40} {'empty cache s':>13} {'(tuner compile':>14} {'timing)':>8} {'warm disk s':>11}  "
          f"(bars: <= {COLD_BAR_S:g} s empty with autotuning, <= {WARM_BAR_S:g} s warm)", file=out)
    for r in rows:
        if r.get("error"):
            print(f"{r['op']:40} {'failed':>13} {'':>11}  {r['error']}", file=out)
        else:
            print(f"{r['op']:40} {r['cold_s']:13.2f} {r['compile_s']:14.2f} {r['timing_s']:8.2f} {r['warm_s']:11.3f}  "
                  f"{'ok' if r['ok'] else 'OVER'}", file=out)
