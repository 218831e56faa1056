// attention_fp8.cu: the inputs of FP8 (e4m3) attention (vbw_cupy/attention_fp8.py): per-tensor quantization to
// e4m3 (fn) codes, and the transposed, key-permuted copy of V that attn_fwd_wg<E4M3<O>, ...> reads.
//
// quantize_e4m3_tensor<T>: x [n] (T = __half / __nv_bfloat16 / float, 16-byte aligned) and amax = max |x| (as float
//   bits: fp4_codec.cu's abs_max) -> descale = amax / 448, at least 2^-149 (1 when amax = 0, NaN when amax is
//   not finite) and
//   codes[i] = e4m3(x[i] / descale), round to nearest even, |.| clamped to 448, NaN -> 0x7F. Grid-stride, 16
//   bytes of x a thread step, the last n % (16 / sizeof(T)) one element a thread; CTA 0 thread 0 also writes
//   the descale. Bit-exact with vbw_cupy.reference.quantize_e4m3_tensor (float32
//   divisions, IEEE rounding).
//
// quantize_e4m3_heads<T, PER>: the same with one descale a group of heads: x viewed as [rows, groups, G] (G = the
//   elements of a group of heads in a row, groups descales; amax [groups] from abs_max_heads, which reduces each
//   group's max |x| as float bits with atomicMax, a NaN's bits above Inf's). grid (cx, groups): a CTA works on
//   one group, so its descale is computed once; 256 / (G / PER) rows of it an iteration (G >= 256 PER: one row,
//   the threads over its chunks). PER = 16 / sizeof(T) (16-byte chunks: G % PER == 0, x 16-byte aligned) or 1.
//
// vt_permute: v [B, Sk, Hkv, D] bytes (C-contiguous) -> vt [B, Hkv, D, Skp] (Skp = Sk rounded up to 128): row
//   (b, h, d) holds V[b, :, h, d] with, inside every group of 32 keys, key 32 g + pi(p) at position 32 g + p,
//   pi(p) = 16 (p / 16) + 2 ((p % 16) / 4) + p % 2 + 8 ((p / 2) % 2): the order in which attn_fwd_wg packs P's
//   accumulators into wgmma A fragments (pack_p there). Keys >= Sk are zero. One CTA per (64 keys, h, b):
//   the [64][D] block is read with 16-byte loads into shared memory, then each thread gathers 16 permuted keys
//   of one row d and writes them as one 16-byte store. (Batch and key block share grid.x: any B.)
//
// decode_e4m3<O>: out[i] = E4M3(codes[i]) * descale[(i / bsz) * ds_bs + ((i % row) / grp) * ds_hs] (descale
//   null: 1; ds_bs = ds_hs = 0: descale[0]) as O: dequantize_e4m3 (one descale, or one a group of heads), and
//   the fallback of GPUs without the FP8 kernel (attention_fp8.py decodes, then runs flash_attention; a
//   batch's elements are bsz, a row's row, a KV head's group of heads grp).
//
// History: v1 (2026-11-26) first version; the copy is ~4% of an S = 4096 FP8 call (measured in
// notes/session-2026-11-26b.md). v2 quantize: 16-byte steps, Markstein-corrected division, the hardware E4M3
// conversion; the amax pass is fp4_codec.cu's abs_max (16-byte loads, packed 16-bit maxima).
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

template <typename O>
__global__ void __launch_bounds__(256) decode_e4m3(const u8* __restrict__ codes, long long n,
                                                   const float* __restrict__ descale, long long bsz, long long row,
                                                   long long grp, int ds_bs, int ds_hs, O* __restrict__ out) {
  const float ds0 = descale != nullptr ? descale[0] : 1.f;
  const bool each = descale != nullptr && (ds_bs | ds_hs) != 0;
  for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
    const float ds = each ? descale[(i / bsz) * ds_bs + ((i % row) / grp) * ds_hs] : ds0;
    store(out + i, vbw::e4m3_decode(codes[i]) * ds);
  }
}

// x / ds rounded once (IEEE), given rcp = RN(1 / ds): fp4.cuh's div_markstein, exact for ds in [2^-90, 2^100]
// (checked once: fast) wherever the quotient can reach an E4M3 code other than +-0 (|x / ds| >= 2^-10), the only
// place its rounding matters; the IEEE division otherwise. Below ds = 2^-92 the residual x - q0 ds of such a
// quotient can fall under float32's subnormal grid (a review found float32 inputs with ds ~ 2^-97 landing on an
// E4M3 tie). The sign is x's (ds > 0): the correction's additions would turn -0 into +0.
__device__ __forceinline__ float div_ds(float x, float ds, float rcp, bool fast) {
  return fast ? copysignf(vbw::div_markstein(x, ds, rcp), x) : __fdiv_rn(x, ds);
}

// The descale of a max |x| (float bits): amax / 448 (at least 2^-149: amax < 448 * 2^-150, float32 only, would
// make it 0 and the codes NaN / 448), 1 for 0, NaN where amax is not finite (then every code is NaN).
struct Scale {
  float ds, rcp;
  bool finite, fast;
  __device__ __forceinline__ explicit Scale(unsigned amax_bits) {
    const float a = __uint_as_float(amax_bits);
    finite = a <= 3.402823466e38f;  // (false for NaN and Inf)
    ds = a == 0.f ? 1.f : (finite ? fmaxf(__fdiv_rn(a, 448.f), 0x1p-149f) : __int_as_float(0x7fc00000));
    rcp = __frcp_rn(ds);
    fast = ds >= 0x1p-90f && ds <= 0x1p100f;
  }
  // the codes of PER elements (a multiple of 4) as PER / 4 words, fp4.cuh's e4m3x4
  template <typename T, int PER> __device__ __forceinline__ void codes4(const T (&v)[PER], unsigned (&w)[PER / 4]) const {
#pragma unroll
    for (int q = 0; q < PER / 4; ++q) {
      float f[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = div_ds(as_float(v[4 * q + e]), ds, rcp, fast);
      w[q] = finite ? vbw::e4m3x4(f[0], f[1], f[2], f[3]) : 0x7F7F7F7Fu;  // (ds NaN: every code NaN)
    }
  }
  template <typename T> __device__ __forceinline__ u8 code(T x) const {
    return (u8)vbw::e4m3_code(div_ds(as_float(x), ds, rcp, fast));
  }
};

// 16 bytes of PER elements a chunk: loaded as one, their codes stored together (8 or 4 bytes).
template <typename T> union Chunk { uint4 u; T v[16 / sizeof(T)]; };
template <int PER> __device__ __forceinline__ void store_codes(u8* dst, const unsigned (&w)[PER / 4]) {
  if constexpr (PER == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else *reinterpret_cast<unsigned*>(dst) = w[0];
}

// 16 bytes of x a thread step (x and codes 16-byte aligned), their codes stored together (fp4.cuh's e4m3x4), the
// last n % PER elements one at a time.
template <typename T>
__global__ void __launch_bounds__(256) quantize_e4m3_tensor(const T* __restrict__ x, long long n,
                                                            const unsigned* __restrict__ amax, u8* __restrict__ codes,
                                                            float* __restrict__ descale) {
  const Scale sc(*amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *descale = sc.ds;
  const long long stride = (long long)gridDim.x * 256, i0 = blockIdx.x * 256LL + threadIdx.x;
  constexpr int PER = 16 / sizeof(T);
  const long long nv = n / PER;
  for (long long j = i0; j < nv; j += stride) {
    Chunk<T> p;
    p.u = __ldg(reinterpret_cast<const uint4*>(x) + j);
    unsigned w[PER / 4];
    sc.codes4<T, PER>(p.v, w);
    store_codes<PER>(codes + j * PER, w);
  }
  for (long long i = nv * PER + i0; i < n; i += stride) codes[i] = sc.code(x[i]);
}

// Group g's elements of x [rows, groups, G], PER (16 / sizeof(T), 16-byte chunks, or 1) at a time: f(offset) for
// each chunk's first element. A CTA iteration covers 256 / (G / PER) rows (at least one).
template <int PER, typename F>
__device__ __forceinline__ void for_group_chunks(long long rows, int groups, int G, int g, F&& f) {
  const int cpr = G / PER;  // chunks of a group in a row
  const int rpi = cpr >= 256 ? 1 : 256 / cpr;
  for (long long r0 = (long long)blockIdx.x * rpi; r0 < rows; r0 += (long long)gridDim.x * rpi) {
    for (int t = threadIdx.x; t < rpi * cpr; t += 256) {
      const long long r = r0 + t / cpr;
      if (r >= rows) break;  // (r grows with t)
      f((r * groups + g) * G + (long long)(t % cpr) * PER);
    }
  }
}

template <typename T, int PER>
__global__ void __launch_bounds__(256) abs_max_heads(const T* __restrict__ x, long long rows, int groups, int G,
                                                     unsigned* __restrict__ amax) {
  unsigned b = 0;
  for_group_chunks<PER>(rows, groups, G, blockIdx.y, [&](long long i) {
    if constexpr (PER == 1) {
      b = max(b, __float_as_uint(fabsf(as_float(x[i]))));
    } else {
      Chunk<T> p;
      p.u = __ldg(reinterpret_cast<const uint4*>(x + i));
#pragma unroll
      for (int e = 0; e < PER; ++e) b = max(b, __float_as_uint(fabsf(as_float(p.v[e]))));
    }
  });
#pragma unroll
  for (int o = 16; o; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
  if ((threadIdx.x & 31) == 0) atomicMax(amax + blockIdx.y, b);
}

template <typename T, int PER>
__global__ void __launch_bounds__(256) quantize_e4m3_heads(const T* __restrict__ x, long long rows, int groups, int G,
                                                           const unsigned* __restrict__ amax, u8* __restrict__ codes,
                                                           float* __restrict__ descale) {
  const Scale sc(amax[blockIdx.y]);
  if (blockIdx.x == 0 && threadIdx.x == 0) descale[blockIdx.y] = sc.ds;
  for_group_chunks<PER>(rows, groups, G, blockIdx.y, [&](long long i) {
    if constexpr (PER == 1) {
      codes[i] = sc.code(x[i]);
    } else {
      Chunk<T> p;
      p.u = __ldg(reinterpret_cast<const uint4*>(x + i));
      unsigned w[PER / 4];
      sc.codes4<T, PER>(p.v, w);
      store_codes<PER>(codes + i, w);
    }
  });
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
