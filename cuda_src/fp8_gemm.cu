// fp8_gemm.cu: W4A4 (MXFP4 x MXFP4) and W4A8 (FP8 rows x MXFP4) GEMM on Hopper's FP8 tensor cores.
//
//   out[m, n] = act( sum_k a[m, k] * w[n, k] + bias[n] )        a [M, K] and w [N, K] MXFP4 (E2M1, E8M0 per 32 k)
//
// Exact scheme. Every E2M1 value is exact in FP8 e4m3, so both operands go to the tensor cores as e4m3 bytes:
//   weights (once, mx_to_e4m3<true>, cached by gemm.py): row n's values become e2m1 * 2^(e_b - s_n), e_b the
//     block's exponent and s_n = max_b e_b - 6, exact in e4m3 while every nonzero block of the row lies within
//     13 binades of its largest (the row is flagged otherwise and gemm.py keeps the float32 path); the factor
//     2^s_n (times the tensor scale) is applied in the epilogue.
//   activations (per call, mx_to_e4m3<false>): bare e2m1 values; their block scales stay apart. Each k32 step's
//     wgmma writes a fresh fp32 partial over one MXFP4 block, which is multiplied by the token's block scale and
//     added to the fp32 accumulator: products by powers of two, exact; one FFMA per accumulator per 32 k.
//   So the roundings are the tensor core's within a k-tile's partial (4 chained wgmmas: 128 products; its FP8
//   accumulation keeps ~14 bits, hence one fp32 promotion per tile, as DeepGEMM does) and the fp32 additions.
//   The fp32 accumulator holds result / 2^s_n: gemm.py keeps weights with 2^s_n past 2^+-64 off this path.
// Layout: A8 [M, Kp], W8 [N, Kp] e4m3 bytes, k contiguous (Kp = 32 * blocks), loaded by TMA as 128-byte swizzled
//   rows of 128 k (one k-tile = 4 blocks), zero-filled past M, N and Kp; mult [M, blocks] float32 (the scale of
//   each of a token's blocks: 2^s of its chunk, or the block's own), row_bad [M]; w_scale [N] float32.
//   W4A8 (row_scales = 1): A8 holds an FP8Tensor's codes as given (cuda_src/fp8_codec.cu: E4M3 with a
//   power-of-two scale per token row), mult [M] is that scale, the multiplier of every k-tile; row_bad unused.
// Tiling: fp8_gemm_mx<BN, STAGES, CM>: tile = 128 tokens x BN weight rows (BN = 192 by default, STAGES 4; 128 keeps
//   two partial sets, STAGES 5). CM = 2 (the default): clusters of two CTAs take token tiles 2u and 2u + 1 of
//   the same weight tile, each loading its own A box and half of the W rows by TMA multicast into both.
//   Persistent: one CTA per SM (gemm.py launches CM * min(units, SMs / CM)); cluster c runs units c,
//   c + clusters, ... 384 threads: a producer warpgroup (setmaxnreg down to 40 registers; one thread issues
//   the TMA boxes of each k-tile, over all of the CTA's tiles, into a STAGES ring as soon as the buffer's
//   empty mbarrier says all 8 * CM consumer warps of the cluster released it) and two consumer warpgroups of 64
//   tokens each (setmaxnreg up to 232). Per k-tile a warpgroup runs 4 wgmma m64nBNk32 from shared memory into
//   a partial set and scales it into the accumulators (BN = 128: tiles in pairs, the first scaled in while
//   the second runs); the token multipliers of a k-tile are loaded one tile early; a tile with a row_bad token
//   scales per block instead.
//   The last round of units, when at most half full, is split along K (stream-K tail, split_finish; v7).
//   Epilogue (see v6 below): finished in registers and staged as 2-byte outputs, or (gelu / silu) staged as fp32
//   in two half-tile passes, in each consumer warpgroup's own area after the ring (named barrier 2 +
//   warpgroup), 16-byte stores, while the producer already fills the ring with the next tile. Tiles in groups
//   of 8 token tiles.
// History (H100, M = 4096, TFLOP/s of the call including the activations' conversion; cuBLAS fp16 717-783 and
// torch's FP8 _scaled_mm 1341-1395 in the same runs):
//   v1 one scale per 32 k (a fresh wgmma partial per block, scaled in with one FFMA per accumulator): 8192^2
//      364-387. The FFMAs cost as much as the MMAs (1 per 32 MACs: the SM's fp32 rate is 1/32 of its FP8 rate);
//      without them 775, with no scales at all 752 (the same pipeline).
//   v2 activations re-based per 128-k chunk, one FFMA per 128 MACs: 8192^2 652-681 (0.90x cuBLAS fp16),
//      14336x4096 526 (0.67x), 4096x14336 704 (0.95x), bias + SiLU 506 (the per-element epilogue); a tile
//      with a chunk that does not fit (per-32 path) 462. W4A16 on the dequantized activations: 721.
//   v3 thread 0 issues the free buffers without waiting (a blocking refill tied the two warpgroups together),
//      staged epilogue with 16-byte stores: +2-3% and +7-18% in one run (A/B by compile switches, since
//      removed). BN = 192 with one partial set: +9-15% over BN = 128 in one run; that run (a slower
//      lease): 8192^2 624-636 (0.83-0.86x cuBLAS fp16), 14336x4096 535-544 (0.75x), 4096x14336 580-591 (0.79x).
//   v4 (ncu: tensor pipe 40% busy, warps waiting on the full barrier 18% and on wgmma 21% of samples; L2 45%,
//      so not bandwidth) a producer warpgroup in place of thread 0 between its own tiles: 8192^2 677 -> 790
//      (1.06x cuBLAS fp16), 14336x4096 548-602 -> 683-698, 4096x14336 570-654 -> 758-767 (same run). Tried and
//      dropped: clusters of 2 token tiles sharing the weight tile by TMA multicast, 372-403 (the W share halved,
//      but each CTA waits for the other's consumers); BN = 128 with the producer 2-4% behind BN = 192.
//      Bias + SiLU cost 245 us of 940 at 8192^2: outputs below -87 sent SiLU's division down its slow path
//      (gemm_epilogue.cuh now computes v * e^v there).
//   v5 persistent CTAs (one per SM), epilogue staged per warpgroup outside the ring (so 3 stages at BN = 192):
//      one run against v4, 8192^2 742-753 -> 798-803, 14336x4096 643-653 -> 693-699, 4096x14336 706-741 ->
//      756-761, M = 2048 654-709 -> 732-735, bias + SiLU 629-633 -> 641-645 (that lease ran v4 ~7% slower
//      than the last). BN = 128 persistent (4 stages): 1-9% behind except at M = 2048.
//   v6 (2026-11-25) clusters of 2 sharing the W tile (v4's 2x slowdown was a cluster-scope release on every
//      remote arrive); the epilogue finished in registers with 2-byte staging (gelu / silu: scale and bias in
//      registers, fp32 staging in two passes); 4 stages; conversion a thread per block. GEMM alone, H100:
//      8192^2 ~890 -> 1098, 14336x4096 ~740 -> 1006, 4096x14336 ~900 -> 989; bias + silu 705 -> 815.
//   v7 stream-K tail (the last, at most half-full round split along K): 4096x14336 851 -> 921 (whole call).
//      bench --w4a4, H100: 1.35x / 1.38x / 1.21x cuBLAS fp16, bias + SiLU 0.92x. The full log, what was tried
//      (BN 176, SiLU in registers, a fused conversion) and ncu readings: notes/kernel-history.md.
//   v8 W4A8: an FP8Tensor's codes loaded as given (row_scales: mult[row] is every k-tile's multiplier): H100,
//      two runs, 8192^2 1.28-1.42x cuBLAS fp16, 14336x4096 1.39-1.50x, 4096x14336 1.33-1.39x (W4A4 same runs
//      1.28-1.37x, 1.38-1.44x, 1.16-1.18x).
//   v9 (2026-11-27) convert_block: the exponent raised in the two table words once a block (was __vadd4 /
//      __vcmpne4 per 4 values, ~10 emulation instructions) and the signs moved by a second byte permutation: the
//      activations' conversion at 4096 x 14336 38.8 -> 36.8 us (0.89 of copy). bench_fp4_gemm with ours and
//      cuBLAS fp16 in alternating rounds (H100): W4A4 1.21 / 1.19 / 1.19x, W4A8 1.13-1.29x; timed ours-first
//      (as every figure above) the same kernels read W4A4 1.20-1.36x, W4A8 1.33-1.43x: the power-capped card
//      flatters whichever runs first. Tried, not kept: the conversion inside the GEMM, in the consumer
//      warpgroups or in the producer warpgroup (registers moved to it, raw boxes by TMA): correct, both 2x slower
//      (the converting warps cannot issue ~280 instructions a k-tile and thread in a k-tile's time;
//      notes/attempts/fp8-fused-conversion-*).
//   Next: silu's epilogue.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma.cuh"
#include "fp4.cuh"
#include "wgmma.cuh"
#include "gemm_epilogue.cuh"

namespace vbw_fp8gemm {

using vbw::u32;
using vbw::u64;
typedef unsigned char u8;

// The e4m3 code of E2M1 code c (sign in bit 3) times 2^d, d in [-7, 6]: exact (magnitudes 1 or 1.5 times 2^q
// with q in [-8, 8]; q < -6 are e4m3 subnormals, units of 2^-9).
__device__ __forceinline__ u32 e2m1_to_e4m3(u32 c, int d) {
  const u32 mag = c & 7u, sign = (c & 8u) << 4;
  if (mag == 0u) return sign;
  const int p = mag == 1u ? -1 : (int)(mag >> 1) - 1;  // 0.5 = 1 x 2^-1; mag 2..7 = (1 + (mag & 1) / 2) x 2^(mag/2 - 1)
  const u32 m = mag == 1u ? 0u : (mag & 1u);
  const int q = p + d;
  if (q >= -6) return sign | ((u32)(q + 7) << 3) | (m << 2);
  return sign | ((2u + m) << (q + 8));
}

// One block's 16 bytes of E2M1 pairs -> its 32 e4m3 bytes at dst (16-byte aligned), each value times 2^d.
// For d in [-5, 6] every result is a normal e4m3 number, whose exponent field is the bare value's plus d: a byte
// permutation of the 8 codes of the magnitudes (their exponent fields raised by d once a block: no byte carries,
// every nonzero code stays in 0x08..0x7c) selected by each nibble's magnitude bits, and a second one that moves
// the sign bits (bit 3 of each nibble) to bit 7 of each byte: 10 instructions per 8 values. Other d go one value
// at a time.
__device__ __forceinline__ void convert_block(uint4 v, int d, u32 (&packed)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
  if (d >= -5) {
    const u32 lo = 0x3c383000u + (u32)d * 0x08080800u;  // e4m3 of 0, 0.5, 1, 1.5 times 2^d
    const u32 hi = 0x4c484440u + (u32)d * 0x08080808u;  // 2, 3, 4, 6
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 m = w[i] & 0x77777777u, s = w[i] & 0x88888888u, s4 = s << 4;
      // byte j of s4 holds the sign of value 2j at bit 7, byte j of s that of value 2j + 1
      packed[2 * i] = (__byte_perm(s, s4, 0x1504u) & 0x80808080u) | __byte_perm(lo, hi, m);
      packed[2 * i + 1] = (__byte_perm(s, s4, 0x3726u) & 0x80808080u) | __byte_perm(lo, hi, m >> 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // the 4 nibbles of bytes 2h, 2h + 1 of word i -> one word of 4 e4m3 bytes
        const u32 x = w[i] >> (16 * h);
        packed[2 * i + h] = e2m1_to_e4m3(x & 15u, d) | (e2m1_to_e4m3((x >> 4) & 15u, d) << 8) |
                            (e2m1_to_e4m3((x >> 8) & 15u, d) << 16) | (e2m1_to_e4m3((x >> 12) & 15u, d) << 24);
      }
  }
}
__device__ __forceinline__ void store_block(u8* dst, uint4 v, int d) {
  u32 packed[8];
  convert_block(v, d, packed);
  uint4* o = reinterpret_cast<uint4*>(dst);
  o[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  o[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// The weights, once: one CTA (256 threads) per row r of an MXFP4 tensor, data [R, nb * 16] (element 2i in the low
// nibble of byte i), scales [R, nb] E8M0 -> q [R, nb * 32] e4m3 = e2m1 * 2^(e_b - s_r), row_scale[r] = 2^s_r with
// s_r = max e_b - 6 over the nonzero blocks (0 for an all-zero row), bad[r] = 1 when a nonzero block lies more
// than 13 binades below the largest or a block has the NaN scale code (gemm.py then keeps the float32 path).
__global__ void __launch_bounds__(256) mx_to_e4m3_rows(const u8* __restrict__ data, const u8* __restrict__ scales,
                                                       int nb, u8* __restrict__ q, float* __restrict__ row_scale,
                                                       int* __restrict__ bad) {
  const int r = blockIdx.x;
  const u8* d = data + (size_t)r * nb * 16;
  const u8* s = scales + (size_t)r * nb;
  u8* o = q + (size_t)r * nb * 32;
  __shared__ int emax, emin, nanb;
  if (threadIdx.x == 0) {
    emax = -1000;
    emin = 1000;
    nanb = 0;
  }
  __syncthreads();
  int lmax = -1000, lmin = 1000, lnan = 0;
  for (int b = threadIdx.x; b < nb; b += 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(d + (size_t)b * 16);
    const int code = s[b];
    if (code == 255) {
      lnan = 1;
    } else if (((v.x | v.y | v.z | v.w) & 0x77777777u) != 0u) {
      lmax = max(lmax, code - 127);
      lmin = min(lmin, code - 127);
    }
  }
#pragma unroll
  for (int o2 = 16; o2 > 0; o2 >>= 1) {
    lmax = max(lmax, __shfl_xor_sync(0xffffffffu, lmax, o2));
    lmin = min(lmin, __shfl_xor_sync(0xffffffffu, lmin, o2));
    lnan |= __shfl_xor_sync(0xffffffffu, lnan, o2);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&emax, lmax);
    atomicMin(&emin, lmin);
    atomicOr(&nanb, lnan);
  }
  __syncthreads();
  const int shift = emax == -1000 ? 0 : emax - 6;
  if (threadIdx.x == 0) {
    row_scale[r] = ldexpf(1.f, shift);
    bad[r] = (nanb || (emax != -1000 && emin < emax - 13)) ? 1 : 0;
  }
  for (int b = threadIdx.x; b < nb; b += 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(d + (size_t)b * 16);
    const int dd = min(6, max(-7, (int)s[b] - 127 - shift));  // clamped: a flagged row's values are unused
    store_block(o + (size_t)b * 32, v, dd);
  }
}

// The activations, per call: a CTA of 128 threads per row r, one thread per MXFP4 block, the 4 lanes of a 128-k
// chunk (4 blocks) agreeing by shuffles. A chunk whose nonzero blocks lie within 13 binades of its largest is
// re-based to s = max e_b - 6 (q = e2m1 * 2^(e_b - s), mult[r, b] = 2^s for its blocks); any other chunk (wider,
// or a NaN scale code) keeps bare e2m1 values with mult[r, b] = the block's own scale, and row_bad[r] = 1: the
// GEMM then applies scales per 32 k in that row's tile. Loads are 16 bytes a lane, contiguous; the 32-byte
// results go through shared memory so the stores are contiguous too (a thread per chunk, as before, reached a
// third of copy bandwidth: 53 us for 4096 x 8192 on the H100). mult [R, nb] float32, row_bad [R] int32.
__global__ void __launch_bounds__(128) mx_to_e4m3_chunks(const u8* __restrict__ data, const u8* __restrict__ scales,
                                                         int nb, u8* __restrict__ q, float* __restrict__ mult,
                                                         int* __restrict__ row_bad) {
  __shared__ uint4 stage[256];  // 128 blocks x 32 bytes
  const int r = blockIdx.x, tid = threadIdx.x;
  const u8* d = data + (size_t)r * nb * 16;
  const u8* s = scales + (size_t)r * nb;
  u8* o = q + (size_t)r * nb * 32;
  float* mu = mult + (size_t)r * nb;
  int bad = 0;
  for (int b0 = 0; b0 < nb; b0 += 128) {
    const int b = b0 + tid;
    const bool in = b < nb;
    const uint4 v = in ? *reinterpret_cast<const uint4*>(d + (size_t)b * 16) : make_uint4(0u, 0u, 0u, 0u);
    const int code = in ? (int)s[b] : 0;
    const bool nz = ((v.x | v.y | v.z | v.w) & 0x77777777u) != 0u;
    int emax = nz ? code - 127 : -1000, emin = nz ? code - 127 : 1000, nan = in && code == 255;
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {  // over the chunk's 4 lanes (b0 is a multiple of 4)
      emax = max(emax, __shfl_xor_sync(0xffffffffu, emax, x));
      emin = min(emin, __shfl_xor_sync(0xffffffffu, emin, x));
      nan |= __shfl_xor_sync(0xffffffffu, nan, x);
    }
    const bool fits = !nan && emin >= emax - 13;  // (an all-zero chunk: emin > emax)
    const int sc = emax == -1000 ? 0 : emax - 6;
    bad |= in && !fits;
    u32 p[8];
    convert_block(v, fits && in ? min(6, max(-7, code - 127 - sc)) : 0, p);  // (lanes past nb: zeros, fast)
    stage[2 * tid] = make_uint4(p[0], p[1], p[2], p[3]);
    stage[2 * tid + 1] = make_uint4(p[4], p[5], p[6], p[7]);
    if (in) mu[b] = fits ? ldexpf(1.f, sc) : vbw::e8m0_decode(code);
    __syncthreads();
    uint4* o4 = reinterpret_cast<uint4*>(o + (size_t)b0 * 32);
    for (int i = tid, n = 2 * min(128, nb - b0); i < n; i += 128) o4[i] = stage[i];
    __syncthreads();
  }
  bad = __syncthreads_or(bad);
  if (tid == 0) row_bad[r] = bad;
}

// acc += p * (the token row's multiplier): rows g (f0) and g + 8 (f1) of the wgmma accumulator layout.
template <int NACC>
__device__ __forceinline__ void scale_in(float (&acc)[NACC], const float (&p)[NACC], float f0, float f1) {
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = fmaf(p[i], (i & 2) ? f1 : f0, acc[i]);
}

// Stream-K tail (fp8_gemm_mx): a consumer warpgroup's partial of part `part` of a split unit goes to its slot of
// ws (tail_split parts of NACC x 128 floats, coalesced); the warpgroup whose arrival completes the slot's count
// (counters[slot], reset by it for the next launch) sums the parts in part order (deterministic whoever comes
// last) into acc and returns true; the others return false. Named barrier `bar` (this warpgroup's 128 threads).
template <int NACC>
__device__ __forceinline__ bool split_finish(float (&acc)[NACC], float* __restrict__ ws, int* __restrict__ counters,
                                             int slot, int part, int parts, int bar) {
  return vbw_gemm::split_parts_reduce<NACC, 128>(acc, ws + (size_t)slot * parts * NACC * 128, part, parts,
                                                 counters + slot, (int)(threadIdx.x & 127),
                                                 [bar](bool v) { return vbw::named_bar_or(bar, 128, v); });
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VBW_FP8_CLUSTER(n) __cluster_dims__(n, 1, 1)
#else
#define VBW_FP8_CLUSTER(n)
#endif

template <int BN, int STAGES, int CM>
__global__ void __launch_bounds__(384, 1) VBW_FP8_CLUSTER(CM)
fp8_gemm_mx(const __grid_constant__ vbw::TmaDesc tm_a, const __grid_constant__ vbw::TmaDesc tm_w,
            const float* __restrict__ mult, const int* __restrict__ row_bad, const float* __restrict__ w_scale,
            const void* __restrict__ bias, void* __restrict__ out, int M, int N, int nb, int flags,
            float* __restrict__ ws, int* __restrict__ counters, int full_units, int tail_split, int row_scales) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(BN == 128 || BN == 192, "BN");
  static_assert(STAGES >= 2, "STAGES");
  static_assert(CM == 1 || CM == 2, "CM");
  constexpr bool TWO = BN == 128;  // two partial sets (BN = 192: one; three sets of 96 would not fit 232 registers)
  constexpr int BM = 128, A_BYTES = BM * 128, W_BYTES = BN * 128, STAGE = A_BYTES + W_BYTES, NACC = BN / 2;
  constexpr int CP = BN / 2, LDT = CP + 4;  // the epilogue's two passes of CP columns: fp32 rows of LDT
  extern __shared__ __align__(128) u8 smem_raw[];
  const u32 raw = vbw::smem_addr(smem_raw);
  const u32 sbase = (raw + 1023u) & ~1023u;  // 128-byte swizzle atoms are 1024-byte aligned
  const u32 full0 = sbase + STAGES * STAGE, empty0 = full0 + 8 * STAGES;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int nkt = (nb + 3) / 4;
  // A work unit is CM token tiles (a cluster's CTAs, rank r taking the r-th) times one weight tile. Units go in
  // groups of 8 token tiles (the Triton order): the CTAs running at once share few A and W tiles in L2.
  // Persistent: cluster c runs units c, c + clusters, ... (gridDim.x / CM clusters, at most one CTA per SM).
  const int rank = CM > 1 ? (int)vbw::cluster_rank() : 0;
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int units_m = (tiles_m + CM - 1) / CM, group = 8 / CM, per_group = group * tiles_n;
  const int n_tiles = units_m * tiles_n, stride = (int)gridDim.x / CM, first_unit = (int)blockIdx.x / CM;
  auto origin = [&](int tile, int& m0, int& n0) {
    const int grp = tile / per_group, first_m = grp * group, in_grp = tile - grp * per_group;
    const int gm = min(units_m - first_m, group);
    m0 = ((first_m + in_grp % gm) * CM + rank) * BM;
    n0 = (in_grp / gm) * BN;
  };
  // Stream-K tail: units from full_units on (the last, partial round of the persistent grid) are split into
  // tail_split parts along K, one work item each, so the last round takes 1 / tail_split of a unit's time.
  // Item i < full_units is unit i whole (part -1); the parts of a split unit meet in `ws` (split_finish).
  const int kps = tail_split > 1 ? (nkt + tail_split - 1) / tail_split : nkt;
  const int n_items = tail_split > 1 ? full_units + (n_tiles - full_units) * tail_split : n_tiles;
  auto split_item = [&](int item, int& tile, int& k0, int& k1, int& part) {
    if (tail_split <= 1 || item < full_units) {
      tile = item, k0 = 0, k1 = nkt, part = -1;
      return;
    }
    const int ti = item - full_units;
    tile = full_units + ti / tail_split, part = ti % tail_split;
    k0 = part * kps, k1 = min(nkt, k0 + kps);
  };
  if (tid == 0) {
    for (int b = 0; b < STAGES; ++b) {
      vbw::mbar_init(full0 + 8 * b, 1);
      vbw::mbar_init(empty0 + 8 * b, 8 * CM);  // each consumer warp of the cluster releases
    }
  }
  if constexpr (CM > 1) vbw::cluster_sync();  // the peer's barriers are initialized before any arrive on them
  else __syncthreads();

  // A warp is done with buffer b (every lane past its wgmma wait): in its own CTA and, with a cluster, in the
  // peer's, whose producer writes half of this CTA's W tile.
  auto release = [&](int b) {
    __syncwarp();
    if ((tid & 31) == 0) {
      vbw::mbar_arrive(empty0 + 8 * b);
      if constexpr (CM > 1) vbw::mbar_arrive_cta(empty0 + 8 * b, (u32)(rank ^ 1));
    }
  };
  if (tid >= 256) {  // the producer warpgroup: one thread issues each k-tile as soon as its buffer is released
    vbw::setmaxnreg_dec<40>();
    if (tid == 256) {
      int q = 0;  // k-tiles issued so far, over all of this CTA's tiles: buffer q % STAGES
      for (int item = first_unit; item < n_items; item += stride) {
        int tile, k0, k1, part, m0, n0;
        split_item(item, tile, k0, k1, part);
        origin(tile, m0, n0);
        for (int kt = k0; kt < k1; ++kt, ++q) {
          const int b = q % STAGES;
          if (q >= STAGES) vbw::mbar_wait(empty0 + 8 * b, (u32)(q / STAGES - 1) & 1u);
          vbw::mbar_expect_tx(full0 + 8 * b, STAGE);  // with a cluster, half of the W bytes come from the peer
          vbw::tma_load_2d(sbase + b * STAGE, &tm_a, full0 + 8 * b, kt * 128, m0);
          if constexpr (CM == 1)
            vbw::tma_load_2d(sbase + b * STAGE + A_BYTES, &tm_w, full0 + 8 * b, kt * 128, n0);
          else  // this rank's half of the W rows, into both CTAs (tm_w's box is BN / 2 rows)
            vbw::tma_load_2d_mc(sbase + b * STAGE + A_BYTES + rank * (W_BYTES / 2), &tm_w, full0 + 8 * b, kt * 128,
                                n0 + rank * (BN / 2), (unsigned short)3);
        }
      }
    }
    if constexpr (CM > 1) {  // stay until the peer can no longer arrive on this CTA's barriers
      __syncwarp();
      vbw::cluster_sync();
    }
    return;  // the consumers synchronize among themselves from here on (named barriers 2, 3)
  }
  vbw::setmaxnreg_inc<232>();
  const int cw = wg, lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
  // The multiplier of a token row's 32-k block b: mult[row, b], or with row_scales (W4A8) mult[row] for every b;
  // 0 past K (the zero-filled tail).
  const int mstep = row_scales ? 0 : 1, mrow = row_scales ? 1 : nb;
  auto mu = [&](const float* row, int b) { return b < nb ? row[b * mstep] : 0.f; };
  int done = 0;  // k-tiles consumed before this item
  for (int item = first_unit; item < n_items; item += stride) {
  int tile, k0, k1, part, m0, n0;
  split_item(item, tile, k0, k1, part);
  const int q0 = done - k0;  // k-tile kt (k0 <= kt < k1) is the ring's (q0 + kt)-th
  done += k1 - k0;
  origin(tile, m0, n0);
  const int mr0 = m0 + cw * 64 + warp * 16 + g, mr1 = mr0 + 8;  // this thread's two token rows
  const float* mu0 = mult + (size_t)min(mr0, M - 1) * mrow;
  const float* mu1 = mult + (size_t)min(mr1, M - 1) * mrow;
  // a row of this warpgroup's 64 with a chunk that could not be re-based: scales per 32 k (the slow path)
  const int lr = m0 + cw * 64 + (tid & 127);
  const bool slow = vbw::named_bar_or(2 + cw, 128, (tid & 127) < 64 && lr < M && !row_scales && row_bad[lr] != 0);

  float acc[NACC], pa[NACC], pb[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  if (!slow) {
    // One multiplier per row and k-tile: a tile's 4 wgmmas accumulate into a partial set that is then scaled into
    // acc. Tiles go in pairs, one set each, so the first one is scaled in while the second one's wgmmas run. (A
    // pipeline across pairs, each set read while the other's group is still in flight from the previous
    // iteration, makes ptxas serialize every wgmma.)
    auto issue = [&](int kt, float (&p)[NACC]) {
      const int q = q0 + kt, b = q % STAGES;
      vbw::mbar_wait(full0 + 8 * b, (u32)(q / STAGES) & 1u);
      const u32 sa = sbase + b * STAGE + cw * 64 * 128, sw = sbase + b * STAGE + A_BYTES;
      vbw::wg_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j)
        vbw::WgmmaSS8<BN>::run(p, vbw::desc_sw128_k(sa + 32 * j), vbw::desc_sw128_k(sw + 32 * j), j > 0);
      vbw::wg_commit();
    };
    auto finish = [&](int kt, float (&p)[NACC], float f0, float f1) {  // after the wait for tile kt's group
      vbw::keep_acc(p);
      release((q0 + kt) % STAGES);
      scale_in<NACC>(acc, p, f0, f1);
    };
    if constexpr (!TWO) {
      float f0 = mu(mu0, 4 * k0), f1 = mu(mu1, 4 * k0);
      for (int kt = k0; kt < k1; ++kt) {
        const float g0 = mu(mu0, 4 * kt + 4), g1 = mu(mu1, 4 * kt + 4);  // the next tile's, a tile early
        issue(kt, pa);
        vbw::wg_wait<0>();
        finish(kt, pa, f0, f1);
        f0 = g0;
        f1 = g1;
      }
    } else
    for (int kt = k0; kt < k1; kt += 2) {
      const float fa0 = mu(mu0, 4 * kt), fa1 = mu(mu1, 4 * kt);
      const float fb0 = mu(mu0, 4 * kt + 4), fb1 = mu(mu1, 4 * kt + 4);
      issue(kt, pa);
      if (kt + 1 < k1) {
        issue(kt + 1, pb);
        vbw::wg_wait<1>();
        finish(kt, pa, fa0, fa1);
        vbw::wg_wait<0>();
        finish(kt + 1, pb, fb0, fb1);
      } else {
        vbw::wg_wait<0>();
        finish(kt, pa, fa0, fa1);
      }
    }
  } else {
    // Per block: each k32 wgmma writes a fresh partial (two sets: block j + 1 runs while block j is scaled in).
    for (int kt = k0; kt < k1; ++kt) {
      const int q = q0 + kt, b = q % STAGES;
      float f0[4], f1[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f0[j] = mu(mu0, kt * 4 + j);
        f1[j] = mu(mu1, kt * 4 + j);
      }
      vbw::mbar_wait(full0 + 8 * b, (u32)(q / STAGES) & 1u);
      const u32 sa = sbase + b * STAGE + cw * 64 * 128, sw = sbase + b * STAGE + A_BYTES;
      if constexpr (!TWO) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          vbw::wg_fence();
          vbw::WgmmaSS8<BN>::run(pa, vbw::desc_sw128_k(sa + 32 * j), vbw::desc_sw128_k(sw + 32 * j), 0);
          vbw::wg_commit();
          vbw::wg_wait<0>();
          vbw::keep_acc(pa);
          if (j == 3) release(b);
          scale_in<NACC>(acc, pa, f0[j], f1[j]);
        }
        continue;
      }
      vbw::wg_fence();
      vbw::WgmmaSS8<BN>::run(pa, vbw::desc_sw128_k(sa), vbw::desc_sw128_k(sw), 0);
      vbw::wg_commit();
      vbw::WgmmaSS8<BN>::run(pb, vbw::desc_sw128_k(sa + 32), vbw::desc_sw128_k(sw + 32), 0);
      vbw::wg_commit();
      vbw::wg_wait<1>();
      vbw::keep_acc(pa);
      scale_in<NACC>(acc, pa, f0[0], f1[0]);
      vbw::wg_fence();
      vbw::WgmmaSS8<BN>::run(pa, vbw::desc_sw128_k(sa + 64), vbw::desc_sw128_k(sw + 64), 0);
      vbw::wg_commit();
      vbw::wg_wait<1>();
      vbw::keep_acc(pb);
      scale_in<NACC>(acc, pb, f0[1], f1[1]);
      vbw::wg_fence();
      vbw::WgmmaSS8<BN>::run(pb, vbw::desc_sw128_k(sa + 96), vbw::desc_sw128_k(sw + 96), 0);
      vbw::wg_commit();
      vbw::wg_wait<1>();
      vbw::keep_acc(pa);
      scale_in<NACC>(acc, pa, f0[2], f1[2]);
      vbw::wg_wait<0>();
      vbw::keep_acc(pb);
      release(b);
      scale_in<NACC>(acc, pb, f0[3], f1[3]);
    }
  }

  if (part >= 0) {  // a split unit's part: its partial to ws; the warpgroup that brings the last one finishes
    if (!split_finish<NACC>(acc, ws, counters, ((tile - full_units) * CM + rank) * 2 + cw, part, tail_split,
                            2 + cw))
      continue;
  }
  // Epilogue: accumulator acc[4i + e] is tile row cw * 64 + 16 warp + g + 8 (e >> 1), column 8i + 2t + (e & 1).
  // Outputs go through this warpgroup's staging area after the ring (2 x 25 KB, leaving room for a 4-stage
  // ring), then each thread writes 8 consecutive outputs of a row with one 16-byte store. The ring is already
  // filling with the next tile, so each warpgroup goes on without waiting for the other (named barrier 2 + cw).
  // Each thread applies the weight row scale and bias to its accumulators in registers (its loads issued
  // together: in v5's rolled loop, a dependent global load per 8 outputs cost ~15% of the GEMM). Without an
  // activation (or with relu) it also rounds them to the 2-byte output type (gemm.py keeps float32 outputs off
  // this path) and stages those. With gelu / silu, whose code repeated per accumulator made the kernel 20%
  // slower, the fp32 values are staged in two passes of CP columns and a rolled loop applies the activation.
  constexpr int ROWS = 64, NTH = 128;
  const int bar_id = 2 + cw, row0 = cw * 64, ltid = tid & 127, r0 = warp * 16 + g;
  float* stage_f = reinterpret_cast<float*>(smem_raw + (sbase - raw)) + (STAGES * STAGE + 16 * STAGES) / 4 +
                   cw * 64 * LDT;
  const int act = flags & 7;
  if (act <= 1) {
    constexpr int LDH = (BN + 8) / 2;  // words of a row of 2-byte outputs (= LDT: the same area)
    static_assert(LDH == LDT, "staging");
    u32* stage_h = reinterpret_cast<u32*>(stage_f);
    const bool bf16_out = ((flags >> 8) & 3) == 1;
    vbw::named_bar(bar_id, NTH);  // the staging area is free (this warpgroup's previous tile has been read out)
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      const int c = 8 * i + 2 * t, n = n0 + c;
      const float s0 = n < N ? w_scale[n] : 0.f, s1 = n + 1 < N ? w_scale[n + 1] : 0.f;
      const float b0 = n < N ? vbw_gemm::bias_at(bias, flags, n) : 0.f;
      const float b1 = n + 1 < N ? vbw_gemm::bias_at(bias, flags, n + 1) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v0 = acc[4 * i + 2 * h] * s0 + b0, v1 = acc[4 * i + 2 * h + 1] * s1 + b1;
        if (act == 1) {
          v0 = vbw_gemm::activate(v0, 1);
          v1 = vbw_gemm::activate(v1, 1);
        }
        stage_h[(r0 + 8 * h) * LDH + c / 2] = bf16_out ? vbw::pack2<__nv_bfloat16>(v0, v1) : vbw::pack2<__half>(v0, v1);
      }
    }
    vbw::named_bar(bar_id, NTH);
    const bool vec = N % 8 == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;
#pragma unroll 1
    for (int c = ltid; c < ROWS * BN / 8; c += NTH) {
      const int rr = c / (BN / 8), col = (c % (BN / 8)) * 8, m = m0 + row0 + rr, n = n0 + col;
      if (m >= M || n >= N) continue;
      const uint4 w = *reinterpret_cast<const uint4*>(stage_h + rr * LDH + col / 2);
      unsigned short* dst = static_cast<unsigned short*>(out) + (size_t)m * (size_t)N + n;
      if (vec && n + 8 <= N) {
        *reinterpret_cast<uint4*>(dst) = w;
      } else {
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (n + e < N) dst[e] = (unsigned short)(ws[e / 2] >> (16 * (e & 1)));
      }
    }
    continue;
  }
  const int ok = (flags >> 8) & 3, es = ok == 2 ? 4 : 2;
  const bool vec = (N * es) % 16 == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    vbw::named_bar(bar_id, NTH);  // the staging area is free (the previous pass or tile has been read out)
#pragma unroll
    for (int i = 0; i < CP / 8; ++i) {  // weight row scale and bias in registers: all loads issued at once
      const int c = 8 * i + 2 * t, n = n0 + pass * CP + c;
      const float s0 = n < N ? w_scale[n] : 0.f, s1 = n + 1 < N ? w_scale[n + 1] : 0.f;
      const float b0 = n < N ? vbw_gemm::bias_at(bias, flags, n) : 0.f;
      const float b1 = n + 1 < N ? vbw_gemm::bias_at(bias, flags, n + 1) : 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int a = 4 * (pass * (CP / 8) + i) + 2 * h;
        stage_f[(r0 + 8 * h) * LDT + c] = acc[a] * s0 + b0;
        stage_f[(r0 + 8 * h) * LDT + c + 1] = acc[a + 1] * s1 + b1;
      }
    }
    vbw::named_bar(bar_id, NTH);
#pragma unroll 1
    for (int c = ltid; c < ROWS * CP / 8; c += NTH) {
      const int rr = c / (CP / 8), col = (c % (CP / 8)) * 8, m = m0 + row0 + rr, n = n0 + pass * CP + col;
      if (m >= M || n >= N) continue;
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = vbw_gemm::activate(stage_f[rr * LDT + col + e], flags);
      vbw_gemm::store8(out, (size_t)m * (size_t)N + (size_t)n, v, N - n, flags, vec && n + 8 <= N);
    }
  }
  }  // tiles
  if constexpr (CM > 1) vbw::cluster_sync();  // the peer's last releases have reached this CTA's barriers
#else
  __trap();  // Hopper only: gemm.py never launches it elsewhere
#endif
}

}  // namespace vbw_fp8gemm
