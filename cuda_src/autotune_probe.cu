// autotune_probe.cu: a tiny, always-correct kernel the autotuner's own GPU test tunes.
//
// Computes y[i] = alpha * x[i] + beta for i < n (float32, contiguous). It is memory-bound, so the block size
// and the number of elements per thread change its speed without changing its result, and every config is
// correct for every n (bounds-checked), so no candidate can fault.
//
// Tiling: one block covers BLOCK * VEC consecutive elements; thread t handles base + t + i * BLOCK for
// i < VEC (each of the VEC loads is coalesced across the block). Grid = ceil(n / (BLOCK * VEC)).
//
// History: v1, no tuning of its own interest; the default config (BLOCK=128, VEC=1) and the best one are
// within a few percent of the copy bandwidth on H100 at n = 2^25.

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
