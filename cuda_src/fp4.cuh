// fp4.cuh: E2M1 / E4M3 / E8M0 helpers shared by the FP4 codec and GEMM, the FP8 codecs and FP8 attention.
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
template <> __device__ __forceinline__ double from_float<double>(float x) { return (double)x; }  // exact
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// E2M1 code of a magnitude a >= 0 (no sign): round to nearest, ties to even, saturate at 6.
// For a >= 1 the float's exponent and first mantissa bit are the code: adding 0x1FFFFF plus that bit
// rounds the remaining 22 bits to nearest-even into bit 22 (1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
// 5 -> 4); 1.0 (biased exponent 127, bit 0) becomes (254 >> 0) - 252 = code 2. Below 1 only the
// thresholds 0.25 (tie to 0) and 0.75 (tie to 1) matter. NaN saturates to 6; callers handle NaN blocks.
__device__ __forceinline__ unsigned e2m1_encode_mag(float a) {
    a = fminf(a, 6.0f);
    unsigned b = __float_as_uint(a);
    unsigned hi = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;
    unsigned lo = (a > 0.25f) + (a >= 0.75f);
    return a >= 1.0f ? hi : lo;
}

// Signed version: -0 and negative values that round to zero keep their sign (code 8).
__device__ __forceinline__ unsigned e2m1_encode(float x) {
    return e2m1_encode_mag(fabsf(x)) | ((__float_as_uint(x) >> 28) & 8u);
}

// Branch-free E2M1 magnitude codes for the quantize kernels (same rounding as e2m1_encode_mag).
//
// e2m1_code_biased(a), a >= 0 any float: returns code + E2M1_CODE_BIAS. Codes >= 2 come from the bits as
// above; min(a, 1) + 2^22 rounds to the 0.5 grid (ties to even) in one addition, giving bits
// E2M1_CODE_BIAS + {0, 1, 2}, and the larger of the two is the code (the bit formula is <= that below 1,
// and >= 2 = the addition's code from 1 up). Packing sum(code_i << 4i) subtracts
// E2M1_CODE_BIAS * 0x11111111 once per 8 codes (mod 2^32). Checked exhaustively on [0, 8].
constexpr unsigned E2M1_CODE_BIAS = 0x4A800000u;  // bits of 2^22
__device__ __forceinline__ unsigned e2m1_code_biased(float a) {
    const unsigned b = __float_as_uint(fminf(a, 6.0f));
    const unsigned hi = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) + (E2M1_CODE_BIAS - 252u);
    const unsigned lo = __float_as_uint(fminf(a, 1.0f) + 0x1p22f);
    return max(hi, lo);
}

// e2m1_code_sub(y) with y = a * 2^-126: E2M1's subnormal step 0.5 then lands on float32's subnormal grid,
// so one round-to-nearest-even of the bits at bit 22 gives all 8 codes. Exact whenever y was formed
// without rounding near a tie, e.g. a = x * 2^-e for a float16/bfloat16 x (11 or 8 significant bits) and
// any e <= 23 (2^(-e-126) must be a float); not for float32 x (the scaling would round twice).
__device__ __forceinline__ unsigned e2m1_code_sub(float y) {
    const unsigned b = __float_as_uint(fminf(y, 0x1.8p-124f));  // saturate at 6 * 2^-126
    return (b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22;
}

// 2^(-e-126) for e in [-127, 23] (the e2m1_code_sub scale), built from bits.
__device__ __forceinline__ float e2m1_sub_scale(int e) {
    return e <= 0 ? __int_as_float((1 - e) << 23) : __int_as_float(1 << (23 - e));
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

// E4M3 (fn: bias 7, max 448, denormals step 2^-9, 0x7F / 0xFF NaN): NVFP4 block scales. Built from bits, no libm.
__device__ __forceinline__ float e4m3_decode(unsigned code) {
    unsigned e = (code >> 3) & 15u, m = code & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;  // 2^-9
    if ((code & 0x7Fu) == 0x7Fu) v = __int_as_float(0x7fc00000);
    return (code & 0x80u) ? -v : v;
}

// x already clamped to [2^-9, 448]: round to the nearest E4M3 value, ties to even. Normal range: add
// 0x7FFFF plus the lowest kept mantissa bit to round the 20 dropped bits to nearest-even (a carry
// bumps the exponent), then rebias 127 -> 7. Below 2^-6 the grid is 2^-9 and rintf is RNE (8 lands on
// the first normal, code 8).
__device__ __forceinline__ unsigned e4m3_encode_pos(float x) {
    if (x < 0.015625f) return (unsigned)rintf(x * 512.0f);
    unsigned b = __float_as_uint(x);
    return ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
}

// E4M3 (fn) code of any float: RNE, |v| clamped to 448, NaN -> 0x7F, sign kept (-0 -> 0x80).
__device__ __forceinline__ unsigned e4m3_code(float v) {
    const float a = fabsf(v);
    if (!(a == a)) return 0x7Fu;
    return e4m3_encode_pos(fminf(a, 448.0f)) | ((__float_as_uint(v) >> 24) & 0x80u);
}

// Four E4M3 codes, a in the lowest byte: the hardware conversion on sm_89+ (cvt.rn.satfinite: RNE, +-448 past
// the range, as e4m3_code; a NaN gives a NaN code, whose sign the callers do not rely on), e4m3_code elsewhere.
__device__ __forceinline__ unsigned e4m3x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | ((unsigned)hi << 16);
#else
    return e4m3_code(a) | (e4m3_code(b) << 8) | (e4m3_code(c) << 16) | (e4m3_code(d) << 24);
#endif
}

// RN(x / d) from rcp = RN(1 / d): q0 = RN(x * rcp) is within an ulp, the residual x - q0 * d is exact in one FMA
// and RN(q0 + residual * rcp) is the correctly rounded quotient (Markstein's theorem) where nothing under- or
// overflows (the callers bound d and the quotients that matter). A zero quotient may lose its sign.
__device__ __forceinline__ float div_markstein(float x, float d, float rcp) {
    const float q0 = __fmul_rn(x, rcp);
    return __fmaf_rn(__fmaf_rn(-q0, d, x), rcp, q0);
}

// e4m3_encode_pos and e4m3_decode in one rounding, for x already clamped to [2^-9, 448]: returns the code
// and sets `value` to its E4M3 value. Normal range: the rounded bits with the 20 dropped bits cleared are
// the value. Below 2^-6: x + 2^14 rounds to the 2^-9 grid (ties to even) in one addition. Checked
// exhaustively against e4m3_encode_pos on the whole clamped range.
__device__ __forceinline__ unsigned e4m3_round_pos(float x, float& value) {
    const unsigned b = __float_as_uint(x);
    const unsigned rb = b + 0x7FFFFu + ((b >> 20) & 1u);
    const float u = x + 16384.0f;
    const bool sub = x < 0.015625f;
    value = sub ? u - 16384.0f : __uint_as_float(rb & 0xFFF00000u);
    return sub ? __float_as_uint(u) - 0x46800000u : (rb >> 20) - (120u << 3);
}

// floor(log2(a)) for a finite a > 0, denormals included.
__device__ __forceinline__ int floor_log2(float a) {
    int bits = __float_as_int(a);
    int e = (bits >> 23) & 0xFF;
    if (e) return e - 127;
    return (31 - __clz(bits)) - 149;
}

}  // namespace vbw
