// fp4.cuh: scalar E2M1 / E4M3 / E8M0 helpers shared by the FP4 codec and the FP4 GEMM.
//
// E2M1 (4 bits): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; codes 0..7 are
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives. Rounding is RNE with saturation to +-6.
// All helpers are exact on normal and denormal floats: the codec is compiled without -ftz.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace vbw {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// RNE with saturation. The thresholds are the midpoints between neighbouring E2M1 values; at a tie
// the even code wins, which is why 0.25, 1.25, 2.5, 5 round down and 0.75, 1.75, 3.5 round up.
// NaN compares false everywhere and encodes as a (signed) zero; callers handle NaN blocks themselves.
__device__ __forceinline__ unsigned e2m1_encode(float x) {
    float a = fabsf(x);
    unsigned c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return c | (signbit(x) ? 8u : 0u);
}

__device__ __forceinline__ float e2m1_decode(unsigned c) {
    // magnitude from a packed table of the 8 values in units of 0.5: 0,1,2,3,4,6,8,12
    const unsigned long long tab = 0x0C08060403020100ull;
    float m = 0.5f * (float)((tab >> ((c & 7u) * 8u)) & 0xFFu);
    return (c & 8u) ? -m : m;
}

// E8M0: 2^(code - 127); 255 is NaN. Built from bits so 2^-127 (a float32 denormal) is exact.
__device__ __forceinline__ float e8m0_decode(unsigned code) {
    if (code == 255u) return __int_as_float(0x7fc00000);
    if (code == 0u) return __int_as_float(0x00400000);  // 2^-127
    return __int_as_float((int)(code << 23));
}

// E4M3 (fn: bias 7, max 448, denormals step 2^-9), positive values only: NVFP4 block scales.
__device__ __forceinline__ float e4m3_decode(unsigned code) {
    unsigned e = (code >> 3) & 15u, m = code & 7u;
    float v = e ? ldexpf(1.0f + m * 0.125f, (int)e - 7) : m * 0.001953125f;  // 2^-9
    return (code & 0x80u) ? -v : v;
}

// x already clamped to [2^-9, 448]: round to the nearest E4M3 value, ties to even.
__device__ __forceinline__ unsigned e4m3_encode_pos(float x) {
    if (x < 0.015625f) {  // below 2^-6: denormal grid of 2^-9; rintf is RNE, 8 lands on the first normal
        return (unsigned)rintf(x * 512.0f);
    }
    int e;
    float m = frexpf(x, &e);           // x = m * 2^e, m in [0.5, 1)
    unsigned q = (unsigned)rintf((m * 2.0f - 1.0f) * 8.0f);  // exact: m*2-1 has <= 24 bits
    int E = e - 1;
    if (q == 8u) { q = 0u; E += 1; }
    return ((unsigned)(E + 7) << 3) | q;
}

// floor(log2(a)) for a finite a > 0, denormals included.
__device__ __forceinline__ int floor_log2(float a) {
    int bits = __float_as_int(a);
    int e = (bits >> 23) & 0xFF;
    if (e) return e - 127;
    return (31 - __clz(bits)) - 149;
}

}  // namespace vbw
