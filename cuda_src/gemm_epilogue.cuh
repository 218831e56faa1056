// gemm_epilogue.cuh: the GEMM kernels' shared epilogue (fp4_gemm_sm80.cu, fp4_gemm_sm90.cu, fp8_gemm.cu): bias, activation and the
// output conversion of one element or of 8 consecutive ones, selected at run time by a flags word that gemm.py
// builds.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma.cuh"

namespace vbw_gemm {

// flags: bits 0-2 activation (0 none, 1 relu, 2 gelu erf, 3 gelu tanh, 4 silu); bits 4-5 bias (0 none,
// 1 f16, 2 bf16, 3 f32); bits 8-9 output (0 f16, 1 bf16, 2 f32).
__device__ __forceinline__ float bias_at(const void* bias, int flags, int n) {
  const int bk = (flags >> 4) & 3;
  if (bk == 1) return __half2float(static_cast<const __half*>(bias)[n]);
  if (bk == 2) return __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[n]);
  if (bk == 3) return static_cast<const float*>(bias)[n];
  return 0.f;
}
__device__ __forceinline__ float activate(float v, int flags) {
  switch (flags & 7) {
    case 1: return v < 0.f ? 0.f : v;  // NaN stays NaN
    case 2: return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
    case 3: return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    // v < -20: v * e^v (1 + e^-v rounds to e^-v); keeps the divisor finite and below 2^126, where the division
    // would take its slow path (seen: a third of a GEMM's time on outputs of magnitude ~100)
    case 4: return v < -20.f ? v * expf(v) : v / (1.f + expf(-v));
    default: return v;
  }
}
__device__ __noinline__ void store_out(void* out, const void* bias, int flags, int n, int m, int N, float v) {
  v = activate(v + bias_at(bias, flags, n), flags);
  const size_t idx = (size_t)m * (size_t)N + (size_t)n;
  const int ok = (flags >> 8) & 3;
  if (ok == 0) static_cast<__half*>(out)[idx] = __float2half_rn(v);
  else if (ok == 1) static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v);
  else static_cast<float*>(out)[idx] = v;
}

// Outputs idx .. idx + n - 1 (n <= 8) of the output type in bits 8-9 of flags from v: one 16-byte store (two for
// float32) when vec (n = 8 and the address 16-byte aligned), else one store each.
__device__ __forceinline__ void store8(void* out, size_t idx, const float (&v)[8], int n, int flags, bool vec) {
  const int ok = (flags >> 8) & 3;
  if (vec && ok == 2) {
    float4* o = reinterpret_cast<float4*>(static_cast<float*>(out) + idx);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if (vec) {
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      w[e] = ok == 0 ? vbw::pack2<__half>(v[2 * e], v[2 * e + 1]) : vbw::pack2<__nv_bfloat16>(v[2 * e], v[2 * e + 1]);
    *reinterpret_cast<uint4*>(static_cast<unsigned char*>(out) + idx * 2) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (e >= n) break;
      if (ok == 0) static_cast<__half*>(out)[idx + e] = __float2half_rn(v[e]);
      else if (ok == 1) static_cast<__nv_bfloat16*>(out)[idx + e] = __float2bfloat16_rn(v[e]);
      else static_cast<float*>(out)[idx + e] = v[e];
    }
  }
}

}  // namespace vbw_gemm
