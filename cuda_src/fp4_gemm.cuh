// fp4_gemm.cuh: W4A16 GEMM with FP4 weights on tensor cores: the weight layout, the exact scale modes, what the
// kernels share (decode, MMA, split-K reductions, the weight copy plan), the kernel list and the history.
// The kernels: fp4_gemm_sm80.cu (prepare, scale range, mma.sync, mmv: any sm_80+), fp4_gemm_sm90.cu (wgmma, wgrs).
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
//   the per-block fp32 partial, partials summed in fp64: error ~1e-7, in docs/accuracy.md's float32 bound.
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
//   fp4_gemm_mmvk  <T, BLK, PU>: the M = 1 default (DIAG as above). K is split among the warps of one CTA
//      (4, 8 or 16 k-parts of a row group, by how the CTAs fill whole waves: gemm._mmvk_split), each warp
//      streaming its atoms and its own slice of the activation row straight into registers (the B fragment is
//      built by masking: lane g's column is block g); the k-parts meet once in shared memory. No activation
//      ring, barrier per k-tile or split-K workspace. PU = 1: the next 4-atom unit is requested after the
//      current one is computed (54-61 registers, 32 warps an SM); PU = 2 (82 registers) measured 10-20% slower.
//      FLAG_SWIGLU8: silu(gate) * up of gate / up rows interleaved by 8, in the epilogue (the model's decode).
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
// History (the full log: notes/kernel-history.md, section fp4_gemm.cu, as the file was called until 2026-11-25). nvfp4, fp16 activations, N = K = 8192
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
//   v10 (H100) fp4_gemm_mmvk for M = 1, graph replay against bench/bare_read.py's read of the same bytes:
//      nvfp4 8192^2 16.0 us (1.09x; mmvd 18.9, 1.28x), 14336x4096 1.16x, 4096x14336 1.13x, 28672x4096 1.14x,
//      4096^2 6.4 us (0.93x; mmvd 9.3). ncu (8192^2): ~100 instructions an atom either way, issue 45% busy; the
//      gain is occupancy (32 warps an SM, no barrier) (notes/session-2026-11-26c.md).
#pragma once
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

// Split-K: write this CTA's partial, the last CTA of the tile sums all of them (fixed order) into acc
// (vbw_gemm::split_parts_reduce). Returns false for the CTAs that must stop. acc is a flat register array of NACC
// values per thread.
template <int NACC, int NT, typename Acc>
__device__ __forceinline__ bool splitk_reduce(Acc (&acc)[NACC], void* ws, int* counters) {
  const int nsplit = gridDim.z;
  if (nsplit == 1) return true;
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  return vbw_gemm::split_parts_reduce<NACC, NT>(acc, static_cast<Acc*>(ws) + (size_t)tile * nsplit * NACC * NT,
                                                (int)blockIdx.z, nsplit, counters + tile, (int)threadIdx.x,
                                                [](bool v) { return __syncthreads_or(v) != 0; });
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


}  // namespace vbw_fp4gemm
