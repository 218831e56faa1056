import sys
import numpy as np
import cupy as cp
sys.path.insert(0, ".")
sys.path.insert(0, "scratch")
from vbw_cupy import gemm
from vbw_cupy.fp4 import quantize
import sweep

def main():
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    a = cp.random.standard_normal((M, 8192), dtype=cp.float32).astype(cp.float16)
    w = quantize(cp.random.standard_normal((8192, 8192), dtype=cp.float32))
    o, plan = gemm._matmul_gpu(a, w, None, None, np.dtype(np.float16))
    for _ in range(6):
        gemm._launch(plan, a, o, None)
    mod = cp.RawModule(code=sweep.SRC, options=("--std=c++17",), name_expressions=["sweep<0,2,60,1>"])
    k = mod.get_function("sweep<0,2,60,1>")
    buf = cp.random.randint(0, 2**31, 512 * 32 * 2304 // 4, dtype=cp.int32)
    sink = cp.zeros(4, cp.uint32)
    for _ in range(6):
        k((512,), (128,), (buf, np.int32(512), np.int32(32), np.int32(4), sink))
    cp.cuda.Device().synchronize()
    print("ok", plan[1], plan[-1])

if __name__ == "__main__":
    main()
