// attention_fp8.cu: the inputs of FP8 (e4m3) attention (vbw_cupy/attention_fp8.py): per-tensor quantization to
// e4m3 (fn) codes, and the transposed, key-permuted copy of V that attn_fwd_wg<E4M3<O>, ...> reads.
//
// absmax<T>: *amax (as float bits, zeroed by the caller) = max |x| over x [n], NaN winning (as unsigned bits
//   NaN > Inf > every finite magnitude): a warp max, then one atomicMax a warp. Grid-stride.
// quantize_e4m3_tensor<T>: x [n] (T = __half / __nv_bfloat16 / float) and amax = max |x| -> descale = amax / 448 (1 when amax = 0, NaN when amax is not finite) and
//   codes[i] = e4m3(x[i] / descale), round to nearest even, |.| clamped to 448, NaN -> 0x7F. Grid-stride, one
//   element a thread an iteration; CTA 0 thread 0 also writes the descale. Bit-exact with
//   vbw_cupy.reference.quantize_e4m3_tensor (float32 divisions, IEEE rounding).
//
// vt_permute: v [B, Sk, Hkv, D] bytes (C-contiguous) -> vt [B, Hkv, D, Skp] (Skp = Sk rounded up to 128): row
//   (b, h, d) holds V[b, :, h, d] with, inside every group of 32 keys, key 32 g + pi(p) at position 32 g + p,
//   pi(p) = 16 (p / 16) + 2 ((p % 16) / 4) + p % 2 + 8 ((p / 2) % 2): the order in which attn_fwd_wg packs P's
//   accumulators into wgmma A fragments (pack_p there). Keys >= Sk are zero. One CTA per (64 keys, h, b):
//   the [64][D] block is read with 16-byte loads into shared memory, then each thread gathers 16 permuted keys
//   of one row d and writes them as one 16-byte store. (Batch and key block share grid.x: any B.)
//
// decode_e4m3<O>: out[i] = E4M3(codes[i]) * descale[which] (descale null: 1), as O: dequantize_e4m3, and the
//   fallback of GPUs without the FP8 kernel (attention_fp8.py decodes, then runs flash_attention).
//
// History: v1 (2026-11-26) first version; the copy is ~4% of an S = 4096 FP8 call (measured in
// notes/session-2026-11-26b.md).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "fp4.cuh"

namespace vbw_attn_fp8 {

typedef unsigned char u8;

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
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

__device__ __forceinline__ int key_of(int p) {  // pi(p) of the header, p in [0, 32)
  return 16 * (p >> 4) + 2 * ((p & 15) >> 2) + (p & 1) + 8 * ((p >> 1) & 1);
}

// grid (Skp / 64 * B, Hkv), 256 threads; D % 16 == 0, D <= 256; v and vt 16-byte aligned.
__global__ void __launch_bounds__(256) vt_permute(const u8* __restrict__ v, u8* __restrict__ vt, int Sk, int Skp,
                                                  int Hkv, int D) {
  __shared__ __align__(16) u8 tile[64][256];
  const int nkb = Skp / 64;
  const int k0 = (int)(blockIdx.x % nkb) * 64, h = blockIdx.y, b = (int)(blockIdx.x / nkb);
  const int cpr = D / 16;
  for (int c = threadIdx.x; c < 64 * cpr; c += 256) {
    const int r = c / cpr, ch = c - r * cpr;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (k0 + r < Sk)
      val = *reinterpret_cast<const uint4*>(v + (((long long)b * Sk + k0 + r) * Hkv + h) * D + ch * 16);
    *reinterpret_cast<uint4*>(&tile[r][ch * 16]) = val;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < D * 4; c += 256) {
    const int d = c >> 2, q = c & 3;   // row d, 16 positions 16 q .. 16 q + 15 of the 64
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned x = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int p = 16 * q + 4 * j + e;
        x |= (unsigned)tile[(p & ~31) + key_of(p & 31)][d] << (8 * e);
      }
      w[j] = x;
    }
    *reinterpret_cast<uint4*>(vt + (((long long)b * Hkv + h) * D + d) * Skp + k0 + 16 * q) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace vbw_attn_fp8
