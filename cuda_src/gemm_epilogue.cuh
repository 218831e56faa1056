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
// out[idx] = v converted to the output type in bits 8-9 of flags (no bias, no activation).
__device__ __forceinline__ void store_value(void* out, size_t idx, float v, int flags) {
  const int ok = (flags >> 8) & 3;
  if (ok == 0) static_cast<__half*>(out)[idx] = __float2half_rn(v);
  else if (ok == 1) static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v);
  else static_cast<float*>(out)[idx] = v;
}
__device__ __noinline__ void store_out(void* out, const void* bias, int flags, int n, int m, int N, float v) {
  store_value(out, (size_t)m * (size_t)N + (size_t)n, activate(v + bias_at(bias, flags, n), flags), flags);
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
      store_value(out, idx + e, v[e], flags);
    }
  }
}

// Split-K in a fixed order (deterministic): part `part` of `parts` writes the partial of its NT threads (NACC
// values a thread; layout [part][r][NT] from `base`, coalesced); the group whose arrival completes `*counter`
// sums every part in part order into acc, resets the counter for the next launch and returns true; the others
// return false. bar_or(v): a barrier over the NT threads returning v ORed over them (__syncthreads_or for a
// CTA, a named barrier for a warpgroup); lt: the thread's index among them. Used by fp4_gemm's splitk_reduce
// (a CTA per part) and fp8_gemm's stream-K tail (a warpgroup per part).
template <int NACC, int NT, typename Acc, typename BarOr>
__device__ __forceinline__ bool split_parts_reduce(Acc (&acc)[NACC], Acc* base, int part, int parts, int* counter,
                                                   int lt, BarOr bar_or) {
  Acc* mine = base + (size_t)part * NACC * NT + lt;
#pragma unroll
  for (int r = 0; r < NACC; ++r) mine[r * NT] = acc[r];
  __threadfence();
  bar_or(false);  // every partial is written before the count moves
  if (!bar_or(lt == 0 && atomicAdd(counter, 1) == parts - 1)) return false;
  __threadfence();
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0;
  for (int p = 0; p < parts; ++p) {  // own partial re-read too: one order whoever comes last
    const Acc* q = base + (size_t)p * NACC * NT + lt;
#pragma unroll
    for (int r = 0; r < NACC; ++r) acc[r] += __ldcg(q + r * NT);
  }
  if (lt == 0) *counter = 0;
  return true;
}

}  // namespace vbw_gemm
