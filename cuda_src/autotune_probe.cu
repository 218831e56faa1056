// autotune_probe.cu: the autotuner's own kernels: l2_flush_read, run before each timed launch, and a tiny,
// always-correct kernel its GPU test tunes (probe_axpb).
//
// l2_flush_read: reads n 16-byte words of a zeroed buffer twice the size of L2 (grid-stride), so a timed launch
// finds none of its own data in L2 and nothing dirty there. (A memset did the flushing before: it left L2 full
// of dirty lines whose write-back took DRAM bandwidth from the timed kernel, which then ran 1.3-1.7x slower
// than in a real loop and ranked memory-bound configs wrongly: tuned fp4_matmul 0.88-0.90x the default at
// M = 1 and 16, H100.)
//
// probe_axpb:
// Computes y[i] = alpha * x[i] + beta for i < n (float32, contiguous). It is memory-bound, so the block size
// and the number of elements per thread change its speed without changing its result, and every config is
// correct for every n (bounds-checked), so no candidate can fault.
//
// Tiling: one block covers BLOCK * VEC consecutive elements; thread t handles base + t + i * BLOCK for
// i < VEC (each of the VEC loads is coalesced across the block). Grid = ceil(n / (BLOCK * VEC)).
//
// History: v1, no tuning of its own interest; the default config (BLOCK=128, VEC=1) and the best one are
// within a few percent of the copy bandwidth on H100 at n = 2^25.

__global__ void __launch_bounds__(256) l2_flush_read(const uint4* __restrict__ p, long long n,
                                                    unsigned* __restrict__ sink) {
  unsigned x = 0u;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // never true on the zeroed buffer; keeps the loads
}

template <int BLOCK, int VEC>
__global__ void __launch_bounds__(BLOCK) probe_axpb(const float* __restrict__ x, float* __restrict__ y,
                                                    float alpha, float beta, long long n) {
    const long long base = (long long)blockIdx.x * (BLOCK * VEC) + threadIdx.x;
    float v[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        const long long j = base + (long long)i * BLOCK;
        v[i] = j < n ? x[j] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        const long long j = base + (long long)i * BLOCK;
        if (j < n) y[j] = fmaf(alpha, v[i], beta);
    }
}
