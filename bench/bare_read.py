"""The memory floor of the FP4 decode path: a bare streaming read in the prepared weight layout's pattern.

python bench/bare_read.py

Each warp reads 36 consecutive "atoms" (512 data bytes as one 16-byte load per lane, and for strides above 512
the atom's scale bytes as 8 bytes per 8 lanes, as fp4_gemm_mmv does), 4 atoms in flight, 2048 warps, buffers
rotated past the L2, CUDA events over 10 back-to-back launches (median of 10). Stride 576 is the layout of
fp4_gemm.cuh (data and scales interleaved); 512 is data alone, 128-byte aligned; 640 pads each atom to the grid;
"pairs" keeps 576 bytes per atom but stores two atoms' data, then both scale blocks (1152 = 9 x 128 bytes).
On the lent H100s (2026-11-22), two leases: 576: 2.09-2.11 TB/s on the first, 2.41-2.45 on the second; 512:
2.38-2.43 on both; 640: 2.25-2.28, then 2.56-2.60; pairs (second only): 2.36-2.43. Compare within one run.
"""
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vbw_cupy import _timing  # noqa: E402

_SRC = r'''
extern "C" __global__ void bare_read(const unsigned char* __restrict__ p, int cpw, int stride, int pairs, uint4* sink) {
  const int lane = threadIdx.x & 31;
  const long long w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  uint4 acc = make_uint4(0, 0, 0, 0);
  unsigned sacc = 0;
  for (int i0 = 0; i0 < cpw; i0 += 4) {
    uint4 v[4];
    uint2 sv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long atom = w * cpw + i0 + j;
      const unsigned char* q = p + atom * stride;  // data, then scales at q + 512
      const unsigned char* qs = q + 512;
      if (pairs) {  // [data 2i][data 2i+1][scales 2i][scales 2i+1]
        q = p + (atom >> 1) * 2 * stride + (atom & 1) * 512;
        qs = p + (atom >> 1) * 2 * stride + 1024 + (atom & 1) * 64;
      }
      asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
          : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w) : "l"(q + lane * 16));
      if (stride > 512)
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(sv[j].x), "=r"(sv[j].y) : "l"(qs + (lane >> 2) * 8));
      else
        sv[j] = make_uint2(0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) { acc.x ^= v[j].x; acc.y += v[j].y; acc.z ^= v[j].z; acc.w += v[j].w; sacc += sv[j].x ^ sv[j].y; }
  }
  if (acc.x == 0x12345678u && sacc == 7u) sink[0] = acc;  // keeps the loads
}
'''

# The same bytes by bulk copies (cp.async.bulk, the copy engine behind TMA): one thread per CTA keeps `stages`
# chunks of `chunk` bytes in flight into a shared-memory ring (one mbarrier per slot); every thread reads one
# word of each landed chunk, then the slot is refilled. No per-thread load instructions.
_BULK_SRC = r'''
extern "C" __global__ void bulk_read(const unsigned char* __restrict__ p, long long per_cta, int chunk, int stages,
                                     unsigned* sink) {
  extern __shared__ __align__(128) unsigned char sm[];
  const unsigned base = (unsigned)__cvta_generic_to_shared(sm);
  const unsigned bar0 = base + chunk * stages;
  const unsigned char* src = p + blockIdx.x * per_cta;
  const int n = (int)(per_cta / chunk);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar0 + 8 * s));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int i) {
    const unsigned slot = i % stages, bar = bar0 + 8 * slot;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(base + slot * chunk), "l"(src + (long long)i * chunk), "r"(chunk), "r"(bar) : "memory");
  };
  if (threadIdx.x == 0)
    for (int i = 0; i < stages && i < n; ++i) issue(i);
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const unsigned slot = i % stages, bar = bar0 + 8 * slot, par = (i / stages) & 1;
    asm volatile("{ .reg .pred q; W: mbarrier.try_wait.parity.shared::cta.b64 q, [%0], %1; @!q bra W; }"
                 :: "r"(bar), "r"(par) : "memory");
    acc += *reinterpret_cast<const unsigned*>(sm + slot * chunk + (threadIdx.x * 4) % chunk);
    __syncthreads();
    if (threadIdx.x == 0 && i + stages < n) issue(i + stages);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
'''


def bulk(bufs, nbytes=37_748_736):
    k = cp.RawKernel(_BULK_SRC, "bulk_read", options=("--std=c++17", "-arch=sm_90"))
    sink = cp.zeros(4, cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for chunk, stages, per_sm in ((4096, 8, 2), (8192, 8, 2), (16384, 6, 2), (16384, 12, 1), (32768, 6, 1),
                                  (8192, 12, 2), (4608, 16, 2)):
        ctas = sms * per_sm
        per_cta = nbytes // ctas // chunk * chunk
        smem = chunk * stages + 8 * stages
        k.max_dynamic_shared_size_bytes = smem
        run = lambda i: k((ctas,), (128,), (bufs[i % 5], np.int64(per_cta), np.int32(chunk), np.int32(stages), sink),  # noqa: E731
                          shared_mem=smem)
        t = _time(run)
        moved = per_cta * ctas
        print(f"bulk chunk {chunk} x {stages} stages, {per_sm} CTAs/SM: {t * 1e3:.1f} us for {moved / 1e6:.1f} MB = "
              f"{moved / (t * 1e-3) / 1e12:.2f} TB/s", flush=True)


def _time(run):
    """Median ms of run(i) (i rotates the buffers), 10 back-to-back launches between events."""
    calls = iter(range(1 << 62))
    return _timing.time_ms(lambda: run(next(calls)), warmup=5, rep=10, inner=10)


def main():
    k = cp.RawKernel(_SRC, "bare_read", options=("--std=c++17",))
    warps, blocks, threads = 2048, 512, 128
    bufs = [cp.random.randint(0, 2**31, 48_000_000 // 4, dtype=cp.int32) for _ in range(5)]
    sink = cp.zeros(4, cp.uint32)
    for stride, cpw, pairs in ((512, 36, 0), (576, 36, 0), (640, 28, 0), (576, 36, 1)):
        run = lambda i: k((blocks,), (threads,), (bufs[i % 5], np.int32(cpw), np.int32(stride), np.int32(pairs),  # noqa: E731
                                                  sink))
        t = _time(run)
        nbytes = warps * cpw * stride
        print(f"atom stride {stride}{' (pairs)' if pairs else ''}: {t * 1e3:.1f} us for {nbytes / 1e6:.1f} MB = {nbytes / (t * 1e-3) / 1e12:.2f} TB/s",
              flush=True)
    if cp.cuda.Device().compute_capability >= "90":
        bulk(bufs)


if __name__ == "__main__":
    main()
