import sys
import numpy as np
import cupy as cp
sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from vbw_cupy import gemm
from vbw_cupy.fp4 import quantize, dequantize
from bench_fp4_gemm import time_us

def main():
    for (N, K) in ((8192, 8192), (14336, 4096), (4096, 14336)):
        base = [cp.random.standard_normal((N, K), dtype=cp.float32) for _ in range(4)]
        sets = {}
        for tag, opt in (("new", ()), ("old", ("-DVBW_OLD_LAYOUT",))):
            gemm._EXTRA_OPTIONS = opt
            sets[tag] = [quantize(b) for b in base]
        for M in (1, 16, 64, 256, 4096):
            a = cp.random.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
            o = cp.empty((M, N), cp.float16)
            res = {}
            for rep in range(2):
                for tag, opt in (("old", ("-DVBW_OLD_LAYOUT",)), ("new", ())):
                    gemm._EXTRA_OPTIONS = opt
                    ws = sets[tag]
                    plans = [gemm._matmul_gpu(a, w, None, None, np.dtype(np.float16))[1] for w in ws]
                    if rep == 0:
                        got = gemm._matmul_gpu(a, ws[0], None, None, np.dtype(np.float16))[0]
                        z = a.astype(cp.float64) @ dequantize(ws[0]).astype(cp.float64).T
                        err = float(cp.linalg.norm(got.astype(cp.float64) - z) / cp.linalg.norm(z))
                        if err > 1e-3:
                            print("BAD", tag, err)
                    inner = 3 if M == 4096 else 10
                    res.setdefault(tag, []).append(time_us(lambda i: gemm._launch(plans[i % 4], a, o, None), inner=inner, reps=7))
            cfg = plans[0][-1]
            print(f"N={N} K={K} M={M:5d} {cfg['KIND']:5s} old {res['old'][0]:7.1f}/{res['old'][1]:7.1f}  new {res['new'][0]:7.1f}/{res['new'][1]:7.1f} us  new/old {min(res['new'])/min(res['old']):.3f}", flush=True)
    gemm._EXTRA_OPTIONS = ()

if __name__ == "__main__":
    main()
