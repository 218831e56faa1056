import sys
import numpy as np
import cupy as cp
sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from vbw_cupy import gemm
from vbw_cupy.fp4 import quantize
from bench_fp4_gemm import time_us

def main():
    for (N, K) in ((8192, 8192), (14336, 4096), (4096, 14336)):
        ws = [quantize(cp.random.standard_normal((N, K), dtype=cp.float32)) for _ in range(4)]
        for M, names in ((1, ("mmvd", "mmv8")), (16, ("mmv16",))):
            a = cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
            o = cp.empty((M, N), cp.float16)
            for name in names:
                for split in (0, 2, 4, 8):
                    cfg = dict(gemm.TILES[name], SPLIT=split)
                    res = []
                    for use in (False, True, False, True):
                        gemm._USE_CLUSTERS = use
                        plans = [gemm._matmul_gpu(a, w, None, None, np.dtype(np.float16), cfg=dict(cfg))[1] for w in ws]
                        res.append(time_us(lambda i: gemm._launch(plans[i % 4], a, o, None)))
                    print(f"N={N} K={K} M={M} {name} split={split} grid={plans[0][1]}: global {res[0]:.1f}/{res[2]:.1f} "
                          f"cluster {res[1]:.1f}/{res[3]:.1f} us", flush=True)
    gemm._USE_CLUSTERS = True

if __name__ == "__main__":
    main()
