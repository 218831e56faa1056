// attention_fp8.cu: around FP8 (e4m3) attention (vbw_cupy/attention_fp8.py): per-tensor quantization to e4m3 (fn)
// codes and the decode of the fallback (the attention kernel itself: attention_fwd.cu, attn_fwd_wg<E4M3<O>, ...>).
//
// absmax<T>: *amax (as float bits, zeroed by the caller) = max |x| over x [n], NaN winning (as unsigned bits
//   NaN > Inf > every finite magnitude): a warp max, then one atomicMax a warp. Grid-stride.
// quantize_e4m3_tensor<T>: x [n] (T = __half / __nv_bfloat16 / float) and amax = max |x| -> descale = amax / 448 (1 when amax = 0, NaN when amax is not finite) and
//   codes[i] = e4m3(x[i] / descale), round to nearest even, |.| clamped to 448, NaN -> 0x7F. Grid-stride, one
//   element a thread an iteration; CTA 0 thread 0 also writes the descale. Bit-exact with
//   vbw_cupy.reference.quantize_e4m3_tensor (float32 divisions, IEEE rounding).
//
// decode_e4m3<O>: out[i] = E4M3(codes[i]) * descale[which] (descale null: 1), as O: the fallback of GPUs
//   without the FP8 kernel (attention_fp8.py decodes, then runs flash_attention).
//
// History: v1 (2026-11-26) first version, with a vt_permute kernel writing V transposed for the attention
// (2.34 TB/s, ~4% of an S = 4096 call); v2 the same day moved that transpose into the attention kernel.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "fp4.cuh"

namespace vbw_attn_fp8 {

typedef unsigned char u8;

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T>
__global__ void __launch_bounds__(256) absmax(const T* __restrict__ x, long long n, unsigned* __restrict__ amax) {
  unsigned m = 0;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
    m = max(m, __float_as_uint(fabsf(as_float(x[i]))));
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0 && m) atomicMax(amax, m);
}

template <typename O>
__global__ void __launch_bounds__(256) decode_e4m3(const u8* __restrict__ codes, long long n,
                                                   const float* __restrict__ descale, int which, O* __restrict__ out) {
  const float ds = descale != nullptr ? descale[which] : 1.f;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
    store(out + i, vbw::e4m3_decode(codes[i]) * ds);
  }
}

template <typename T>
__global__ void __launch_bounds__(256) quantize_e4m3_tensor(const T* __restrict__ x, long long n,
                                                            const unsigned* __restrict__ amax, u8* __restrict__ codes,
                                                            float* __restrict__ descale) {
  const float a = __uint_as_float(*amax);
  const float ds = a == 0.f ? 1.f : (a <= 3.402823466e38f ? __fdiv_rn(a, 448.f) : __int_as_float(0x7fc00000));
  if (blockIdx.x == 0 && threadIdx.x == 0) *descale = ds;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
    const float v = __fdiv_rn(as_float(x[i]), ds);
    const float m = fabsf(v);
    codes[i] = !(m == m) ? (u8)0x7F
                         : (u8)(vbw::e4m3_encode_pos(fminf(m, 448.f)) | ((__float_as_uint(v) >> 24) & 0x80u));
  }
}

}  // namespace vbw_attn_fp8
