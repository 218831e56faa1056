"""Decode GEMM against its memory floor: fp4_matmul at M = 1 and 16 inside a CUDA graph vs a bare read of the same
bytes (bare_read.py's kernel, the prepared layout's access pattern), measured in the same run. Bar: <= 1.2x.

Both sides rotate over enough copies (>= 256 MB) that every call reads from DRAM; times are CUDA events over
a graph of 10 back-to-back calls (median of 10 replays), so host launch cost is out.

    python bench/decode_gemm.py [--format nvfp4|mxfp4]
"""
import argparse
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vbw_cupy as vc  # noqa: E402
from vbw_cupy import _timing  # noqa: E402
from bare_read import _SRC as BARE_SRC  # noqa: E402

SHAPES = ((8192, 8192), (14336, 4096), (4096, 14336), (28672, 4096))
BAR = 1.2
_ROTATE_BYTES = 256 << 20


def _graph_us(fns):
    """Microseconds per call from one CUDA graph of back-to-back calls cycling through `fns`."""
    return 1e3 * _timing.graph_time_ms(fns, target_ms=5.0, reps=10)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp4"))
    a = ap.parse_args(argv)
    bare = cp.RawKernel(BARE_SRC, "bare_read", options=("--std=c++17",))
    sink = cp.zeros(4, cp.uint32)
    rows = []
    for N, K in SHAPES:
        w0 = vc.quantize(cp.random.standard_normal((N, K), dtype=cp.float32), a.format)
        nbytes = w0.data.nbytes + w0.scales.nbytes
        copies = max(2, -(-_ROTATE_BYTES // nbytes))
        ws = [w0] + [vc.FP4Tensor(w0.data.copy(), w0.scales.copy(), w0.global_scale, w0.format, w0.shape)
                     for _ in range(copies - 1)]
        cpw = 36
        warps = -(-nbytes // (cpw * 576 * 4)) * 4   # whole CTAs of 4 warps
        bufs = [cp.empty(warps * cpw * 576, dtype=cp.uint8) for _ in range(copies)]
        t_bare = _graph_us([lambda b=b: bare((warps // 4,), (128,), (b, np.int32(cpw), np.int32(576),
                                                                                np.int32(0), sink))
                            for b in bufs])
        for M in (1, 16):
            x = cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
            t = _graph_us([lambda w=w: vc.fp4_matmul(x, w) for w in ws])
            rows.append((N, K, M, t, t_bare, nbytes))
            print(f"N={N:5d} K={K:5d} M={M:2d}: fp4_matmul {t:7.1f} us, bare read {t_bare:7.1f} us "
                  f"({nbytes / t_bare / 1e3:.0f} GB/s) -> {t / t_bare:.2f}x (bar <= {BAR})", flush=True)
        del ws, bufs
        cp.get_default_memory_pool().free_all_blocks()
    worst = max(r[3] / r[4] for r in rows)
    print(f"worst ratio {worst:.2f} (bar <= {BAR}): {'met' if worst <= BAR else 'NOT met'}")


if __name__ == "__main__":
    main()
