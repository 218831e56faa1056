"""Probe: which read pattern / pipeline shape reaches the bare-read floor for the M=1 decode GEMV."""
import sys
import cupy as cp
import numpy as np

SRC = r'''
template <int MODE, int DEPTH, int FAKE, int SYNC>
__global__ void sweep(const unsigned char* __restrict__ p, int nrg, int nkt, int split, uint4* sink) {
  // chunk = 4 atoms of 576 bytes; warp -> (rg, z) as fp4_gemm_mmv: CTA (x, z) of 4 warps
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nx = nrg / 4;
  const int x = blockIdx.x % nx, z = blockIdx.x / nx;
  const int rg = x * 4 + warp;
  const int kps = nkt / split;
  const int W = nrg * split, w = z * nrg + rg;
  auto chunk_of = [&](int i) -> long long {
    const int kt = z * kps + i;
    if (MODE == 0) return (long long)rg * nkt + kt;          // n-major (today's layout)
    if (MODE == 1) return (long long)kt * nrg + rg;          // k-major chunks
    return (long long)i * W + w;                             // flat sweep
  };
  uint4 v[DEPTH][4];
  uint2 s[DEPTH][4];
  auto load = [&](int i, int b) {
    const unsigned char* q = p + chunk_of(i) * 2304;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
          : "=r"(v[b][j].x), "=r"(v[b][j].y), "=r"(v[b][j].z), "=r"(v[b][j].w) : "l"(q + j * 576 + lane * 16));
      asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(s[b][j].x), "=r"(s[b][j].y)
          : "l"(q + j * 576 + 512 + (lane >> 2) * 8));
    }
  };
  unsigned acc[4] = {1, 2, 3, 4};
#pragma unroll
  for (int b = 0; b < DEPTH - 1; ++b) if (b < kps) load(b, b);
  for (int i0 = 0; i0 < kps; i0 += DEPTH) {
#pragma unroll
    for (int b = 0; b < DEPTH; ++b) {
      const int i = i0 + b;
      if (i < kps) {
        if (SYNC) __syncthreads();
        if (i + DEPTH - 1 < kps) load(i + DEPTH - 1, (b + DEPTH - 1) % DEPTH);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned a = acc[j] ^ v[b][j].x ^ s[b][j].x;
#pragma unroll
          for (int f = 0; f < FAKE; ++f) a = a * 1664525u + (f & 1 ? v[b][j].y : v[b][j].z);
          acc[j] = a + v[b][j].w + s[b][j].y;
        }
      }
    }
  }
  if ((acc[0] ^ acc[1] ^ acc[2] ^ acc[3]) == 0x12345678u) sink[0] = make_uint4(acc[0], 0, 0, 0);
}
'''

def timeit(run, n=5):
    for i in range(5):
        run(i)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        s.record()
        for i in range(10):
            run(i)
        e.record(); e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / 10 * 1e3)
    return float(np.median(ts))

def main():
    variants = [(m, d, f, sy) for m in (0, 1, 2) for d in (1, 2, 3) for f in (0, 60) for sy in (0, 1)]
    names = [f"sweep<{m},{d},{f},{sy}>" for m, d, f, sy in variants]
    mod = cp.RawModule(code=SRC, options=("--std=c++17",), name_expressions=names)
    nrg, nkt = 512, 32
    nbytes = nrg * nkt * 2304
    bufs = [cp.random.randint(0, 2**31, nbytes // 4, dtype=cp.int32) for _ in range(5)]
    sink = cp.zeros(4, cp.uint32)
    for split in (4, 2, 8):
        for (m, d, f, sy), nm in zip(variants, names):
            k = mod.get_function(nm)
            blocks = nrg // 4 * split
            t = timeit(lambda i: k((blocks,), (128,), (bufs[i % 5], np.int32(nrg), np.int32(nkt), np.int32(split), sink)))
            print(f"split {split} mode {m} depth {d} fake {f:3d} sync {sy}: {t:6.1f} us {nbytes / t / 1e6:5.2f} TB/s", flush=True)

if __name__ == "__main__":
    main()
