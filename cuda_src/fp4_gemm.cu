// fp4_gemm.cu: W4A16 GEMM with FP4 weights on tensor cores (SPEC 2 / issue 3).
//
//   out[m, n] = act( sum_k a[m, k] * W[n, k] * out_scale + bias[n] )     (fp32 accumulation)
//
// a: [M, K] row-major (lda elements, 16-byte aligned rows), float16 / bfloat16, or float32 (exact path below).
// W: an FP4Tensor [N, K] (NVFP4: E2M1 + E4M3 per 16 + float32 global scale; MXFP4: E2M1 + E8M0 per 32),
//    re-laid-out ONCE by fp4_gemm_prepare into "atoms" of 16 rows x 64 k (gemm.py caches it in w._cache):
//      atom = 512 B of nibbles + 64 B (nvfp4) / 32 B (mxfp4) of scale bytes; atoms ordered [N/16][K/64].
//      Lane l = 4g + t of a warp owns 16 B of the atom = 4 words, word j = the k16 step j, holding exactly its
//      m16n8k16 A-fragment (the weight is the MMA's A operand, tokens are B: "swap AB"):
//        nibble 3/7: W[g][2t], W[g][2t+1]      nibble 2/6: W[g+8][2t], W[g+8][2t+1]
//        nibble 1/5: W[g][2t+8], W[g][2t+9]    nibble 0/4: W[g+8][2t+8], W[g+8][2t+9]
//      so one LDS.128 gives a thread 4 k16 steps; decode = (q & 0x80008000) | ((q & 0x70007000) >> 3 (f16) / 6
//      (bf16)), then q <<= 4: the E2M1 bits land in a half's sign/exponent/mantissa, = e2m1 * 2^-14 (f16) or
//      e2m1 * 2^-126 (bf16), exactly (E2M1's subnormal 0.5 maps to the half's subnormal).
//      Scale bytes: row g's blocks then row g+8's, at 512 + g*8 (nvfp4) / 512 + g*4 (mxfp4).
// Block scales, two exact modes (template MODE):
//   SIR (scale in register): the multiplier h = u * 2^14 (f16) / u * 2^126 (bf16), u = scale * 2^-c, is built
//      from a prepared byte by a shift and multiplied into the decoded half2 (HMUL2): e2m1 * u has <= 5
//      significant bits, so it is exact as long as it is a normal half; c (per tensor) and a range check in
//      gemm.py guarantee that (else FPP). One fp32 accumulator over all K; out_scale = global_scale * 2^c.
//   FPP (fp32 partials): exact e2m1 operands, one partial accumulator per K block (1 k16 step for nvfp4, 2 for
//      mxfp4) added to the main accumulator times the block scale in fp32 (fp64 for float32 activations).
//      Used when the scale range does not fit (and for MXFP4 NaN blocks, code 255).
// float32 activations: each a is split into three bf16 (hi + mid + lo == a exactly), three MMAs per step into
//   the per-block fp32 partial, partials summed in fp64: error ~1e-7, within SPEC 7 for a float32 output.
//
// Kernels (tile sizes are template parameters; gemm.py lists the instances and the autotuner picks):
//   fp4_gemm_mma   <T, BLK, MODE, BR, BC, BK, WARPS_R, WARPS_C, STAGES>: mma.sync m16n8k16, any sm_80+.
//      CTA = BR weight rows x BC tokens, BK k per stage, cp.async multi-stage ring for weights and activations
//      (activations in 128B-swizzled rows, read with ldmatrix), split-K over gridDim.z. The decode path.
//   fp4_gemm_mmv   <T, BLK, BC, BK, WARPS, STAGES, DIAG, CL>: mma.sync, SIR mode, M <= 16. One warp per 16 weight
//      rows; the weights go from global memory straight into registers (a lane's 16 bytes of an atom are its
//      A fragment), only the activations through shared memory. DIAG (M = 1): the activation tile is
//      "diagonal" (row r holds token 0 in the blocks b = r mod 8), so MMA column r collects block r's partial
//      and the block scales are applied in fp32 once per 8 blocks: 16 instead of 24 ALU/FMA ops per 8 weights.
//   fp4_gemm_wgrs  <T, BLK, BC, WGS, STAGES, KSUB>: Hopper (sm_90a) wgmma m64nBCk16, A = the decoded weights
//      straight from registers, B = activations from 128B-swizzled smem; WGS warpgroups x 64 rows, KSUB 64-k
//      sub-tiles per stage. Drains wgmma every k-tile (ptxas serializes wgmma if an A register is written while
//      one is in flight); the two warpgroups cover each other's decode. The prefill path.
//   fp4_gemm_wgmma <T, BLK, BC, WGS, STAGES>: Hopper, each warp decodes its atom into a double-buffered
//      128B-swizzled smem A tile and wgmma reads both operands from smem (wait_group 1, decode overlaps MMA).
//   Split-K (all): each CTA writes its fp32 partial tile to a workspace, the last CTA of a tile (atomic
//   counter, self-resetting) sums all partials in a fixed order (deterministic) and runs the epilogue.
//   Epilogue: * out_scale, + bias (f16/bf16/f32), relu / gelu(erf) / gelu_tanh / silu, one store per element.
//
// History (the full log: notes/kernel-history.md, section fp4_gemm.cu). nvfp4, fp16 activations, N = K = 8192
// unless said; ratio = cuBLAS (cupy.matmul fp16 on the dequantized weight, same run) time / ours.
//   v1 (H200) mma.sync split-K (M <= 16) + wgmma RS: M=1 36 us (1.06x), M=4096 424 TFLOP/s (0.55x).
//   v2 (H200) wgmma SS (decoded tile staged in smem): M=1 25.5 us (1.59x), M=4096 373 TFLOP/s (0.55x).
//   v3 (H200) copy plans hoisted out of the k-loop, RS drained per k-tile: M=1 19.9 us (2.0x), M=4096 524 TFLOP/s
//      (0.67x).
//   v4 (H200) KSUB = 2 for RS, autotuned: M=1 21 us (1.9x), M=16 25 us (1.5x), M=4096 480-520 TFLOP/s (0.67-0.70x).
//   v5 (H100) fp4_gemm_mmv (weights straight to registers) + DIAG: M=1 21.1 us (2.36x); a bare read of the same
//      bytes takes ~16 us.
//   v6 (H100) wgrs with TMA loads: M=4096 8192^2 wgrs256k 603 TFLOP/s (0.82x; cp.async 0.67x).
//   v7 (H100) staged epilogue (16-byte stores): M=4096 0.94 / 0.88 / 0.94x at 8192^2 / 14336x4096 / 4096x14336.
//   v8 (H100) split-K in a thread-block cluster (split 2), padded atom rows: M=1 14336x4096 19.2 -> 18.7 us.
//   v9 (H100) programmatic dependent launch (pdl.cuh) in the model's decode graph, mmv's first weight tiles
//      requested before the wait: 7B nvfp4 decode 351 vs 319 tokens/s (notes/kernel-history.md, pdl.cuh).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma.cuh"
#include "fp4.cuh"
#include "wgmma.cuh"
#include "pdl.cuh"
#include "gemm_epilogue.cuh"

namespace vbw_fp4gemm {

using vbw::u32;
typedef unsigned long long u64;
typedef unsigned char u8;

template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };

template <typename T> struct OpT { using type = T; };              // MMA operand type for activations T
template <> struct OpT<float> { using type = __nv_bfloat16; };
template <typename T> struct AccT { using type = float; };          // accumulator type
template <> struct AccT<float> { using type = double; };

constexpr int MODE_SIR = 0, MODE_FPP = 1;
__host__ __device__ constexpr int atom_bytes(int blk) { return 512 + (blk == 16 ? 64 : 32); }

// ---------------------------------------------------------------------------------------------- decode
template <typename OT> __device__ __forceinline__ u32 e2m1x2(u32 q);
template <> __device__ __forceinline__ u32 e2m1x2<__half>(u32 q) {
  return (q & 0x80008000u) | ((q & 0x70007000u) >> 3);     // = e2m1 * 2^-14
}
template <> __device__ __forceinline__ u32 e2m1x2<__nv_bfloat16>(u32 q) {
  return (q & 0x80008000u) | ((q & 0x70007000u) >> 6);     // = e2m1 * 2^-126
}

template <typename OT> __device__ __forceinline__ u32 mul2(u32 a, u32 b);
template <> __device__ __forceinline__ u32 mul2<__half>(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
template <> __device__ __forceinline__ u32 mul2<__nv_bfloat16>(u32 a, u32 b) {
  u32 d;  // + (-0) keeps a product of -0 and leaves every other product unchanged
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// 2^14 (f16) / 2^126 (bf16) in both halves: turns the decoded e2m1 * 2^-14 / 2^-126 into exact e2m1.
template <typename OT> __device__ __forceinline__ u32 exact_k2();
template <> __device__ __forceinline__ u32 exact_k2<__half>() { return 0x74007400u; }
template <> __device__ __forceinline__ u32 exact_k2<__nv_bfloat16>() { return 0x7E807E80u; }

// SIR multiplier from x = [b, 0, b, 0] (bytes): b = ((e_u + 29) << 3) | mantissa3 of u = scale * 2^-c, e_u in
// [-29, 1] (f16 needs e_u >= -13). b = 0 (zero-filled tails) gives h = 0 (f16) or 2^97 (bf16): finite, so zero
// weights stay zero.
template <typename OT> __device__ __forceinline__ u32 sir_h(u32 x);
template <> __device__ __forceinline__ u32 sir_h<__half>(u32 x) { return x << 7; }                        // u * 2^14
template <> __device__ __forceinline__ u32 sir_h<__nv_bfloat16>(u32 x) { return (x << 4) + 0x70007000u; } // u * 2^126

template <int BLK> __device__ __forceinline__ float scale_value(u32 code);
template <> __device__ __forceinline__ float scale_value<16>(u32 code) {   // E4M3 (fn), sign honoured, 0x7F NaN
  const float v = (code & 0x7Fu) == 0x7Fu ? __int_as_float(0x7fc00000)
                                          : __uint_as_float((code & 0x7Fu) << 20) * 0x1p120f;
  return (code & 0x80u) ? -v : v;
}
template <> __device__ __forceinline__ float scale_value<32>(u32 code) { return vbw::e8m0_decode(code); }

template <typename OT>
__device__ __forceinline__ void decode_word(u32 q, u32 (&f)[4]) {
  f[0] = e2m1x2<OT>(q);
  f[1] = e2m1x2<OT>(q << 4);
  f[2] = e2m1x2<OT>(q << 8);
  f[3] = e2m1x2<OT>(q << 12);
}

// SIR mode: word j of a lane's atom decoded and scaled, the A fragment of k16 step j. sg / sg8 hold the scale
// codes of rows g / g + 8 (byte j of the atom's blocks for nvfp4, byte j / 2 for mxfp4).
template <typename OT, int BLK>
__device__ __forceinline__ void decode_sir(u32 q, u32 sg, u32 sg8, int j, u32 (&f)[4]) {
  decode_word<OT>(q, f);
  const u32 byte = BLK == 16 ? j : (j >> 1);
  const u32 sel = byte | 0x40u | (byte << 8) | 0x4000u;  // [b, 0, b, 0]
  const u32 hg = sir_h<OT>(__byte_perm(sg, 0u, sel)), hg8 = sir_h<OT>(__byte_perm(sg8, 0u, sel));
  f[0] = mul2<OT>(f[0], hg);
  f[1] = mul2<OT>(f[1], hg8);
  f[2] = mul2<OT>(f[2], hg);
  f[3] = mul2<OT>(f[3], hg8);
}

// d = a * b + c  (m16n8k16, fp32 accumulators)
template <typename OT> __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  vbw::mma_16816<OT>(d, a, b0, b1);
}

__device__ __forceinline__ u32 bf16_bits(__nv_bfloat16 x) { return (u32)__bfloat16_as_ushort(x); }

// float -> hi + mid + lo (bf16 each), exact for normal floats.
__device__ __forceinline__ void split3(float x, u32& hi, u32& mid, u32& lo) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  float r = x - __bfloat162float(h);
  const __nv_bfloat16 m = __float2bfloat16_rn(r);
  r = r - __bfloat162float(m);
  const __nv_bfloat16 l = __float2bfloat16_rn(r);
  hi = bf16_bits(h); mid = bf16_bits(m); lo = bf16_bits(l);
}

using vbw_gemm::activate;
using vbw_gemm::bias_at;
using vbw_gemm::store_out;

// Split-K: write this CTA's partial, the last CTA of the tile sums all of them (fixed order) into acc.
// Returns false for the CTAs that must stop. acc is a flat register array of NACC values per thread.
template <int NACC, int NT, typename Acc>
__device__ __forceinline__ bool splitk_reduce(Acc (&acc)[NACC], void* ws, int* counters) {
  const int nsplit = gridDim.z;
  if (nsplit == 1) return true;
  __shared__ int s_last;
  const int tid = threadIdx.x;
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  Acc* base = static_cast<Acc*>(ws) + (size_t)tile * nsplit * NACC * NT;
  Acc* mine = base + (size_t)blockIdx.z * NACC * NT;
#pragma unroll
  for (int r = 0; r < NACC; ++r) mine[r * NT + tid] = acc[r];
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&counters[tile], 1) == nsplit - 1;
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0;
  for (int z = 0; z < nsplit; ++z) {  // own partial re-read too: one fixed order, deterministic
    const Acc* p = base + (size_t)z * NACC * NT + tid;
#pragma unroll
    for (int r = 0; r < NACC; ++r) acc[r] += __ldcg(p + r * NT);
  }
  if (tid == 0) counters[tile] = 0;  // ready for the next launch on this stream
  return true;
}

// Split-K over a thread-block cluster (sm_90): the CL CTAs of one tile (gridDim.z == CL, cluster 1 x 1 x CL)
// leave their partials in their own shared memory `red` (NACC * NT floats); rank 0 (= blockIdx.z 0) adds the
// others' through distributed shared memory in rank order, the same fixed order as splitk_reduce, and goes
// on. The second barrier keeps the other CTAs (and their shared memory) alive until rank 0 has read them.
// No global workspace, fence or counter (they cost the M = 1 decode kernel ~1.8 us of its 20.5 on the H100),
// but clusters constrain where CTAs run: gemm.py uses them for split 2 only (see the history, v8).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VBW_CLUSTER_Z(n) __cluster_dims__(1, 1, n)
#define VBW_HAVE_CLUSTERS 1
#else
#define VBW_CLUSTER_Z(n)
#define VBW_HAVE_CLUSTERS 0
#endif
template <int NACC, int NT, int CL>
__device__ __forceinline__ bool cluster_reduce(float (&acc)[NACC], float* red) {
#if VBW_HAVE_CLUSTERS
  const int tid = threadIdx.x;
#pragma unroll
  for (int r = 0; r < NACC; ++r) red[r * NT + tid] = acc[r];
  vbw::cluster_sync();
  const u32 rank = vbw::cluster_rank();
  if (rank == 0) {
    const u32 mine = vbw::smem_addr(red) + 4u * tid;
#pragma unroll
    for (int z = 1; z < CL; ++z) {
      u32 remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(mine), "r"(z));
#pragma unroll
      for (int r = 0; r < NACC; ++r) {
        float v;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote + 4u * r * NT) : "memory");
        acc[r] += v;
      }
    }
  }
  vbw::cluster_sync();
  return rank == 0;
#else
  __trap();  // gemm.py launches cluster instances on sm_90 only
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------- prepare
// One thread per (row group, k atom, lane): writes the lane's 16 bytes; lanes with t == 0 write row g's and
// row g+8's scale bytes. SIR mode stores the multiplier code (see sir_h) and zeroes blocks whose scale is 0
// or outside the code range (gemm.py only picks SIR when no such block holds a nonzero element).
template <int BLK>
__device__ __forceinline__ int sir_code(u32 code, int c) {
  int e;
  u32 mant;
  if (BLK == 16) {
    const float s = vbw::e4m3_decode(code);
    if (!(s > 0.f)) return -1;
    const u32 bits = __float_as_uint(s);
    e = (int)((bits >> 23) & 0xFFu) - 127;
    mant = (bits >> 20) & 7u;
  } else {
    if (code == 255u) return -1;
    e = (int)code - 127;
    mant = 0;
  }
  const int eb = e - c + 29;
  if (eb < 0 || eb > 30) return -1;
  return (eb << 3) | (int)mant;
}

template <int BLK, int MODE>
__global__ void fp4_gemm_prepare(const u8* __restrict__ data, const u8* __restrict__ scales, u8* __restrict__ Wp,
                                 int N, int Dk, int Sk, int katoms, int n_rg, int cshift) {
  constexpr int ATOM = atom_bytes(BLK);
  constexpr int NB = BLK == 16 ? 4 : 2;  // scale blocks per atom and row
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_rg * katoms * 32) return;
  const int lane = (int)(idx & 31);
  const long long at = idx >> 5;
  const int ka = (int)(at % katoms), rg = (int)(at / katoms);
  const int g = lane >> 2, t = lane & 3;
  const int r0 = rg * 16 + g, r1 = r0 + 8;
  auto byte_at = [&](int row, int col) -> u32 {
    if (row >= N || col >= Dk) return 0u;
    if (MODE == MODE_SIR && sir_code<BLK>(scales[(size_t)row * Sk + (col * 2) / BLK], cshift) < 0) return 0u;
    return data[(size_t)row * Dk + col];
  };
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kb = ka * 32 + j * 8 + t;  // byte column of k = ka*64 + j*16 + 2t
    const u32 bg0 = byte_at(r0, kb), bg1 = byte_at(r0, kb + 4), bh0 = byte_at(r1, kb), bh1 = byte_at(r1, kb + 4);
    w[j] = (bh1 & 15u) | ((bg1 & 15u) << 4) | ((bh0 & 15u) << 8) | ((bg0 & 15u) << 12) |
           ((bh1 >> 4) << 16) | ((bg1 >> 4) << 20) | ((bh0 >> 4) << 24) | ((bg0 >> 4) << 28);
  }
  u8* dst = Wp + (size_t)at * ATOM;
  *reinterpret_cast<uint4*>(dst + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  if (t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = h ? r1 : r0;
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int blk = ka * NB + b;
        const u32 code = (row < N && blk < Sk) ? scales[(size_t)row * Sk + blk] : 0u;
        u32 outc = code;
        if (MODE == MODE_SIR) {
          const int s = sir_code<BLK>(code, cshift);
          outc = s < 0 ? 232u : (u32)s;  // 232: u = 1 (its data was zeroed)
        }
        dst[512 + g * 2 * NB + h * NB + b] = (u8)outc;
      }
    }
  }
}

// Scale range of a weight, for gemm._scale_info (once per weight): out[0] = max, out[1] = min of
// floor(log2(block scale)) over the live blocks (a nonzero E2M1 code and, NVFP4, a positive scale), out[2] = 1
// if any block scale (live or not) is NaN (MXFP4 255; NVFP4 0x7F / 0xFF) or negative (NVFP4 >= 0x80).
// data: [nblocks][BLK / 2] bytes, scales: [nblocks], both contiguous. out starts at {-2^30, 2^30, 0}.
template <int BLK>
__global__ void fp4_scale_range(const u8* __restrict__ data, const u8* __restrict__ scales, long long nblocks,
                                int* __restrict__ out) {
  int emax = -(1 << 30), emin = 1 << 30, bad = 0;
  for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks;
       b += (long long)gridDim.x * blockDim.x) {
    const u32 sc = scales[b];
    int e = 0;
    bool pos = true;
    if (BLK == 32) {
      bad |= sc == 255u;
      e = (int)sc - 127;
    } else {
      bad |= sc >= 0x7Fu;
      const int ex = (int)(sc >> 3) & 15, m = (int)(sc & 7u);
      pos = sc != 0u && sc < 0x7Fu;
      e = ex ? ex - 7 : (m >= 4 ? -7 : m >= 2 ? -8 : -9);  // subnormal m * 2^-9
    }
    bool live = false;
    const u8* p = data + b * (BLK / 2);
#pragma unroll
    for (int i = 0; i < BLK / 2; ++i) live |= (p[i] & 0x77u) != 0u;
    if (live && pos) {
      emax = max(emax, e);
      emin = min(emin, e);
    }
  }
  emax = __reduce_max_sync(0xffffffffu, emax);
  emin = __reduce_min_sync(0xffffffffu, emin);
  bad = __reduce_or_sync(0xffffffffu, (unsigned)bad);
  if ((threadIdx.x & 31) == 0) {
    atomicMax(out, emax);
    atomicMin(out + 1, emin);
    if (bad) atomicOr(out + 2, 1);
  }
}

// A thread's share of one pipeline stage's weight copies (16 bytes each; CPR per 16-row group, CPA per
// atom): the byte offset of each copy without the k-tile, its atom within the stage, and a bit per copy
// that lies inside the weight. Fixed over the k-tiles, so the k-loop only adds the tile's offset.
template <int WIT, int NT, int CPR, int CPA, int WCH, int ATOM_BYTES>
__device__ __forceinline__ unsigned weight_copy_plan(int tid, int rg0, int n_rg, int katoms, size_t (&w_off)[WIT],
                                                     int (&w_atom)[WIT]) {
  unsigned ok = 0u;
#pragma unroll
  for (int i = 0; i < WIT; ++i) {
    const int c = tid + i * NT;
    const int r = c / CPR, rem = c % CPR;
    w_off[i] = (size_t)(rg0 + r) * katoms * ATOM_BYTES + rem * 16;
    w_atom[i] = rem / CPA;
    if (c < WCH && rg0 + r < n_rg) ok |= 1u << i;
  }
  return ok;
}

// ---------------------------------------------------------------------------------------------- mma.sync
template <typename T, int BLK, int MODE, int BR, int BC, int BK, int WARPS_R, int WARPS_C, int STAGES>
__global__ void __launch_bounds__(32 * WARPS_R * WARPS_C)
fp4_gemm_mma(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
             const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
             int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
  using OT = typename OpT<T>::type;
  using Acc = typename AccT<T>::type;
  constexpr bool F32 = same<T, float>::value;
  constexpr int NP = F32 ? 3 : 1;  // B pieces per fragment (hi, mid, lo for float32)
  constexpr int NT = 32 * WARPS_R * WARPS_C;
  constexpr int WR = BR / WARPS_R, WC = BC / WARPS_C, FR = WR / 16, FC = WC / 8;
  constexpr int ATOM = atom_bytes(BLK), KA = BK / 64;
  constexpr int W_STAGE = (BR / 16) * KA * ATOM;
  constexpr int ROWB = BK * (int)sizeof(T);
  constexpr int STAGE = W_STAGE + BC * ROWB;
  static_assert(!F32 || MODE == MODE_FPP, "float32 activations use fp32 partials");
  static_assert(WR % 16 == 0 && WC % 8 == 0 && BK % 64 == 0 && FR >= 1 && FC >= 1, "tile shape");
  static_assert(STAGES >= 2, "stages");

  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WARPS_R, wc = warp / WARPS_R;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KA - 1) / KA;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);
  vbw::pdl_wait();
  vbw::pdl_launch_dependents();

  // Per-thread copy plan, fixed over the k-tiles (so the k-loop only adds kt offsets).
  constexpr int CPA = ATOM / 16, CPR = KA * CPA, WCH = (BR / 16) * CPR, WIT = (WCH + NT - 1) / NT;
  constexpr int EPC = 16 / (int)sizeof(T), ACPR = ROWB / 16, ACH = BC * ACPR, AIT = (ACH + NT - 1) / NT;
  static_assert(NT % ACPR == 0, "activation copy plan");
  size_t w_off[WIT];
  int w_atom[WIT];
  const unsigned w_ok = weight_copy_plan<WIT, NT, CPR, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  const int a_ch = tid % ACPR, a_r0 = tid / ACPR;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * EPC;
  auto load_stage = [&](int kt, int buf) {
    u8* sw = smem + buf * STAGE;
    u8* sa = sw + W_STAGE;
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = ((w_ok >> i) & 1u) && kt * KA + w_atom[i] < katoms;
        const u8* src = Wp + w_off[i] + (size_t)kt * KA * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
    const bool k_ok = kt * BK + a_ch * EPC < K;
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      const int r = a_r0 + i * (NT / ACPR);
      if (ACH % NT == 0 || r < BC) {
        const bool ok = k_ok && m0 + r < M;
        const T* src = a_base + (size_t)i * (NT / ACPR) * lda + (size_t)kt * BK;
        vbw::cp_async_16(vbw::smem_addr(sa + r * ROWB + ((a_ch ^ (r & 7)) << 4)), ok ? (const void*)src : (const void*)A, ok);
      }
    }
  };

  Acc acc[FR][FC][4];
  float part[FR][FC][4];
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) { acc[i][c][r] = 0; part[i][c][r] = 0.f; }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }

  for (int it = 0; it < nk; ++it) {
    vbw::cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int pf = it + STAGES - 1;
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
    }
    const u8* sw = smem + (it % STAGES) * STAGE;
    const u8* sa = sw + W_STAGE;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      uint4 wq[FR];
      u32 s0[FR], s1[FR];
#pragma unroll
      for (int i = 0; i < FR; ++i) {
        const u8* ap = sw + ((wr * FR + i) * KA + a) * ATOM;
        wq[i] = *reinterpret_cast<const uint4*>(ap + lane * 16);
        if (BLK == 16) {
          const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
          s0[i] = s.x; s1[i] = s.y;
        } else {
          const u32 s = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
          s0[i] = s; s1[i] = s >> 16;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = a * 4 + j;  // k16 step inside the stage
        u32 bf[FC][NP][2];
        if constexpr (!F32) {
#pragma unroll
          for (int c = 0; c < FC; c += 2) {
            if (c + 1 < FC) {
              const int r = wc * WC + (c + (lane >> 4)) * 8 + (lane & 7);
              const int ch = kk * 2 + ((lane >> 3) & 1);
              vbw::ldsm_x4(bf[c][0][0], bf[c][0][1], bf[c + 1][0][0], bf[c + 1][0][1],
                           vbw::smem_addr(sa + r * ROWB + ((ch ^ (r & 7)) << 4)));
            } else {
              const int l = lane & 15;
              const int r = wc * WC + c * 8 + (l & 7);
              const int ch = kk * 2 + (l >> 3);
              vbw::ldsm_x2(bf[c][0][0], bf[c][0][1], vbw::smem_addr(sa + r * ROWB + ((ch ^ (r & 7)) << 4)));
            }
          }
        } else {
#pragma unroll
          for (int c = 0; c < FC; ++c) {
            const int r = wc * WC + c * 8 + g;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int ch = kk * 4 + h * 2 + (t >> 1);
              const float2 v = *reinterpret_cast<const float2*>(sa + r * ROWB + ((ch ^ (r & 7)) << 4) + (t & 1) * 8);
              u32 h0, m0_, l0, h1, m1, l1;
              split3(v.x, h0, m0_, l0);
              split3(v.y, h1, m1, l1);
              bf[c][0][h] = h0 | (h1 << 16);
              bf[c][1][h] = m0_ | (m1 << 16);
              bf[c][2][h] = l0 | (l1 << 16);
            }
          }
        }
        const int byte = BLK == 16 ? j : (j >> 1);
#pragma unroll
        for (int i = 0; i < FR; ++i) {
          const u32 q = j == 0 ? wq[i].x : j == 1 ? wq[i].y : j == 2 ? wq[i].z : wq[i].w;
          u32 af[4];
          if constexpr (MODE == MODE_SIR) {
            decode_sir<OT, BLK>(q, s0[i], s1[i], j, af);
#pragma unroll
            for (int c = 0; c < FC; ++c) mma<OT>(acc[i][c], af, bf[c][0][0], bf[c][0][1]);
          } else {
            decode_word<OT>(q, af);
            const u32 k2 = exact_k2<OT>();
#pragma unroll
            for (int r = 0; r < 4; ++r) af[r] = mul2<OT>(af[r], k2);
            const bool first = BLK == 16 || (j & 1) == 0, last = BLK == 16 || (j & 1) == 1;
#pragma unroll
            for (int c = 0; c < FC; ++c) {
              if (first) {
#pragma unroll
                for (int r = 0; r < 4; ++r) part[i][c][r] = 0.f;
              }
#pragma unroll
              for (int p = NP - 1; p >= 0; --p) mma<OT>(part[i][c], af, bf[c][p][0], bf[c][p][1]);
            }
            if (last) {
              const Acc sg = (Acc)scale_value<BLK>((s0[i] >> (8 * byte)) & 0xFFu);
              const Acc sg8 = (Acc)scale_value<BLK>((s1[i] >> (8 * byte)) & 0xFFu);
#pragma unroll
              for (int c = 0; c < FC; ++c) {
                acc[i][c][0] += (Acc)part[i][c][0] * sg;
                acc[i][c][1] += (Acc)part[i][c][1] * sg;
                acc[i][c][2] += (Acc)part[i][c][2] * sg8;
                acc[i][c][3] += (Acc)part[i][c][3] * sg8;
              }
            }
          }
        }
      }
    }
  }
  vbw::cp_async_wait<0>();

  constexpr int NACC = FR * FC * 4;
  Acc flat[NACC];
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) flat[(i * FC + c) * 4 + r] = acc[i][c][r];
  if (!splitk_reduce<NACC, NT>(flat, ws, counters)) return;
#pragma unroll
  for (int i = 0; i < FR; ++i)
#pragma unroll
    for (int c = 0; c < FC; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = (rg0 + wr * FR + i) * 16 + g + ((r & 2) ? 8 : 0);
        const int m = m0 + wc * WC + c * 8 + 2 * t + (r & 1);
        if (n < N && m < M) {
          const float v = (float)(flat[(i * FC + c) * 4 + r] * (Acc)out_scale);
          store_out(out, bias, flags, n, m, N, v);
        }
      }
}

// ---------------------------------------------------------------------------------------------- mmv (M <= 16)
// Streaming loads for the weights: each lane's 16 bytes of an atom are its A fragment, so they go from global
// memory straight into registers (STAGES - 1 k-tiles ahead, not through shared memory, not kept in L1).
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ldg_stream4(const void* p) {
  u32 v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// fp32 multiplier of a block's fp32 partial in DIAG mode, from its SIR code placed in bits 16..23 of x
// (see sir_code: code = ((e_u + 29) << 3) | mantissa3, u = scale * 2^-c): u * 2^14 for float16 operands
// (decoded weights carry 2^-14), u for bfloat16 (decoded weights are multiplied back to exact e2m1).
template <typename OT> __device__ __forceinline__ float diag_mult(u32 x);
template <> __device__ __forceinline__ float diag_mult<__half>(u32 x) { return __uint_as_float(x * 16u + 0x38000000u); }
template <> __device__ __forceinline__ float diag_mult<__nv_bfloat16>(u32 x) {
  return __uint_as_float(x * 16u + 0x31000000u);
}

// fp4_gemm_mmv <T, BLK, BC, BK, WARPS, STAGES, DIAG, CL>: the decode path (M <= 16), SIR mode, mma.sync.
//   CL > 1 (sm_90): the split-K CTAs of a tile form a cluster and reduce through shared memory (cluster_reduce).
//   CTA = WARPS row groups of 16 weights rows (one per warp) x BC tokens; split-K over gridDim.z. Only the
//   activations go through shared memory (cp.async ring of STAGES k-tiles, 128B-swizzled rows; rows past M
//   are zeroed once and never copied); the weights of the next STAGES - 1 k-tiles wait in registers.
//   DIAG (M = 1, BC = 8): row r of the activation tile holds token 0's values in the blocks b = r (mod 8) and
//   zeros elsewhere, so column r of the MMA output collects block r's partial sum. Every 8 blocks the lane's
//   two columns are scaled in fp32 and added up: no per-weight scale multiply and no scale build per k16 step.
template <typename T, int BLK, int BC, int BK, int WARPS, int STAGES, bool DIAG, int CL>
__global__ void __launch_bounds__(32 * WARPS) VBW_CLUSTER_Z(CL)
fp4_gemm_mmv(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
             const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
             int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
  using OT = typename OpT<T>::type;
  static_assert(!same<T, float>::value, "16-bit activations only");
  constexpr int NT = 32 * WARPS, KA = BK / 64, ATOM = atom_bytes(BLK), FC = BC / 8;
  constexpr int ROWB = BK * 2, CPR = ROWB / 16, STAGE = BC * ROWB;
  constexpr int GA = 8 * BLK / 64;  // DIAG: atoms per group of 8 blocks
  static_assert(BK % 64 == 0 && (BC == 8 || BC == 16) && STAGES >= 2, "tile shape");
  static_assert(!DIAG || (BC == 8 && KA % GA == 0), "DIAG: 8 columns, k-tiles of whole 8-block groups");
  // copies per k-tile: DIAG one row's CPR chunks (each to its diagonal row), else BC rows x CPR chunks
  constexpr int ACH = DIAG ? CPR : BC * CPR, AIT = (ACH + NT - 1) / NT;

  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg = blockIdx.x * WARPS + warp;
  const bool rg_ok = rg < n_rg;
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KA - 1) / KA;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);

  // Zero the ring once: tile rows that are never copied (tokens past M, DIAG's off-diagonal chunks) stay 0.
  for (int i = tid; i < STAGES * STAGE / 16; i += NT) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // Per-thread activation copy plan, fixed over the k-tiles.
  const u32 s_base = vbw::smem_addr(smem);
  u32 a_dst[AIT];
  const T* a_src[AIT];
  int a_k[AIT];
  unsigned a_ok = 0u;
#pragma unroll
  for (int i = 0; i < AIT; ++i) {
    const int c = tid + i * NT;
    const int r = DIAG ? ((c * 8) / BLK) & 7 : c / CPR;   // tile row
    const int ch = DIAG ? c : c % CPR;                     // 16-byte chunk in the row
    const int tok = DIAG ? m0 : m0 + r;
    a_dst[i] = s_base + r * ROWB + ((ch ^ (r & 7)) << 4);
    a_src[i] = A + (size_t)tok * lda + ch * 8;
    a_k[i] = ch * 8;
    if (c < ACH && tok < M) a_ok |= 1u << i;
  }
  auto load_act = [&](int kt, int buf) {
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      if ((a_ok >> i) & 1u) {
        const bool ok = kt * BK + a_k[i] < K;
        vbw::cp_async_16(a_dst[i] + buf * STAGE, ok ? (const void*)(a_src[i] + (size_t)kt * BK) : (const void*)A, ok);
      }
    }
  };

  // Per-lane ldmatrix addresses: row (lane & 7) of n-tile pair (lane >> 4); the 128B swizzle of chunk
  // 2kk + hi only touches its low 3 bits, so four offsets (kk mod 4) cover every k16 step.
  u32 b_addr[4];
  {
    const int r = (FC == 2 ? (lane >> 4) * 8 : 0) + (lane & 7);
    const int hi = (lane >> 3) & 1;
#pragma unroll
    for (int q = 0; q < 4; ++q) b_addr[q] = s_base + r * ROWB + ((((2 * q) | hi) ^ (lane & 7)) << 4);
  }

  // This lane's 16 bytes and its rows' scale bytes in the split's first atom of its row group (row group 0
  // for idle warps, whose results are dropped). gemm.py pads katoms to a multiple of 4 (zero atoms), so every
  // k-tile (KA <= 4 atoms) is whole: no bounds per atom, and the two pointers just step through the row group.
  static_assert(KA <= 4 && 4 % KA == 0, "k-tiles must divide the padded row of atoms");
  const u8* wl = Wp + ((size_t)(rg_ok ? rg : 0) * katoms + (size_t)kt0 * KA) * ATOM + lane * 16;
  const u8* wsl = wl - lane * 16 + 512 + g * (BLK == 16 ? 8 : 4);
  auto load_w = [&](uint4 (&q)[KA], uint2 (&s)[KA]) {  // the next k-tile of this split
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      q[a] = ldg_stream16(wl + a * ATOM);
      if (BLK == 16) s[a] = ldg_stream8(wsl + a * ATOM);
      else s[a] = make_uint2(ldg_stream4(wsl + a * ATOM), 0u);
    }
    wl += KA * ATOM;
    wsl += KA * ATOM;
  };

  float acc[FC][4];
  float part[4] = {0.f, 0.f, 0.f, 0.f};  // DIAG: the current 8-block group's columns
  float dsum[2] = {0.f, 0.f};            // DIAG: rows g and g + 8, this lane's two blocks of every group
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[c][r] = 0.f;

  auto compute = [&](int buf, const uint4 (&wq)[KA], const uint2 (&sc)[KA]) {
    const u32 so = buf * STAGE;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kk = a * 4 + j;
        u32 bf[FC][2];
        if (FC == 2) vbw::ldsm_x4(bf[0][0], bf[0][1], bf[1][0], bf[1][1], b_addr[kk & 3] + so + (kk >> 2) * 128);
        else vbw::ldsm_x2(bf[0][0], bf[0][1], b_addr[kk & 3] + so + (kk >> 2) * 128);
        const u32 q = j == 0 ? wq[a].x : j == 1 ? wq[a].y : j == 2 ? wq[a].z : wq[a].w;
        u32 af[4];
        if constexpr (DIAG) {
          decode_word<OT>(q, af);
          if (same<OT, __nv_bfloat16>::value) {
#pragma unroll
            for (int r = 0; r < 4; ++r) af[r] = mul2<OT>(af[r], exact_k2<OT>());
          }
          mma<OT>(part, af, bf[0][0], bf[0][1]);
        } else {
          decode_sir<OT, BLK>(q, sc[a].x, BLK == 16 ? sc[a].y : sc[a].x >> 16, j, af);
#pragma unroll
          for (int c = 0; c < FC; ++c) mma<OT>(acc[c], af, bf[c][0], bf[c][1]);
        }
      }
      if constexpr (DIAG) {
        if ((a + 1) % GA == 0) {  // end of an 8-block group: columns 2t, 2t + 1 are blocks 2t, 2t + 1
          u32 wg_, wg8;
          if (BLK == 16) {  // 4 blocks per atom: blocks 2t, 2t+1 are bytes 2(t&1), +1 of atom t >> 1
            const uint2 s = (t >> 1) ? sc[a - GA + 2] : sc[a - GA + 1];
            wg_ = s.x; wg8 = s.y;
          } else {          // 2 blocks per atom: atom t, row g in bytes 0-1, row g + 8 in bytes 2-3
            const u32 s = t == 0 ? sc[a - GA + 1].x : t == 1 ? sc[a - GA + 2].x : t == 2 ? sc[a - GA + 3].x : sc[a].x;
            wg_ = s; wg8 = s >> 16;
          }
          const u32 sh = BLK == 16 ? (t & 1) * 2 : 0;  // first byte
          // [byte] -> bits 16..23 (byte_perm with 0x4 selectors = zero bytes)
          const u32 c0 = __byte_perm(wg_, 0u, 0x4044u | (sh << 8)), c1 = __byte_perm(wg_, 0u, 0x4044u | ((sh + 1) << 8));
          const u32 c2 = __byte_perm(wg8, 0u, 0x4044u | (sh << 8)), c3 = __byte_perm(wg8, 0u, 0x4044u | ((sh + 1) << 8));
          dsum[0] = fmaf(part[0], diag_mult<OT>(c0), fmaf(part[1], diag_mult<OT>(c1), dsum[0]));
          dsum[1] = fmaf(part[2], diag_mult<OT>(c2), fmaf(part[3], diag_mult<OT>(c3), dsum[1]));
#pragma unroll
          for (int r = 0; r < 4; ++r) part[r] = 0.f;
        }
      }
    }
  };

  // STAGES - 1 k-tiles in flight for both operands: the activation ring in shared memory and the weights in
  // STAGES register buffers. The k-loop is unrolled by STAGES, so buffer and stage indices are static.
  // The weights are constants, so their first k-tiles are requested before waiting on the kernel before this
  // one (programmatic dependent launch, pdl.cuh); the activations and everything written come after.
  uint4 wq[STAGES][KA];
  uint2 sc[STAGES][KA];
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < nk) load_w(wq[s], sc[s]);
  vbw::pdl_wait();
  vbw::pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_act(kt0 + s, s);
    vbw::cp_async_commit();
  }
  for (int it0 = 0; it0 < nk; it0 += STAGES) {
#pragma unroll
    for (int b = 0; b < STAGES; ++b) {
      const int it = it0 + b;
      if (it < nk) {
        vbw::cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int pf = it + STAGES - 1;
        if (pf < nk) {
          load_act(kt0 + pf, (b + STAGES - 1) % STAGES);
          load_w(wq[(b + STAGES - 1) % STAGES], sc[(b + STAGES - 1) % STAGES]);
        }
        vbw::cp_async_commit();
        compute(b, wq[b], sc[b]);
      }
    }
  }
  vbw::cp_async_wait<0>();

  if constexpr (DIAG) {  // sum each row over the quad's 8 blocks; column 0 (token 0) is lane t = 0's
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    }
    acc[0][0] = dsum[0]; acc[0][2] = dsum[1]; acc[0][1] = acc[0][3] = 0.f;
  }
  constexpr int NACC = FC * 4;
  float flat[NACC];
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) flat[c * 4 + r] = acc[c][r];
  if constexpr (CL > 1) {
    static_assert(NACC * NT * 4 <= STAGES * STAGE, "the partials go through the drained ring");
    __syncthreads();  // every warp is past its last ldmatrix
    if (!cluster_reduce<NACC, NT, CL>(flat, reinterpret_cast<float*>(smem))) return;
  } else if (!splitk_reduce<NACC, NT>(flat, ws, counters)) {
    return;
  }
  if (!rg_ok) return;
#pragma unroll
  for (int c = 0; c < FC; ++c)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int n = rg * 16 + g + ((r & 2) ? 8 : 0);
      const int m = m0 + c * 8 + 2 * t + (r & 1);
      if (n < N && m < M && (!DIAG || t == 0)) store_out(out, bias, flags, n, m, N, flat[c * 4 + r] * out_scale);
    }
}

// The two wgmma kernels' ending: split-K reduction (only the tile's last CTA goes on), then the epilogue.
// Accumulator acc[4i + r] of thread t (in its quad) holds out[nbase + 8 * (r >> 1)][m0 + 8i + 2t + (r & 1)].
// Epilogue of the wgmma kernels (CTA tile: BR weight rows n x BC tokens m, after split-K). The fp32 tile goes
// through shared memory (the drained ring; rows of BR + 4 floats, so the accumulator-layout writes hit 32
// distinct banks), then each thread finishes 8 consecutive n of one token row: bias, activation and
// conversion in a loop, 16-byte stores along the output's rows. (Per element from the accumulators, the
// stores were 2-byte writes N apart and a call each.)
template <int BR, int BC, int NACC, int NT>
__device__ __forceinline__ void wg_finish(float (&acc)[NACC], void* __restrict__ ws, int* __restrict__ counters,
                                          u8* smem, int rg0, int m0, int N, int M, void* __restrict__ out,
                                          const void* __restrict__ bias, int flags, float out_scale) {
  if (!splitk_reduce<NACC, NT>(acc, ws, counters)) return;
  constexpr int LDT = BR + 4, CPR = BR / 8;
  static_assert(NT % CPR == 0, "epilogue mapping");
  float* tile = reinterpret_cast<float*>(smem);
  {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, nl = (threadIdx.x >> 5) * 16 + g;
    __syncthreads();  // every warp is done with the ring
#pragma unroll
    for (int i = 0; i < BC / 8; ++i)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        tile[(i * 8 + 2 * t + (r & 1)) * LDT + nl + ((r & 2) ? 8 : 0)] = acc[4 * i + r] * out_scale;
    __syncthreads();
  }
  const int col = (threadIdx.x % CPR) * 8, n0 = rg0 * 16 + col;
  float bv[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) bv[e] = n0 + e < N ? bias_at(bias, flags, n0 + e) : 0.f;
  const int ok = (flags >> 8) & 3, es = ok == 2 ? 4 : 2;
  const bool vec = n0 + 8 <= N && (N * es) % 16 == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;
#pragma unroll 1
  for (int rr = threadIdx.x / CPR; rr < BC && m0 + rr < M; rr += NT / CPR) {
    float v[8];
    const float4 a = *reinterpret_cast<const float4*>(tile + rr * LDT + col);
    const float4 b = *reinterpret_cast<const float4*>(tile + rr * LDT + col + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = activate(v[e] + bv[e], flags);
    vbw_gemm::store8(out, (size_t)(m0 + rr) * (size_t)N + (size_t)n0, v, N - n0, flags, vec);
  }
}

// ---------------------------------------------------------------------------------------------- wgmma (sm_90a)
// Helpers (WgmmaSS / WgmmaRS, fences, descriptors) live in wgmma.cuh.
using vbw::WgmmaSS;
using vbw::WgmmaRS;
using vbw::wg_fence;
using vbw::wg_commit;
using vbw::wg_wait;
using vbw::fence_async_smem;
using vbw::named_bar;
using vbw::keep_acc;
using vbw::keep_regs;
using vbw::desc_sw128_k;

// CTA = WGS warpgroups x 64 weight rows, BC tokens, BK = 64 (one atom per warp per k-tile). cp.async ring of
// STAGES (activation tile in 128B-swizzled rows + the raw FP4 atoms); each warp decodes its atom (SIR) into a
// double-buffered, 128B-swizzled f16/bf16 A tile in shared memory, then wgmma SS (A and B from smem). Decode
// of tile it+1 overlaps wgmma of tile it (wait_group 1). Prefetch distance STAGES-2 tiles.
template <typename T, int BLK, int BC, int WGS, int STAGES>
__global__ void __launch_bounds__(128 * WGS, 1)
fp4_gemm_wgmma(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
               const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
               int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!same<T, float>::value, "wgmma path: float16 / bfloat16 activations");
  static_assert(STAGES >= 4 && (BC == 64 || BC == 128 || BC == 256), "wgmma config");
  using OT = T;
  constexpr int NT = 128 * WGS, BR = 64 * WGS, ATOM = atom_bytes(BLK);
  constexpr int B_BYTES = BC * 128, W_BYTES = (BR / 16) * ATOM;
  constexpr int STAGE = (B_BYTES + W_BYTES + 1023) / 1024 * 1024;
  static_assert(BC * (BR + 4) * 4 <= STAGES * STAGE, "the epilogue's fp32 tile fits the ring (wg_finish)");
  constexpr int A_BYTES = BR * 128;
  constexpr int NACC = BC / 2;
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw = vbw::smem_addr(smem_raw);
  u8* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const u32 sbase = vbw::smem_addr(smem);
  u8* abuf = smem + STAGES * STAGE;  // 2 x A_BYTES
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(katoms, kt0 + kt_per_split) - kt0);

  // Per-thread copy plan, fixed over the k-tiles.
  constexpr int ACH = BC * 8, AIT = (ACH + NT - 1) / NT;
  constexpr int CPA = ATOM / 16, WCH = (BR / 16) * CPA, WIT = (WCH + NT - 1) / NT;
  const int a_ch = tid & 7, a_r0 = tid >> 3;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * 8;
  size_t w_off[WIT];
  int w_atom[WIT];  // all 0: one atom per row group and stage
  const unsigned w_ok = weight_copy_plan<WIT, NT, CPA, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  auto load_stage = [&](int kt, int buf) {
    u8* sb = smem + buf * STAGE;
    u8* sw = sb + B_BYTES;
    const bool k_ok = kt * 64 + a_ch * 8 < K;
#pragma unroll
    for (int i = 0; i < AIT; ++i) {
      const int r = a_r0 + i * (NT / 8);
      if (ACH % NT == 0 || r < BC) {
        const bool ok = k_ok && m0 + r < M;
        const T* src = a_base + (size_t)i * (NT / 8) * lda + (size_t)kt * 64;
        vbw::cp_async_16(vbw::smem_addr(sb + r * 128 + ((a_ch ^ (r & 7)) << 4)), ok ? (const void*)src : (const void*)A, ok);
      }
    }
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = (w_ok >> i) & 1u;
        const u8* src = Wp + w_off[i] + (size_t)kt * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
  };
  // This warp's atom of tile `buf` -> its 16 rows of A buffer `ab` (f16/bf16, exact e2m1 * u, swizzled).
  auto decode_atom = [&](int buf, int ab) {
    const u8* ap = smem + buf * STAGE + B_BYTES + warp * ATOM;
    const uint4 wq = *reinterpret_cast<const uint4*>(ap + lane * 16);
    u32 s0, s1;
    if (BLK == 16) {
      const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
      s0 = s.x; s1 = s.y;
    } else {
      s0 = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
      s1 = s0 >> 16;
    }
    u8* arow0 = abuf + ab * A_BYTES + (warp * 16 + g) * 128;
    u8* arow1 = arow0 + 8 * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 q = j == 0 ? wq.x : j == 1 ? wq.y : j == 2 ? wq.z : wq.w;
      u32 f[4];
      decode_sir<OT, BLK>(q, s0, s1, j, f);
      const int c0 = ((2 * j) ^ g) << 4, c1 = ((2 * j + 1) ^ g) << 4;
      *reinterpret_cast<u32*>(arow0 + c0 + 4 * t) = f[0];
      *reinterpret_cast<u32*>(arow1 + c0 + 4 * t) = f[1];
      *reinterpret_cast<u32*>(arow0 + c1 + 4 * t) = f[2];
      *reinterpret_cast<u32*>(arow1 + c1 + 4 * t) = f[3];
    }
    fence_async_smem();
    named_bar(1 + wg, 128);  // the warpgroup's 64 rows are written before its wgmma reads them
  };

  float acc[NACC];
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }
  if (nk > 0) {
    vbw::cp_async_wait<STAGES - 3>();
    fence_async_smem();
    __syncthreads();
    decode_atom(0, 0);
  }
  const u32 a_wg = vbw::smem_addr(abuf) + wg * 64 * 128;
  for (int it = 0; it < nk; ++it) {
    const int buf = it % STAGES;
    keep_acc(acc);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j)
      WgmmaSS<OT, BC>::run(acc, desc_sw128_k(a_wg + (it & 1) * A_BYTES + j * 32),
                           desc_sw128_k(sbase + buf * STAGE + j * 32));
    wg_commit();
    if (it + 1 < nk) {
      vbw::cp_async_wait<STAGES - 4>();  // tile it+1 landed (this thread's copies)
      fence_async_smem();
      __syncthreads();                   // ... everyone's; every warpgroup finished wgmma of tile it-1
      const int pf = it + STAGES - 2;    // refills the buffer of tile it-2
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
      wg_wait<1>();                      // this warpgroup's wgmma of tile it-1 done: A buffer (it+1)&1 is free
      keep_acc(acc);
      decode_atom((it + 1) % STAGES, (it + 1) & 1);
    }
  }
  wg_wait<0>();
  keep_acc(acc);
  vbw::cp_async_wait<0>();

  wg_finish<BR, BC, NACC, NT>(acc, ws, counters, smem, rg0, m0, N, M, out, bias, flags, out_scale);
#else
  __trap();  // Hopper only: gemm.py never launches it elsewhere
#endif
}


// ---------------------------------------------------------------------------------------------- wgmma, A in registers
// Register-A variant (Machete-like): each warp's decoded fragments feed wgmma straight from registers, B (the
// activations) from 128B-swizzled smem; KSUB 64-k sub-tiles per stage. ptxas serializes wgmma when an A
// register is written while any wgmma is in flight, so every k-tile drains (wait_group 0) before the next
// decode; the two warpgroups overlap each other, and KSUB = 2 halves the drains per FLOP.
template <typename T, int BLK, int BC, int WGS, int STAGES, int KSUB, bool TMA>
__global__ void __launch_bounds__(128 * WGS, 1)
fp4_gemm_wgrs(const T* __restrict__ A, const u8* __restrict__ Wp, void* __restrict__ out,
              const void* __restrict__ bias, void* __restrict__ ws, int* __restrict__ counters,
              int M, int N, int K, int lda, int katoms, int kt_per_split, float out_scale, int flags,
              const __grid_constant__ vbw::TmaDesc tm_a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!same<T, float>::value, "wgmma path: float16 / bfloat16 activations");
  static_assert(STAGES >= 3 && (BC == 64 || BC == 128 || BC == 256) && (KSUB == 1 || KSUB == 2), "wgmma config");
  using OT = T;
  constexpr int NT = 128 * WGS, BR = 64 * WGS, ATOM = atom_bytes(BLK);
  constexpr int SUB = BC * 128;                               // one 64-k activation sub-tile
  constexpr int B_BYTES = KSUB * SUB, W_BYTES = (BR / 16) * KSUB * ATOM;
  constexpr int STAGE = (B_BYTES + W_BYTES + 1023) / 1024 * 1024;
  static_assert(BC * (BR + 4) * 4 <= STAGES * STAGE, "the epilogue's fp32 tile fits the ring (wg_finish)");
  constexpr int NACC = BC / 2;
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw = vbw::smem_addr(smem_raw);
  u8* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const u32 sbase = vbw::smem_addr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_rg = (N + 15) >> 4;
  const int rg0 = blockIdx.x * (BR / 16);
  const int m0 = blockIdx.y * BC;
  const int nkt = (katoms + KSUB - 1) / KSUB;
  const int kt0 = blockIdx.z * kt_per_split;
  const int nk = max(0, min(nkt, kt0 + kt_per_split) - kt0);

  // Per-thread copy plan, fixed over the k-tiles.
  constexpr int ACH = BC * 8, AIT = (ACH + NT - 1) / NT;
  constexpr int CPA = ATOM / 16, CPR = KSUB * CPA, WCH = (BR / 16) * CPR, WIT = (WCH + NT - 1) / NT;
  const int a_ch = tid & 7, a_r0 = tid >> 3;
  const T* a_base = A + (size_t)(m0 + a_r0) * lda + a_ch * 8;
  size_t w_off[TMA ? 1 : WIT];
  int w_atom[TMA ? 1 : WIT];
  unsigned w_ok = 0;
  if constexpr (!TMA) w_ok = weight_copy_plan<WIT, NT, CPR, CPA, WCH, ATOM>(tid, rg0, n_rg, katoms, w_off, w_atom);
  // TMA: buffer b's mbarrier at bar0 + 8 b; the j-th k-tile of this CTA is that buffer's fill j / STAGES.
  const u32 bar0 = sbase + STAGES * STAGE;
  if constexpr (TMA) {
    if (tid == 0)
      for (int b = 0; b < STAGES; ++b) vbw::mbar_init(bar0 + 8 * b, 1);
    __syncthreads();
  }
  auto load_stage = [&](int kt, int buf) {
    if constexpr (TMA) {
      // One thread: the activation sub-tiles by TMA (rows past M and k past K zero-filled; the map's 128-byte
      // swizzle is this layout), each 16-row group's atoms by bulk copies. Atoms past katoms and row groups
      // past n_rg re-read the last real ones: finite SIR weights times zero activations, or rows never stored.
      if (tid == 0) {
        const u32 sb = sbase + buf * STAGE, bar = bar0 + 8 * buf;
        vbw::mbar_expect_tx(bar, B_BYTES + W_BYTES);
#pragma unroll
        for (int u = 0; u < KSUB; ++u) vbw::tma_load_2d(sb + u * SUB, &tm_a, bar, (kt * KSUB + u) * 64, m0);
#pragma unroll
        for (int r = 0; r < BR / 16; ++r)
#pragma unroll
          for (int u = 0; u < KSUB; ++u) {
            const size_t at = (size_t)min(rg0 + r, n_rg - 1) * katoms + min(kt * KSUB + u, katoms - 1);
            vbw::bulk_load(sb + B_BYTES + (r * KSUB + u) * ATOM, Wp + at * ATOM, ATOM, bar);
          }
      }
      return;
    }
    u8* sb = smem + buf * STAGE;
    u8* sw = sb + B_BYTES;
#pragma unroll
    for (int u = 0; u < KSUB; ++u) {
      const int kb = (kt * KSUB + u) * 64;
      const bool k_ok = kb + a_ch * 8 < K;
#pragma unroll
      for (int i = 0; i < AIT; ++i) {
        const int r = a_r0 + i * (NT / 8);
        if (ACH % NT == 0 || r < BC) {
          const bool ok = k_ok && m0 + r < M;
          const T* src = a_base + (size_t)i * (NT / 8) * lda + kb;
          vbw::cp_async_16(vbw::smem_addr(sb + u * SUB + r * 128 + ((a_ch ^ (r & 7)) << 4)),
                           ok ? (const void*)src : (const void*)A, ok);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < WIT; ++i) {
      const int c = tid + i * NT;
      if (WCH % NT == 0 || c < WCH) {
        const bool ok = ((w_ok >> i) & 1u) && kt * KSUB + w_atom[i] < katoms;
        const u8* src = Wp + w_off[i] + (size_t)kt * KSUB * ATOM;
        vbw::cp_async_16(vbw::smem_addr(sw + c * 16), ok ? (const void*)src : (const void*)Wp, ok);
      }
    }
  };

  float acc[NACC];
#pragma unroll
  for (int r = 0; r < NACC; ++r) acc[r] = 0.f;

  // Per k-tile: decode this warp's KSUB atoms into A registers -> 4*KSUB wgmma (B from smem) -> while they
  // run: wait for the next stage, barrier, refill the freed buffer, load the next raw words -> drain.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(kt0 + s, s);
    vbw::cp_async_commit();
  }
  uint4 wq[KSUB];
  u32 s0[KSUB], s1[KSUB];
  auto load_words = [&](int buf) {
#pragma unroll
    for (int u = 0; u < KSUB; ++u) {
      const u8* ap = smem + buf * STAGE + B_BYTES + (warp * KSUB + u) * ATOM;
      wq[u] = *reinterpret_cast<const uint4*>(ap + lane * 16);
      if (BLK == 16) {
        const uint2 s = *reinterpret_cast<const uint2*>(ap + 512 + g * 8);
        s0[u] = s.x; s1[u] = s.y;
      } else {
        s0[u] = *reinterpret_cast<const u32*>(ap + 512 + g * 4);
        s1[u] = s0[u] >> 16;
      }
    }
  };
  if (nk > 0) {
    if constexpr (TMA) {
      vbw::mbar_wait(bar0, 0);
    } else {
      vbw::cp_async_wait<STAGES - 2>();
      fence_async_smem();
      __syncthreads();
    }
    load_words(0);
  }
  for (int it = 0; it < nk; ++it) {
    const int buf = it % STAGES;
    u32 af[16 * KSUB];
#pragma unroll
    for (int u = 0; u < KSUB; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 q = j == 0 ? wq[u].x : j == 1 ? wq[u].y : j == 2 ? wq[u].z : wq[u].w;
        u32 f[4];
        decode_sir<OT, BLK>(q, s0[u], s1[u], j, f);
#pragma unroll
        for (int r = 0; r < 4; ++r) af[16 * u + 4 * j + r] = f[r];
      }
    u64 desc[4 * KSUB];
#pragma unroll
    for (int u = 0; u < KSUB; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        desc[4 * u + j] = desc_sw128_k(sbase + buf * STAGE + u * SUB + j * 32);
        asm volatile("" : "+l"(desc[4 * u + j]) :: "memory");
      }
    keep_regs(af);
    keep_acc(acc);
    wg_fence();
#pragma unroll
    for (int x = 0; x < 4 * KSUB; ++x)
      WgmmaRS<OT, BC>::run(acc, af[4 * x], af[4 * x + 1], af[4 * x + 2], af[4 * x + 3], desc[x]);
    wg_commit();
    if (it + 1 < nk) {
      if constexpr (!TMA) {
        vbw::cp_async_wait<STAGES - 3>();  // groups committed: STAGES-1 + it; tile it+1 is group it+1
        fence_async_smem();
      }
      __syncthreads();  // (cp.async: tile it+1 landed everywhere;) every warpgroup drained tile it-1 (its buffer is free)
      const int pf = it + STAGES - 1;
      if (pf < nk) load_stage(kt0 + pf, pf % STAGES);
      vbw::cp_async_commit();
      if constexpr (TMA) vbw::mbar_wait(bar0 + 8 * ((it + 1) % STAGES), (u32)((it + 1) / STAGES) & 1u);
      load_words((it + 1) % STAGES);
    }
    wg_wait<0>();
    keep_regs(af);
    keep_acc(acc);
  }
  vbw::cp_async_wait<0>();

  wg_finish<BR, BC, NACC, NT>(acc, ws, counters, smem, rg0, m0, N, M, out, bias, flags, out_scale);
#else
  __trap();  // Hopper only: gemm.py never launches it elsewhere
#endif
}


}  // namespace vbw_fp4gemm
