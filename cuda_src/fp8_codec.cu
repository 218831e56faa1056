// fp8_codec.cu: FP8 (E4M3) activations with a power-of-two scale per row, bit-exact with
// vbw_cupy.reference.quantize_fp8 / dequantize_fp8 (docs/formats.md, "fp8 rows").
//
//   scale[r] = 2^e, e the least integer with max|x[r, :]| <= 448 * 2^e (clamped to [-126, 127]; 1 for a row of
//   zeros); q[r, k] = E4M3(x[r, k] * 2^-e), round to nearest even. The scaling is a power of two, so the only
//   rounding is E4M3's and dequantize (q * scale in float32) is exact. A row holding NaN or Inf gets scale NaN
//   and every code 0x7F (NaN).
// Layout: x [R, K] row-major, codes [R, K] bytes, scales [R] float32.
// Tiling: one CTA of 256 threads per row. VEC (K * sizeof(T) a multiple of 16, base aligned): chunks of R
//   16-byte loads per thread, all in flight at once; the first chunk stays in registers for the codes pass,
//   longer rows read their later chunks again (from L2); 16 / sizeof(T) codes stored together, converted four
//   at a time (fp4.cuh's e4m3x4: the hardware on sm_89+). Otherwise
//   scalar loads, the row read twice. Dequantize: 4 codes a thread step (one 32-bit load) when K % 4 == 0.
// Role: the activation side of fp4_matmul's W4A8 path (cuda_src/fp8_gemm.cu reads the codes by TMA and applies
//   the row scale as its per-k-tile multiplier).
// History (H100, fp16, 4096 x 14336, bench: scratch timing over 10 back-to-back calls vs a copy of the same bytes):
//   v1 one 16-byte load in flight per thread, the row read twice: 88.8 us, 0.68 of copy (4096^2: 0.55).
//   v2 R loads in flight, the first chunk kept in registers, one run: R = 2 (6 CTAs an SM) / 4 / 8 (2 CTAs):
//      4096 x 14336 0.66 / 0.69 / 0.57 of copy, 4096 x 8192 0.64 / 0.66 / 0.46, 4096^2 0.55 / 0.45 / 0.30.
//      fp8.py takes R = 4 for rows of 16 KB or more, else 2. Tried: a warp per row (8 rows a CTA, shuffle
//      reduction, R = 8 / 16 loads a lane): 4096^2 0.55 / 0.47, 4096 x 8192 0.50 / 0.47, 4096 x 14336 0.55 /
//      0.46 of copy in the same run as R = 2 / 4 above (0.55 / 0.67 / 0.71): no better, not kept.
//   v3 (sm_89+) the codes by the hardware conversion (cvt.rn.satfinite.e4m3x2.f32, four a word) instead of
//      e4m3_code per element, bitwise equal; graph replay, one run: 4096 x 14336 0.70-0.71 -> 0.95-0.98 of
//      copy, 4096 x 8192 0.68-0.72 -> 0.87-0.98, 4096^2 0.58 -> 0.80-0.81, 16384 x 4096 0.65 -> 0.92-0.93.
//      What is left at short rows: one CTA a row waits on its block reduction between the two passes.
#include "fp4.cuh"

namespace vbw_fp8codec {

using vbw::to_float;
typedef unsigned char u8;
typedef unsigned int u32;

template <typename T> struct Pack { static constexpr int N = 16 / sizeof(T); T v[N]; };

__device__ __forceinline__ float block_max(float v, float* red) {  // max over the CTA (NaN wins)
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = (w != w || w > v) ? w : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int i = 1; i < (int)(blockDim.x >> 5); ++i) v = (red[i] != red[i] || red[i] > v) ? red[i] : v;
  return v;
}

// R: VEC's 16-byte loads in flight per thread (a chunk of 256 * N * R elements); registers grow with it.
template <typename T, bool VEC, int R>
__global__ void __launch_bounds__(256, R <= 2 ? 6 : R <= 4 ? 4 : 2) fp8_rows_quantize(const T* __restrict__ x, u8* __restrict__ q,
                                                                      float* __restrict__ scales, long long K) {
  __shared__ float red[8];
  constexpr int N = Pack<T>::N;
  constexpr long long CH = 256LL * N * R;
  const long long r = blockIdx.x;
  const T* row = x + r * K;
  u8* qr = q + r * K;
  float m = 0.f;
  Pack<T> keep[R];                          // the first chunk stays in registers for the second pass
  auto load = [&](long long c0, Pack<T> (&p)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const long long k = c0 + (long long)(i * 256 + threadIdx.x) * N;
      *reinterpret_cast<uint4*>(&p[i]) = k < K ? __ldg(reinterpret_cast<const uint4*>(row + k)) : make_uint4(0, 0, 0, 0);
    }
  };
  if (VEC) {
    for (long long c0 = 0; c0 < K; c0 += CH) {
      Pack<T> p[R];
      load(c0, p);
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float a = fabsf(to_float(p[i].v[j]));
          m = (a != a || a > m) ? a : m;
        }
      if (c0 == 0) {
#pragma unroll
        for (int i = 0; i < R; ++i) keep[i] = p[i];
      }
    }
  } else {
    for (long long k = threadIdx.x; k < K; k += 256) {
      const float a = fabsf(to_float(row[k]));
      m = (a != a || a > m) ? a : m;
    }
  }
  const float amax = block_max(m, red);
  const bool finite = amax <= 3.402823466e38f;  // false for NaN and Inf
  // e: the least integer with amax <= 448 * 2^e. amax = f * 2^E with f in [1, 2): 448 = 1.75 * 2^8.
  int e = 0;
  if (finite && amax > 0.f) {  // a subnormal amax gives e < -126: clamped
    const int E = vbw::floor_log2(amax);
    e = max(-126, E - ((__float_as_uint(amax) & 0x7FFFFFu) <= 0x600000u ? 8 : 7));
  }
  const float inv = __int_as_float((127 - e) << 23);  // 2^-e, a normal float for e in [-126, 126]
  if (threadIdx.x == 0) scales[r] = finite ? __int_as_float((127 + e) << 23) : __int_as_float(0x7fc00000);
  if (VEC) {
    for (long long c0 = 0; c0 < K; c0 += CH) {
      Pack<T> p[R];
      if (c0 == 0) {
#pragma unroll
        for (int i = 0; i < R; ++i) p[i] = keep[i];
      } else {
        load(c0, p);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const long long k = c0 + (long long)(i * 256 + threadIdx.x) * N;
        if (k >= K) break;
        u32 w[N / 4];
#pragma unroll
        for (int j = 0; j < N / 4; ++j)
          w[j] = finite ? vbw::e4m3x4(to_float(p[i].v[4 * j]) * inv, to_float(p[i].v[4 * j + 1]) * inv,
                                      to_float(p[i].v[4 * j + 2]) * inv, to_float(p[i].v[4 * j + 3]) * inv)
                        : 0x7F7F7F7Fu;
        if (N == 8) *reinterpret_cast<uint2*>(qr + k) = make_uint2(w[0], w[N / 4 - 1]);
        else *reinterpret_cast<u32*>(qr + k) = w[0];
      }
    }
  } else {
    for (long long k = threadIdx.x; k < K; k += 256)
      qr[k] = (u8)(finite ? vbw::e4m3_code(to_float(row[k]) * inv) : 0x7Fu);
  }
}

// out[r, k] = E4M3(q[r, k]) * scales[r] in float32 (exact), then rounded to T (double: exact).
template <typename T, bool VEC>
__global__ void __launch_bounds__(256) fp8_rows_dequantize(const u8* __restrict__ q, const float* __restrict__ scales,
                                                           T* __restrict__ out, long long K) {
  const long long r = blockIdx.x;
  const float s = scales[r];
  const u8* qr = q + r * K;
  T* orow = out + r * K;
  if (VEC) {
    for (long long k = (long long)threadIdx.x * 4; k < K; k += 1024) {
      const u32 w = __ldg(reinterpret_cast<const u32*>(qr + k));
#pragma unroll
      for (int i = 0; i < 4; ++i) orow[k + i] = vbw::from_float<T>(vbw::e4m3_decode((w >> (8 * i)) & 0xFFu) * s);
    }
  } else {
    for (long long k = threadIdx.x; k < K; k += 256) orow[k] = vbw::from_float<T>(vbw::e4m3_decode(qr[k]) * s);
  }
}

}  // namespace vbw_fp8codec
