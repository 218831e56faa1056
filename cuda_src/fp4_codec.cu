// fp4_codec.cu: MXFP4 / NVFP4 quantize and dequantize (SPEC section 2), bit-exact with
// vbw_cupy.reference.
//
// Layout: x is [R, K] row-major (R = product of the leading dims). Blocks of BLOCK elements (32 for
// MXFP4, 16 for NVFP4) run along K; each row is padded with zeros to Kp = ceil(K/BLOCK)*BLOCK.
// data is [R, Kp/2] bytes (element 2i in the low nibble), scales is [R, Kp/BLOCK] bytes.
//
// Tiling: one thread owns 8 consecutive elements (16 B of fp16 input, 4 B of packed output), so a
// block is owned by BLOCK/8 neighbouring lanes that combine their amax with __shfl_xor. Loads are
// 16-byte vectors when K % 8 == 0 (rows then start 16 B aligned), scalar and bounds-checked otherwise.
// Memory-bound: quantize moves 2 + 0.5 + 1/BLOCK bytes per fp16 element.
//
// Denormals: compiled without -ftz (see _runtime.py), so float32 denormal inputs and the 2^-127
// MXFP4 scale are exact, as the reference requires.
//
// History (H100, 64M fp16 elements, % of the device-to-device copy bandwidth in the same run):
//   v1: 8 elements per thread, shuffles for the block amax; see the closing note of issue 2.
#include "fp4.cuh"

namespace vbw {

template <typename T> struct Vec8 { T v[8]; };

template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* __restrict__ row, long long k0, long long K, float (&f)[8]) {
    if (VEC) {
        Vec8<T> p;
        constexpr int N16 = sizeof(Vec8<T>) / 16;
        const uint4* src = reinterpret_cast<const uint4*>(row + k0);
        uint4* dst = reinterpret_cast<uint4*>(&p);
#pragma unroll
        for (int i = 0; i < N16; ++i) dst[i] = __ldg(src + i);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = to_float(p.v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = (k0 + i < K) ? to_float(row[k0 + i]) : 0.0f;
    }
}

// All 8-element groups of a row: threads run over [R, Kp/8] in row-major order.
template <int BLOCK>
__device__ __forceinline__ float group_amax(float a) {
#pragma unroll
    for (int o = 1; o < BLOCK / 8; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

}  // namespace vbw

using namespace vbw;

// MXFP4 quantize. A block holding NaN or Inf gets scale code 255 (decodes to NaN) and zero elements.
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) mxfp4_quantize(const T* __restrict__ x, unsigned* __restrict__ data,
                                                      unsigned char* __restrict__ scales, long long R, long long K,
                                                      long long Kp) {
    const long long groups = Kp / 8;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Lanes of one block must all reach the shuffle: the grid covers whole warps, extra lanes idle later.
    bool live = t < R * groups;
    long long r = live ? t / groups : 0, g = live ? t % groups : 0;
    float f[8];
    if (live) load8<T, VEC>(x + r * K, g * 8, K, f);
    else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = 0.0f;
    }
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        bad |= !isfinite(f[i]);
        amax = fmaxf(amax, fabsf(f[i]));
    }
    amax = group_amax<32>(amax);
    unsigned anybad = __ballot_sync(0xffffffffu, bad);
    // lanes 4j..4j+3 form one block; reduce the bad flag over the same 4 lanes
    unsigned lane = threadIdx.x & 31u;
    bool blockbad = (anybad >> (lane & ~3u)) & 0xFu;
    if (!live) return;
    int e = amax == 0.0f ? -127 : floor_log2(amax) - 2;
    e = max(-127, min(127, e));
    unsigned packed = 0;
    if (!blockbad) {
#pragma unroll
        for (int i = 0; i < 8; ++i) packed |= e2m1_encode(ldexpf(f[i], -e)) << (4 * i);
    }
    data[t] = packed;
    if ((g & 3) == 0) scales[r * (Kp / 32) + g / 4] = blockbad ? 255 : (unsigned char)(e + 127);
}

// NVFP4 quantize with a given float32 global scale. Sets *flag to 1 when the input holds NaN or Inf
// (the caller then raises and discards the output: NVFP4 has no NaN scale).
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) nvfp4_quantize(const T* __restrict__ x, unsigned* __restrict__ data,
                                                      unsigned char* __restrict__ scales, long long R, long long K,
                                                      long long Kp, float gscale, int* __restrict__ flag) {
    const long long groups = Kp / 8;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = t < R * groups;
    long long r = live ? t / groups : 0, g = live ? t % groups : 0;
    float f[8];
    if (live) load8<T, VEC>(x + r * K, g * 8, K, f);
    else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = 0.0f;
    }
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        bad |= !isfinite(f[i]);
        amax = fmaxf(amax, fabsf(f[i]));
    }
    amax = group_amax<16>(amax);
    if (!live) return;
    if (bad) *flag = 1;
    // SPEC order: s = f32(amax / 6) / gscale, clamp to [2^-9, 448], round to E4M3.
    float s = (amax / 6.0f) / gscale;
    s = fminf(fmaxf(s, 0.001953125f), 448.0f);
    unsigned code = e4m3_encode_pos(s);
    float denom = e4m3_decode(code) * gscale;
    unsigned packed = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_encode(f[i] / denom) << (4 * i);
    data[t] = packed;
    if ((g & 1) == 0) scales[r * (Kp / 16) + g / 2] = (unsigned char)code;
}

// Tensor amax for the NVFP4 global scale: max of |x| as float bits (order-preserving for x >= 0;
// NaN's bits exceed Inf's, so a NaN anywhere makes the result NaN and the caller raises).
template <typename T>
__global__ void __launch_bounds__(256) abs_max(const T* __restrict__ x, long long n, unsigned* __restrict__ out) {
    float m = 0.0f;
    bool nan = false;
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // 8 elements a step when the base is 16 B aligned (CuPy allocations are), scalar tail.
    long long n8 = n / 8;
    for (long long j = i; j < n8; j += stride) {
        float f[8];
        load8<T, true>(x + j * 8, 0, 8, f);
#pragma unroll
        for (int q = 0; q < 8; ++q) { nan |= isnan(f[q]); m = fmaxf(m, fabsf(f[q])); }
    }
    for (long long j = n8 * 8 + i; j < n; j += stride) {
        float f = to_float(x[j]);
        nan |= isnan(f);
        m = fmaxf(m, fabsf(f));
    }
    unsigned b = nan ? 0x7fc00000u : __float_as_uint(m);
#pragma unroll
    for (int o = 16; o; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
    if ((threadIdx.x & 31) == 0) atomicMax(out, b);
}

// Dequantize: one thread per 8 output elements; x = (e2m1 * scale) * global_scale in float32.
template <typename T, int BLOCK, bool VEC>
__global__ void __launch_bounds__(256) fp4_dequantize(const unsigned* __restrict__ data,
                                                      const unsigned char* __restrict__ scales,
                                                      T* __restrict__ out, long long R, long long K, long long Kp,
                                                      float gscale) {
    const long long groups = (K + 7) / 8;  // output groups per row (unpadded)
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * groups) return;
    long long r = t / groups, g = t % groups;
    unsigned packed = __ldg(data + r * (Kp / 8) + g);
    unsigned code = __ldg(scales + r * (Kp / BLOCK) + (g * 8) / BLOCK);
    float sc = BLOCK == 32 ? e8m0_decode(code) : e4m3_decode(code);
    Vec8<T> o;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float v = e2m1_decode((packed >> (4 * i)) & 15u) * sc;
        if (BLOCK == 16) v *= gscale;
        o.v[i] = from_float<T>(v);
    }
    T* dst = out + r * K + g * 8;
    if (VEC) {
        constexpr int N16 = sizeof(Vec8<T>) / 16;
#pragma unroll
        for (int i = 0; i < N16; ++i) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(&o)[i];
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (g * 8 + i < K) dst[i] = o.v[i];
    }
}
