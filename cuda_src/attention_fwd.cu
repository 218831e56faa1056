// attention_fwd.cu: FlashAttention-2 style forward pass on tensor cores (mma.sync m16n8k16, sm_80+).
//
// Computes, per (batch b, query head h, query row i):
//   s_j  = scale * q_i . k_j                  (or softcap * tanh(scale * q_i . k_j / softcap))
//   o_i  = sum_j softmax(s)_j v_j,   lse_i = log sum_j exp(s_j)   over the keys j that row i sees
// where row i sees key j iff j < Sk, and with diag = Sk - Sq (bottom-right alignment)
//   j <= i + diag + win_right (win_right >= 0; causal is win_right = 0), j >= i + diag - win_left (win_left >= 0).
// A row that sees no key gets o = 0 and lse = -inf.
//
// Operands (row-major, contiguous, element type T = __half or __nv_bfloat16; attn_fwd_wg also E4M3<O>: q, k
// E4M3 bytes, v a transposed copy [B, Hkv, d, keys], o of type O, see Elems below):
//   q, o  [tokens_q, H,   d]      k, v  [tokens_k, Hkv, d]       lse (float32)
//   dense:  tokens = B * S, batch b starts at b * S;        lse [B, H, Sq]
//   varlen: batch b spans cu_q[b] .. cu_q[b+1] (cu_k for keys); lse [H, total_q]; seqlen_q / seqlen_k carry
//           total_q / total_k, and every CTA checks its sequence's offsets first (varlen_bad: NaN rows and the
//           error word of errors.cuh for bad ones, so the host never has to read them)
//   kv head = h / group (group = H / Hkv: grouped-query / multi-query).
//   d is the real head dim (1..256); HEAD_DIM is the compiled one (multiple of 32 >= d). Columns >= d are
//   zero-filled in shared memory and never read from or written to global memory.
//   VEC = true needs every row start 16-byte aligned (d % 8 == 0, aligned bases): 16-byte cp.async loads and
//   16-byte stores; VEC = false falls back to element-wise loads/stores (any d, any alignment).
//
// Tiling: one CTA = BLOCK_M query rows of one (b, h); WARPS warps, warp w owns MT = BLOCK_M / (16 WARPS)
//   m16 row tiles. Shared memory: Q [BLOCK_M][HEAD_DIM+8], K and V [STAGES][BLOCK_N][HEAD_DIM+8] (rows padded by
//   16 bytes, so the 8 row addresses of every ldmatrix hit 8 distinct 16-byte bank groups).
//   Pipeline per KV tile (keys iterate from the last visible tile down to the first), STAGES = 1:
//     wait K(n) ; barrier ; issue cp.async V(n) ; S = Q K^T (ldmatrix Q / K, mma) ; mask ; online softmax
//     wait V(n) ; barrier ; issue cp.async K(n-1) ; O += P V (P packed from the S accumulators, ldmatrix.trans V)
//   so the load of V overlaps Q K^T and the load of the next K overlaps P V. STAGES = 2 double-buffers K and V:
//     wait K(n), V(n) ; barrier ; issue cp.async K(n-1), V(n-1) into the other stage ; S ; softmax ; O += P V
//   (one barrier per tile, and each load has a whole tile of compute to land).
//   Online softmax in fp32 with exp2: p = 2^(s * scale*log2e - m * scale*log2e) (one FFMA + EX2 per score);
//   row sums stay per-thread partial sums until the end; masks are applied only on tiles that straddle a
//   boundary; tiles outside [first visible key, last visible key] of the CTA's rows are never loaded.
//   Q_REGS keeps the Q fragments in registers for the whole CTA (small HEAD_DIM), otherwise they are re-read
//   from shared memory for every KV tile. CTA order (1-D grid): the (b, h) pairs are cut into sections whose K
//   and V fit in L2 (sect_heads pairs, chosen by the launcher); inside a section the longest Q tiles (largest
//   m, most KV tiles under a causal mask) of all its heads go first. Output goes registers -> shared (Q's
//   buffer) -> 16-byte coalesced stores.
//
// History (the full log, with A/B runs, tried-and-dropped variants and ncu readings: notes/kernel-history.md,
// section attention_fwd.cu). fp16, B*S = 32768 tokens, H*D = 2048; ratio = our TFLOP/s / torch SDPA FLASH
// (FlashAttention-2) in the same run; run-to-run noise 5-10%.
//   v1 (H200) FA2 pipeline, mma.sync, STAGES = 1: D=128 0.83-0.97x (326 vs 353 TFLOP/s at S=4096).
//   v2 (H200) STAGES = 2, L2-sized head sections, longest Q tiles first: D=64 284-323 TFLOP/s (1.01-1.05x).
//   v3 (H200) register trimming (2-stage tiles do not spill), exp fused into P V: geomean D=64 0.93x, D=128 0.86x.
//   v4 (H200) attn_fwd_wg (sm_90a wgmma, cp.async loads): D=128 331-420 TFLOP/s (1.06-1.22x), D=64 0.90-0.99x.
//   v5 (H100) TMA loads of Q, K, V, STAGES K/V slots: D=64 1.07-1.39x, D=128 1.12-1.60x, D=256 1.16-1.95x
//      (239-556 TFLOP/s); vs cuDNN 0.66-0.93x.
//   The SPARSE instance of attn_fwd_wg (block_sparse_attention) came after v5; the dense instances are unchanged.
//   v6 (H100) HEAD_DIM 192 (wgmma RS N = 192), and head dims 96 / 160 / 224 on the 128 / 192 / 256 instances
//      (columns past d zero-filled): 0.97-1.89x the mma.sync kernel, 0.95-2.06x FLASH (vbw_cupy/attention.py).
//   SPARSE: Q's TMA load issued before the block list is read (H100, S = 16k, D = 128, 10% of the blocks, one
//   run: 0.131-0.133x the dense time vs 0.145x with Q after the list).
//   v7 (H100, 2026-11-26) WS: warp-specialized CTAs (a TMA producer warpgroup, two consumer warpgroups taking
//      turns at the tensor cores, FlashAttention-3's schedule): the default at D = 128 (and 96), and from 8k /
//      4k keys at D = 192 / 256 (attention.py _WS_FROM); block-sparse 128 x 128 at D = 128. vs the lock-step
//      tiles, graph replay: D=128 0.99-1.20x (geomean 1.07, two runs), D=192 1.03, D=256 1.02, D=64 0.63-1.11x
//      (kept on "wg"); sparse 10% kept 0.125-0.134x dense (was 0.143x). Persistent CTAs on top: no faster
//      (notes/attempts/attention-ws-persistent.patch).
//   v8 (H100, 2026-11-26) FP8: attn_fwd_wg<E4M3<O>, 128, 128, 2, ..., WS> (flash_attention_fp8): Q K^T and P V on
//      e4m3 wgmma (k32), P as 256 p packed in register order with V^T's keys permuted to match (attention_fp8.cu),
//      descales folded into the score scale and the output. Graph replay, B * S = 32k, H = 16, D = 128, against
//      the float16 ws kernel on the same values: S = 4k 1.18-1.36x (690-734 TFLOP/s), 8k 1.34-1.46x, 16k
//      1.35-1.49x (up to 772; four runs); 3 stages no better. ncu (S = 4k): MUFU (ex2) pipe 41% of peak, issue slots 44%,
//      0.58 eligible warps a scheduler: latency-bound between the two warpgroups' turns, not by one pipe.
//   v9 (H100, 2026-11-26, sixth session) pin_softmax: ptxas had hoisted every wait for P(n) V(n) up to the wait
//      for S(n+1) (seen in the SASS: WARPGROUP.DEPBAR 0x0 right after 0x1), so no softmax ever overlapped its own
//      warpgroup's P V. A shared-memory store of the row sums before that wait keeps the order. Graph replay, same
//      run: ws 1.05-1.06x at D=128 from 16k keys, 1.06-1.08x at D=192, 1.08-1.13x at D=256, FP8 1.00-1.05x; ws
//      now beats the lock-step tiles at every length for D=192 / 256 and from 4k keys at D=64 (the defaults).
//      WS with three consumer warpgroups (BLOCK_M = 192; setmaxnreg 32 / 160): a D=64 candidate, 1.01-1.11x the
//      two-warpgroup ws tile from 2k keys (H200); not the default (28 bytes of spills at 160 registers).
//   v10 (H100, 2026-11-27) BLOCK_N any wgmma N with a WgmmaSS wrapper: 112 at D = 192 (S 56 + P 28 + O 96
//      accumulators; 128 spills 56 bytes) is the ws default there above 1k keys, 1.02-1.21x the 64-key tile
//      (two leases, graph replay). Tuning candidates: 144 at D = 128 (1.03x at 16k full, slower below), 80 at
//      D = 256 (0.98-1.06x from 2k; spills 48 bytes), 208 at D = 64 (1.03-1.07x full at 2k-4k, 0.97-1.00x
//      causal, two runs). At D = 128, 160 and 176 (FlashAttention-3's non-causal tile) spill: O goes to local
//      memory around the loop, since S(n+1), P(n) and O are live at once (196 registers at 176). Three
//      consumer warpgroups with 112-key tiles at D = 64 (0 spills at 160 registers, where 128 keys spill 28
//      bytes): the default above 2k keys, 1.02-1.14x the two-warpgroup 192-key tile (fp16 and bf16 runs).
//   v11 (H100, 2026-11-27, ninth session) a CTA's head and tail, clocked per CTA (clock64 stamps, notes/attempts/
//      attention-cta-timeline.py): at D = 128, S = 512 a CTA ran ~18,500 clocks, 11,500 of them its 4 tiles;
//      its first load went out ~1,860 clocks after entry (~790 of them cta_info's integer divisions) and its
//      epilogue took ~2,550 (~720 recomputing cta_info). Now: division multipliers from the launcher
//      (fast_div), thread 0 issues the first K / V tile with Q right after one mbarrier-init fence (the producer
//      starts at the second), the epilogue reads the CTA's work from shared memory: first loads out at ~1,430,
//      CTA ~17,600 clocks. Graph replay, three interleaved runs per side: D = 128 1.05 / 1.06x at 512 (full /
//      causal), 1.03 / 1.10x at 1k, 1.05 / 1.05x at 2k, 1.00 / 1.02x at 16k; other head dims within the noise.
//      Tried: O stored from registers (no staging): 0.85-0.95x at short S (4-byte stores stall the tail).
//   v12 (H100, 2026-11-27, tenth session) PERSIST (WS = 2, attention.py KIND "wsp"): at most one CTA an SM walks
//      work tiles, its producer loading the next tile's first K / V and Q during this one's last P V and
//      epilogue, O staged in its own area. Per work tile at D = 128, S = 2k: ~3,400 clocks outside the key
//      tiles (timeline), against ~6,400 for a CTA. Graph replay, 8 interleaved pairs, median speed over ws:
//      S = 512 / 1k / 2k / 4k full 1.11 / 1.09 / 1.04 / 1.01, causal 1.21 / 1.10 / 1.02 / 1.02; 8k causal 0.99,
//      16k 0.99 / 1.00 (ws stays from 8k keys); FP8 1.07 / 1.13 at 1k, 1.01 at 4k, 0.89 at 8k-16k causal.
//      Two things made it: the rounds of work tiles alternate direction (a plain stride: 0.87x at 2k causal),
//      and the first turn is passed without a branch on the warpgroup (after one, ptxas kept the whole loop off
//      the uniform datapath: 8-13% slower at every length). The first attempt (v7 era,
//      notes/attempts/attention-ws-persistent.patch) had neither. Tried on top: Q double-buffered (the next
//      tile's Q loaded a whole tile early): 0.99-1.01x, not kept; Q issued after the first K / V tile of the
//      next work tile instead of the second: +1-2% at 512-2k (kept). D = 256 (O in Q's buffer, the next Q after
//      the epilogue; a tuning candidate): 1.00-1.05x except causal 512 / 1k 0.92 / 0.97 and 16k 0.66.
//      Timeline (--persistent) at S = 2k: a tile's Q takes ~3,000 clocks from issue to landing and its K(0)
//      ~4,100 (HBM, a new head), so the consumers wait ~900 after their epilogue. An L2 prefetch
//      (cp.async.bulk.prefetch.tensor) of the next tile's Q, K(0), V(0) issued by the producer before its
//      current tile's loads: 0.79-0.85x at 512, 0.92-0.99x at 1k-4k (not kept; it delays the loads due now).
//   v13 (H100, 2026-11-27, eleventh session) PERSIST under a mask walks the launcher's schedule (attention.py
//      _persistent_schedule: a round's tiles, longest first, to the CTAs with the least work so far; passed in
//      sp_indices, read a tile ahead). Graph replay, 8 interleaved triples, speed over ws, alternating rounds /
//      schedule: D = 128 causal 512 / 1k / 2k 1.21 / 1.30, 1.11 / 1.20, 1.01 / 1.08; D = 256 causal 512 0.92 /
//      1.04, 16k 0.65 / 0.98; FP8 causal 1k 1.12 / 1.15, 8k 0.87 / 0.99. The loop keeps its 209 uniform-datapath
//      instructions (the tile index comes from a load now). D = 256 takes the persistent tile below 8k keys.
//   v14 (H100, 2026-11-27, twelfth session) PERSIST up to D = 128: Q double-buffered (the next work tile's Q
//      issued before its first K / V, into the buffer the tile before this one freed) and O sent by two storer
//      warps of the producer warpgroup (the consumers normalize, stage and go on; setmaxnreg 56 / 224, the
//      loop's SASS unchanged). Each alone: 1.005x / 1.014x; together, two runs of 4 interleaved rounds (graph
//      replay, D = 128 S = 512-4k, bf16 512 / 1k, FP8 1k / 4k): geomean 1.027 / 1.022x, causal 1.02-1.09x, full
//      0.98-1.03x. The storers' first hand-off (a lane's mbarrier arrival for its warp, then bar.arrive /
//      bar.sync pairs) drew racecheck hazards on the staged rows; every consumer thread arriving itself is clean.
//   v15 (H100, 2026-11-27, sixteenth session) FP8 descales per work tile: one a tensor, a KV head or a batch and
//      KV head (descale + b ds_bs + (h / group) ds_hs; ds_ts apart for q, k, v), folded into the tile's score
//      scale (a product <= 0: a prescale of that tile's scores) and its output. Sustained, per-head / per-tensor:
//      1.000-1.006x (S = 4k / 16k, Hkv = 16 / 4). Tried: FP8 with three consumer warpgroups and 64-key tiles
//      (notes/attempts/attention-fp8-three-warpgroups-64-keys.patch): 0.79-1.02x of the 128-key pair.
//
// Files, by role (as FlashAttention-3's hopper/): this file holds the two kernels and their main loops;
//   attention_mask.cuh      the CTA's work and visible key band, varlen offset checks, tile range, tile masks
//   attention_softmax.cuh   online max / rescale factors, the NaN rule of a row's sum (shared with the sparse kernel)
//   attention_tile.cuh      attn_fwd's padded shared-memory tiles and their cp.async loader (shared with sparse)
//   attention_wgmma_tile.cuh  attn_fwd_wg's 128B-swizzled panels: cp.async loader, element offsets (epilogue)
//   attention_fp8.cu        FP8 inputs: per-tensor E4M3 quantization and V's transposed, key-permuted copy
//   mma.cuh / wgmma.cuh     the tensor-core, ldmatrix, cp.async, TMA and mbarrier wrappers
// Tile sizes per head dim and architecture, each with the reason it was chosen: vbw_cupy/attention.py.

#include "mma.cuh"
#include "wgmma.cuh"
#include "errors.cuh"
#include "fp4.cuh"
#include "attention_tile.cuh"
#include "attention_softmax.cuh"
#include "attention_mask.cuh"
#include "attention_wgmma_tile.cuh"

// attn_fwd_wg's warp-specialized registers a thread with two consumer warpgroups, producer / consumers (-D to
// A/B): the CTA is launched with 384 x 168 and setmaxnreg only moves them, so 128 P + 256 C must stay within
// 384 x 168 = 64512 (more makes setmaxnreg.inc wait forever). Three consumer warpgroups always get 32 / 160
// (512 x 128; the -D switches do not reach them).
#ifndef VBW_WS_PRODUCER_REGS
#define VBW_WS_PRODUCER_REGS 24
#endif
#ifndef VBW_WS_CONSUMER_REGS
#define VBW_WS_CONSUMER_REGS 240
#endif
static_assert(128 * VBW_WS_PRODUCER_REGS + 256 * VBW_WS_CONSUMER_REGS <= 384 * 168, "WS registers");
// The persistent tile up to D = 128: warps 1 and 2 of the producer warpgroup store O from its staging area, so
// the consumers go on to the next work tile after staging it (-D to A/B)
#ifndef VBW_WSP_STORERS
#define VBW_WSP_STORERS 1
#endif
// The persistent tile up to D = 128: Q double-buffered, the next work tile's Q loaded a whole tile early (-D to A/B)
#ifndef VBW_WSP_QDB
#define VBW_WSP_QDB 1
#endif

namespace vbw_attn {
// attn_fwd_wg's element types: T = __half / __nv_bfloat16 (inputs and output of that type), or E4M3<O>: q, k, v
// as e4m3 (fn) bytes with float32 descales (one a tensor, or one a KV head, or a batch and KV head: see the
// work tile's score transform in attn_fwd_wg), the output O.
template <typename O> struct E4M3 {};
template <typename T> struct Elems { using in = T; using out = T; static constexpr bool fp8 = false; };
template <typename O> struct Elems<E4M3<O>> { using in = unsigned char; using out = O; static constexpr bool fp8 = true; };

}  // namespace vbw_attn

// Where this CTA works, recomputed from the kernel's arguments wherever a kernel needs it (see cta_info): for work
// tile `work` (-1: the CTA's own, by its block index; attn_fwd_wg's PERSIST walks others) with the launcher's
// division multipliers (mg_*), or with plain divisions (LEAN: attn_fwd, which ignores the multipliers, and
// attn_fwd_wg's EDGE tiles, see there).
#define VBW_CTA_AT(work) vbw_attn::cta_info<BLOCK_M>(cu_q, cu_k, batch, seqlen_q, seqlen_k, heads, num_m, \
                                                      sect_heads, mg_sec, mg_sect, mg_heads, win_left, win_right, work)
#define VBW_CTA_LEAN_AT(work) vbw_attn::cta_info<BLOCK_M, false>(cu_q, cu_k, batch, seqlen_q, seqlen_k, heads, \
                                                                 num_m, sect_heads, 0u, 0u, 0u, win_left, \
                                                                 win_right, work)
#define VBW_CTA_LEAN() VBW_CTA_LEAN_AT(-1)

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool Q_REGS, int STAGES, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
         float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
         int batch, int seqlen_q, int seqlen_k, int heads, int group, int d, int num_m, int sect_heads,
         unsigned mg_sec, unsigned mg_sect, unsigned mg_heads, float scale_log2, int score_mode, float cap_prescale,
         int win_left, int win_right,
         long long q_rs, long long kv_rs, long long lse_stride_h, int* __restrict__ err) {
  using namespace vbw;
  using vbw_attn::PAD;
  constexpr int NT = WARPS * 32;
  constexpr int MT = BLOCK_M / (16 * WARPS);
  static_assert(MT >= 1 && MT * 16 * WARPS == BLOCK_M, "BLOCK_M must be a multiple of 16 * WARPS");
  static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 32 == 0, "tile shape");
  static_assert(STAGES == 1 || STAGES == 2, "STAGES");
  constexpr int NN = BLOCK_N / 8;    // n8 tiles of S
  constexpr int ND = HEAD_DIM / 8;   // n8 tiles of O
  constexpr int KD = HEAD_DIM / 16;  // k16 steps of Q K^T
  constexpr int KN = BLOCK_N / 16;   // k16 steps of P V
  constexpr int LDS = HEAD_DIM + PAD;
  const float NEG_INF = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BLOCK_M * LDS;
  T* sV = sK + STAGES * BLOCK_N * LDS;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const vbw_attn::Cta cta = VBW_CTA_LEAN();
  if (cu_q != nullptr && vbw_attn::varlen_bad<T, BLOCK_M>(cta, cu_q, cu_k, batch, seqlen_q, seqlen_k, num_m, o, lse,
                                                          q_rs, d, lse_stride_h, err))
    return;
  if (cta.m0 >= cta.sq) return;
  const int sk = cta.sk;
  const int rows_q = min(BLOCK_M, cta.sq - cta.m0);
  const T* kg = k + cta.k_start * kv_rs + (long long)(cta.h / group) * d;
  const long long vk = v - k;  // V tile = K tile + vk (same layout)

  int n_lo, n_hi, nm_lo, nm_hi;
  vbw_attn::tile_range<BLOCK_N>(cta, rows_q, n_lo, n_hi, nm_lo, nm_hi);

  float acc_o[MT][ND][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][j][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = NEG_INF;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  // Per-lane ldmatrix addresses. Every ldmatrix.x4 here reads a 16 x 16 block as the four 8 x 8 matrices
  // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15), lane l giving the
  // address of row l % 8 of matrix l / 8. For Q (A operand) they are a0..a3; for K (B operand, rows = keys,
  // cols = d) they are b0 of keys 0-7, b0 of keys 8-15, b1 of keys 0-7, b1 of keys 8-15; for V (transposed,
  // rows = keys, cols = d) b0 / b1 of d 0-7, then b0 / b1 of d 8-15. One lane offset serves all three buffers.
  const int warp_row = warp * MT * 16;
  const vbw::u32 lane_a = smem_addr(smem_raw) + 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
  const vbw::u32 sQ_a = lane_a + 2 * warp_row * LDS;
  constexpr vbw::u32 K_BYTES = 2u * BLOCK_M * LDS;
  constexpr vbw::u32 V_BYTES = K_BYTES + 2u * STAGES * BLOCK_N * LDS;

  if (n_lo < n_hi) {
    vbw_attn::load_tile<BLOCK_M, HEAD_DIM, NT, VEC>(sQ, q + (cta.q_start + cta.m0) * q_rs + (long long)cta.h * d,
                                                    q_rs, rows_q, d, tid);
    cp_async_commit();
    int n = n_hi - 1;
    vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sK, kg + (long long)n * BLOCK_N * kv_rs, kv_rs,
                                               sk - n * BLOCK_N, d, tid);
    if constexpr (STAGES == 2)
      vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sV, kg + vk + (long long)n * BLOCK_N * kv_rs, kv_rs,
                                                      sk - n * BLOCK_N, d, tid);
    cp_async_commit();
    vbw::u32 stage_off = 0;  // byte offset of the current K/V stage (STAGES == 2)
    constexpr vbw::u32 STAGE_BYTES = 2u * BLOCK_N * LDS;

    vbw::u32 qf[Q_REGS ? MT : 1][Q_REGS ? KD : 1][4];
    if constexpr (Q_REGS) {
      cp_async_wait<1>();
      __syncthreads();
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          ldsm_x4(qf[mt][kk][0], qf[mt][kk][1], qf[mt][kk][2], qf[mt][kk][3],
                  sQ_a + 2 * (mt * 16 * LDS + kk * 16));
    }

    for (; n >= n_lo; --n) {
      cp_async_wait<0>();
      if constexpr (STAGES == 2) {
        __syncthreads();  // K(n), V(n) landed; every warp is done with tile n+1, whose stage is refilled now
        if (n > n_lo) {
          const vbw::u32 nxt = STAGE_BYTES - stage_off;
          vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sK + nxt / 2, kg + (long long)(n - 1) * BLOCK_N * kv_rs,
                                                          kv_rs, sk - (n - 1) * BLOCK_N, d, tid);
          vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sV + nxt / 2, kg + vk + (long long)(n - 1) * BLOCK_N * kv_rs,
                                                          kv_rs, sk - (n - 1) * BLOCK_N, d, tid);
          cp_async_commit();
        }
      } else {
        __syncthreads();  // K(n) landed; every warp is done with V(n+1)
        vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sV, kg + vk + (long long)n * BLOCK_N * kv_rs, kv_rs,
                                                        sk - n * BLOCK_N, d, tid);
        cp_async_commit();
      }

      float s[MT][NN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;

      // S = Q K^T
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        vbw::u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (Q_REGS) {
#pragma unroll
            for (int e = 0; e < 4; ++e) af[mt][e] = qf[mt][kk][e];
          } else {
            ldsm_x4(af[mt][0], af[mt][1], af[mt][2], af[mt][3], sQ_a + 2 * (mt * 16 * LDS + kk * 16));
          }
        }
#pragma unroll
        for (int np = 0; np < NN / 2; ++np) {
          vbw::u32 b0, b1, b2, b3;
          ldsm_x4(b0, b1, b2, b3, lane_a + K_BYTES + stage_off + 2 * (np * 16 * LDS + kk * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * np], af[mt], b0, b2);
            mma_16816<T>(s[mt][2 * np + 1], af[mt], b1, b3);
          }
        }
      }

      // Score transform: softcap (mode 1: tanh(s * scale / softcap), scale_log2 = softcap * log2 e) or, for a
      // scale <= 0 (mode 2: s *= -1 or 0, scale_log2 = |scale| log2 e or 1), so that scale_log2 > 0 always
      // holds: the max of the transformed scores is then the max of the scaled ones, and -inf * scale_log2
      // stays -inf (never NaN) for masked keys.
      if (score_mode == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < NN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] = tanhf(s[mt][j][e] * cap_prescale);
      } else if (score_mode == 2) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < NN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][j][e] *= cap_prescale;
      }

      // Masks, only on tiles that straddle a boundary (everything they need is recomputed here).
      if (n < nm_lo || n >= nm_hi) {
        const vbw_attn::Cta c = VBW_CTA_LEAN();
        const int c0 = n * BLOCK_N;
        const int lo_off = c.lo_base - c0;
        const int hi_off = c.hi_base - c0;
        const int hi_cap = min(BLOCK_N, c.sk - c0);
        const int wr = (threadIdx.x >> 5) * MT * 16;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          vbw_attn::mask_tile<NN>(s[mt], wr + mt * 16, lo_off, hi_off, hi_cap, threadIdx.x & 31);
      }

      // Online softmax (exp2, scale folded into one FFMA). The rescale of O is skipped when no row max moved
      // (corr == 1 exactly for the whole warp), which is most tiles once the running max has settled.
      float msc[MT][2];
      {
        float corr[MT][2];
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) moved |= vbw_attn::online_max<NN>(s[mt], row_max[mt], scale_log2, msc[mt], corr[mt]);
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < ND; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc_o[mt][j][e] *= corr[mt][e >> 1];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) row_sum[mt][hf] *= corr[mt][hf];
      }

      if constexpr (STAGES == 1) {
        cp_async_wait<0>();
        __syncthreads();  // V(n) landed; every warp is done with K(n)
        if (n > n_lo) {
          vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sK, kg + (long long)(n - 1) * BLOCK_N * kv_rs, kv_rs,
                                                          sk - (n - 1) * BLOCK_N, d, tid);
          cp_async_commit();
        }
      }

      // O += P V
#pragma unroll
      for (int t = 0; t < KN; ++t) {
        vbw::u32 pa[MT][4];
        // p = 2^(s scale log2e - m scale log2e) for this k-step's 16 keys right before their mmas, so the EX2s of
        // step t + 1 overlap the mmas of step t; the row sums stay per-thread partial sums.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 2 * t; j < 2 * t + 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[mt][j][e] = fast_exp2((s[mt][j][e] - msc[mt][e >> 1]) * scale_log2);
              row_sum[mt][e >> 1] += s[mt][j][e];
            }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pack2<T>(s[mt][2 * t][0], s[mt][2 * t][1]);
          pa[mt][1] = pack2<T>(s[mt][2 * t][2], s[mt][2 * t][3]);
          pa[mt][2] = pack2<T>(s[mt][2 * t + 1][0], s[mt][2 * t + 1][1]);
          pa[mt][3] = pack2<T>(s[mt][2 * t + 1][2], s[mt][2 * t + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < ND / 2; ++dp) {
          vbw::u32 b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, lane_a + V_BYTES + stage_off + 2 * (t * 16 * LDS + dp * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(acc_o[mt][2 * dp], pa[mt], b0, b1);
            mma_16816<T>(acc_o[mt][2 * dp + 1], pa[mt], b2, b3);
          }
        }
      }
      if constexpr (STAGES == 2) stage_off = STAGE_BYTES - stage_off;
    }
  }

  // Epilogue: normalize, LSE, stage O through shared memory, store. Q's buffer is free: with STAGES == 1 every
  // warp passed the barrier after its last Q K^T; with STAGES == 2 a warp only ever reads its own rows of Q,
  // which are the rows it overwrites here (after a __syncwarp: every lane's last ldmatrix of them first).
  __syncwarp();
  const vbw_attn::Cta ce = VBW_CTA_LEAN();
  const int m0 = ce.m0;
  const int rows_e = min(BLOCK_M, ce.sq - m0);
  T* og = o + (ce.q_start + m0) * q_rs + (long long)ce.h * d;
  const long long lse_base =
      (long long)ce.h * lse_stride_h + (cu_q != nullptr ? ce.q_start : (long long)ce.b * heads * seqlen_q);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float sum = row_sum[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : vbw_attn::nan_or(sum, 0.f);  // NaN scores: NaN row
      const int r = warp_row + mt * 16 + (lane >> 2) + hf * 8;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        const int col = j * 8 + (lane & 3) * 2;
        *reinterpret_cast<vbw::u32*>(sQ + r * LDS + col) =
            pack2<T>(acc_o[mt][j][2 * hf] * inv, acc_o[mt][j][2 * hf + 1] * inv);
      }
      if (lse != nullptr && (lane & 3) == 0 && r < rows_e) {
        const float val = sum > 0.f ? (row_max[mt][hf] * scale_log2 + __log2f(sum)) * 0.69314718055994531f
                                    : vbw_attn::nan_or(sum, NEG_INF);
        lse[lse_base + m0 + r] = val;
      }
    }
  __syncthreads();
  {
    constexpr int CPR = HEAD_DIM / 8;
    constexpr int TOTAL = BLOCK_M * CPR;
    constexpr int ITERS = (TOTAL + NT - 1) / NT;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int c = tid + i * NT;
      if ((TOTAL % NT) != 0 && c >= TOTAL) break;
      const int r = c / CPR;
      const int col = (c % CPR) * 8;
      if (r < rows_e && col < d) {
        const T* src = sQ + r * LDS + col;
        T* dst = og + r * q_rs + col;
        if constexpr (VEC) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          const int nv = min(8, d - col);
          for (int e = 0; e < nv; ++e) dst[e] = src[e];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- Hopper (sm_90a)
// attn_fwd_wg: the same computation and arguments as attn_fwd, with wgmma instead of mma.sync (VEC inputs only,
// d a multiple of 8 up to HEAD_DIM, HEAD_DIM a multiple of 64), plus three TMA tensor maps (tm_q, tm_k, tm_v;
// used when TMA, zero otherwise). CTA = WGS warpgroups; warpgroup g owns query rows 64g..64g+63 of the CTA's
// BLOCK_M = 64 WGS. Shared memory (1024-byte aligned): Q [BLOCK_M][HEAD_DIM] (the persistent tile up to
// HEAD_DIM 128: two Q buffers, then O's staging area, see SEP_O / QDB), STAGES slots of K and V
// [BLOCK_N][HEAD_DIM], each stored as HEAD_DIM / 64 column panels of 128-byte rows with the 128-byte swizzle
// (wgmma.cuh; TMA's SWIZZLE_128B writes exactly this), then the mbarriers. Loads: TMA (thread 0 issues a
// tile, everyone waits on its mbarrier; packed varlen inputs also zero the V rows past a sequence's end) or
// cp.async by every thread (where the driver cannot encode the maps). Per KV tile (keys from the last visible
// tile down):
//   barrier (everyone is done with tile n+1) ; load K, V of tile n - STAGES + 1 into tile n+1's slot
//   wait K(n), V(n)
//   S = Q K^T   wgmma SS, m64 n=BLOCK_N k16, K-major Q and K (scale-d 0 on the first k step)
//   mask / online softmax in registers (the accumulator layout is mma.sync's, so the code is attn_fwd's, MT = 1)
//   O += P V    wgmma RS, m64 n=HEAD_DIM k16: P packed from S in registers, V read MN-major (transposed B)
// The two warpgroups meet at the per-tile barrier; measured, they run in lock step there, so one's softmax
// does not overlap the other's wgmma (v4 in notes/kernel-history.md). WS (TMA only, two or three consumer
// warpgroups, 384 / 512 threads) removes that barrier: one more, producer warpgroup streams K and V into the
// STAGES ring as the consumers free each slot (an "empty" mbarrier per K and per V slot), and the consumers take
// turns at the tensor cores (named barriers 8 + wg, the turn going round): one issues S(n+1) and P(n) V(n),
// hands the turn over, and runs its softmax under the others' GEMMs and its own P(n) V(n) (pin_softmax).
// setmaxnreg moves registers from the producer to the consumers (24 / 240 with two, 32 / 160 with three); P is
// kept in one register set (packed after P(n) V(n) completes).

// SPARSE (block_sparse_attention, dense layout): the CTA runs only the key tiles listed for its query block in a
// BSR pattern (block_q = BLOCK_M, block_k = BLOCK_N): sp_indptr / sp_indices of pattern (b, h / group) start
// sp_ptr_stride / sp_idx_stride elements apart (0: one shared pattern), sp_nnz entries each, block ids below
// sp_nkb. Tiles are taken in list order; masks (causal, past Sk) apply by position as for dense tiles. The CTA
// stages its ids in shared memory (sp_nkb ints after the mbarriers; the launcher adds them to the dynamic
// size). A bad list (indptr not from 0, decreasing or past sp_nnz, longer than sp_nkb, an id outside
// [0, sp_nkb)) gives NaN rows and SPARSE_INDICES. Dense launches pass null pointers; the dense instances
// compile without any of it.
template <typename T, int HEAD_DIM, int BLOCK_N, int WGS, bool OVERLAP, bool TMA, int STAGES, int WS, bool SPARSE>
__global__ void __launch_bounds__(WGS * 128 + (WS ? 128 : 0), 1)
attn_fwd_wg(const typename vbw_attn::Elems<T>::in* __restrict__ q, const typename vbw_attn::Elems<T>::in* __restrict__ k,
            const typename vbw_attn::Elems<T>::in* __restrict__ v, typename vbw_attn::Elems<T>::out* __restrict__ o,
            float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
            int batch, int seqlen_q, int seqlen_k, int heads, int group, int d, int num_m, int sect_heads,
            unsigned mg_sec, unsigned mg_sect, unsigned mg_heads, float scale_log2, int score_mode,
            float cap_prescale, int win_left, int win_right,
            long long q_rs, long long kv_rs, long long lse_stride_h, int* __restrict__ err,
            const int* __restrict__ sp_indptr, const int* __restrict__ sp_indices, long long sp_ptr_stride,
            long long sp_idx_stride, int sp_nnz, int sp_nkb, const float* __restrict__ descale, int ds_ts,
            int ds_bs, int ds_hs,
            const __grid_constant__ vbw::TmaDesc tm_q, const __grid_constant__ vbw::TmaDesc tm_k,
            const __grid_constant__ vbw::TmaDesc tm_v) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace vbw;
  using TI = typename vbw_attn::Elems<T>::in;    // q, k, v elements
  using TO = typename vbw_attn::Elems<T>::out;   // o
  constexpr bool FP8 = vbw_attn::Elems<T>::fp8;
  constexpr int BLOCK_M = 64 * WGS;
  constexpr int NT = 128 * WGS;
  static_assert(BLOCK_N == 64 || BLOCK_N == 80 || BLOCK_N == 112 || BLOCK_N == 128 || BLOCK_N == 144 ||
                    BLOCK_N == 192 || BLOCK_N == 208,
                "BLOCK_N: a wgmma N with a WgmmaSS wrapper (wgmma.cuh)");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 192 || HEAD_DIM == 256, "HEAD_DIM: a wgmma N");
  static_assert(STAGES >= 2 && STAGES <= 4 && (!OVERLAP || STAGES == 2), "STAGES");
  static_assert(!WS || (TMA && !OVERLAP && (WGS == 2 || WGS == 3) && STAGES <= 3),
                "WS: TMA, 2 or 3 consumer warpgroups");
  // WS registers a thread, producer / consumers: the launch gives 65536 / (128 (WGS + 1)) rounded down to 8 (168
  // for 384 threads, 128 for 512) and setmaxnreg only moves them (asking for more makes setmaxnreg.inc hang)
  constexpr int WS_P_REGS = WGS == 2 ? VBW_WS_PRODUCER_REGS : 32;
  constexpr int WS_C_REGS = WGS == 2 ? VBW_WS_CONSUMER_REGS : 160;
  // PERSIST: the producer walks the work tiles (cta_info, tile_range) and, up to D = 128, two of its warps store O
  // (STORERS): 56 registers there (40 spilled 20 bytes in the walk), 224 for the consumers (their loop's SASS is
  // the same as at 232); above D = 128 the consumers need 240 (232 spill 40 bytes at D = 256), so the producer
  // spills at 24
#ifndef VBW_WSP_P_REGS
#define VBW_WSP_P_REGS (HEAD_DIM > 128 ? 24 : 56)
#define VBW_WSP_C_REGS (HEAD_DIM > 128 ? 240 : 224)
#endif
  constexpr int WSP_P_REGS = VBW_WSP_P_REGS, WSP_C_REGS = VBW_WSP_C_REGS;
  static_assert(!(WS == 2) || 128 * WSP_P_REGS + 256 * WSP_C_REGS <= 384 * 168, "WSP registers");
  static_assert(!WS || 128 * WS_P_REGS + 128 * WGS * WS_C_REGS <=
                           128 * (WGS + 1) * (65536 / (128 * (WGS + 1)) / 8 * 8), "WS registers");
  // FP8: dense warp-specialized only; Q and K rows and V^T's 128-key rows are whole 128-byte panels
  static_assert(!FP8 || (WS && !SPARSE && BLOCK_N == 128 && HEAD_DIM % 128 == 0), "FP8: ws, BLOCK_N 128, D 128 / 256");
  // WS == 2: persistent warp-specialized CTAs (see PERSIST below); dense inputs, two consumer warpgroups
  constexpr bool PERSIST = WS == 2;
  static_assert(WS >= 0 && WS <= 2 && (!PERSIST || (!SPARSE && WGS == 2)), "WS: 0, 1, or 2 (persistent)");
  constexpr int NS = BLOCK_N / 2;    // S accumulators a thread
  constexpr int NO = HEAD_DIM / 2;   // O accumulators a thread
  constexpr int NN = BLOCK_N / 8;    // n8 column tiles of S
  constexpr int ND = HEAD_DIM / 8;   // n8 column tiles of O
  constexpr int KP = BLOCK_N / (FP8 ? 32 : 16);  // k steps of P V
  constexpr int EPP = 128 / (int)sizeof(TI);  // elements of a 128-byte swizzled panel row
  constexpr u32 Q_LOAD = BLOCK_M * HEAD_DIM * sizeof(TI);
  constexpr u32 Q_BYTES = BLOCK_M * HEAD_DIM * 2;  // Q, then the epilogue's staged 16-bit O (PERSIST: O's own)
  constexpr u32 KV_BYTES = BLOCK_N * HEAD_DIM * sizeof(TI);  // one K or V tile (FP8: V^T [HEAD_DIM][BLOCK_N])
  const float NEG_INF = __int_as_float(0xff800000);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  const u32 sbase = (raw + 1023u) & ~1023u;
  const u32 sQ = sbase;
  // PERSIST up to D = 128: O is staged in its own area after Q's, so the next work tile's Q can land during the
  // epilogue; above (Q, O and two K / V stages would not fit), in Q's buffer as without PERSIST, and the next Q
  // waits for the epilogue
  constexpr bool SEP_O = PERSIST && HEAD_DIM <= 128;
  // STORERS (SEP_O): the producer warpgroup's warps 1 and 2 store consumer warpgroup 0's and 1's staged O rows,
  // so the consumers only normalize and stage. Hand-off per warpgroup w: mbarrier "staged" (every consumer thread
  // arrives: compute-sanitizer's racecheck sees a thread's own release, not a warp's through one lane) and named
  // barrier 13 + w "sent" (the storer's bar.arrive, the consumers' bar.sync: PTX's producer / consumer pattern;
  // an mbarrier wait there took the consumers' loop off the uniform datapath, 209 -> 8 uniform instructions)
  constexpr bool STORERS = SEP_O && VBW_WSP_STORERS;
  // QDB (SEP_O): two Q buffers (work tile n's in buffer n % 2, so the producer loads the next tile's Q as soon as
  // the tile before this one is done with its buffer), then O's area: 3 Q_BYTES before the K/V ring
  constexpr bool QDB = SEP_O && VBW_WSP_QDB;
  constexpr int Q_AREAS = QDB ? 3 : SEP_O ? 2 : 1;
  const u32 sK = sbase + Q_BYTES * Q_AREAS;  // slot st: sK + st * 2 * KV_BYTES; V follows its K
  unsigned char* const sQ_ptr = smem_raw + (sbase - raw);
  unsigned char* const sO_ptr = sQ_ptr + (Q_AREAS - 1) * Q_BYTES;

  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int warp = (tid >> 5) & 3;  // warp within the warpgroup
  const int lane = tid & 31;
  // (the D = 64 warp-specialized tiles run at the edge of their registers: what is cheaper elsewhere, fast_div
  // here and cta_sh below, cost them 4-32 bytes of spills in the loop; they are long-key tiles, where a CTA's
  // head and tail are noise)
  constexpr bool EDGE = WS && HEAD_DIM == 64;
  // The TMA mbarriers follow the K/V slots: [0] Q, [1 + s] K of slot s, [1 + STAGES + s] V of slot s; WS adds
  // the slots' "empty" barriers, [1 + 2 STAGES + s] K and [1 + 3 STAGES + s] V, one arrival per consumer warp;
  // PERSIST one more, [1 + 4 STAGES]: Q's buffer is free (every S of the work tile done), one per consumer warp.
  // QDB two more: [2 + 4 STAGES] Q buffer 1 free, [3 + 4 STAGES] Q buffer 1 landed (buffer 0's are [1 + 4 STAGES]
  // and [0]).
  const u32 bar = sK + 2 * STAGES * KV_BYTES;
  constexpr int NBAR = 1 + (WS ? 4 : 2) * STAGES + (PERSIST ? 1 : 0) + (QDB ? 2 : 0);
  const u32 q_empty = bar + 8 * (1 + 4 * STAGES);  // (PERSIST)
  // work tile n's (Q count n) Q buffer, its barriers and their phases
  auto q_buf = [&](int n) -> u32 { return sQ + (QDB ? (u32)(n & 1) * Q_BYTES : 0u); };
  auto q_full = [&](int n) -> u32 { return QDB && (n & 1) ? bar + 8 * (3 + 4 * STAGES) : bar; };
  auto q_free = [&](int n) -> u32 { return q_empty + (QDB ? 8u * (u32)(n & 1) : 0u); };
  auto q_phase = [&](int n) -> u32 { return (u32)(QDB ? n >> 1 : n) & 1u; };
  // After the mbarriers: 8 bytes a consumer warp that pin_softmax stores to (the values are never read; producer
  // warps never call it, their `sink` would fall on the list), then the sparse block list; the mbarriers and
  // those slots fit the 256 bytes the launcher reserves past the tiles.
  // STORERS then 16 bytes a consumer warpgroup, the hand-off slot (O's global address for the work tile, its
  // rows), and its "staged" mbarrier
  static_assert(8 * NBAR + 8 * (NT / 32) + (STORERS ? 24 * WGS : 0) <= 256, "mbarriers + pin_softmax slots");
  const u32 sink = bar + 8 * NBAR + 8 * (threadIdx.x >> 5);
  unsigned char* const o_slot = smem_raw + (bar - raw) + 8 * NBAR + 8 * (NT / 32);
  const u32 o_staged = bar + 8 * NBAR + 8 * (NT / 32) + 16 * WGS;  // (STORERS: warpgroup w's at + 8 w)
  auto init_bars = [&]() {
    for (int i = 0; i < NBAR; ++i)
      mbar_init<false>(bar + 8 * i, i < 1 + 2 * STAGES || (QDB && i == 3 + 4 * STAGES) ? 1 : 4 * WGS);
    if constexpr (STORERS)
      for (int w = 0; w < WGS; ++w) mbar_init<false>(o_staged + 8 * w, 128);
    mbar_init_fence();  // (one fence for all of them, on the critical path of a CTA's first loads)
  };
  // PERSIST: K/V ordinals and Q loads before the work tile in hand (the ring and Q's barrier run on across the
  // CTA's work tiles; each role counts its own); 0 otherwise.
  int gb = 0, nq = 0;
  // The K/V ring by a work tile's ordinal i: the ring's ordinal gb + i lives in slot (gb + i) % STAGES (K at
  // kslot(i), its V KV_BYTES after), as that slot's fill number (gb + i) / STAGES; TMA completes the slot
  // barrier's phase of parity (fill number) & 1.
  auto kslot = [&](int i) -> u32 { return sK + ((u32)(gb + i) % STAGES) * (2 * KV_BYTES); };
  auto kbar = [&](int i) -> u32 { return bar + 8 + 8 * ((u32)(gb + i) % STAGES); };
  auto vbar = [&](int i) -> u32 { return kbar(i) + 8 * STAGES; };
  auto kempty = [&](int i) -> u32 { return kbar(i) + 16 * STAGES; };  // (WS)
  auto vempty = [&](int i) -> u32 { return kbar(i) + 24 * STAGES; };
  auto phase = [&](int i) -> u32 { return ((u32)(gb + i) / STAGES) & 1u; };
  // The calling thread issues the TMA boxes (one per 128-byte column panel) of `rows` rows from row0 into dst,
  // completing on barrier b; and FP8's V^T [B, Hkv, HEAD_DIM, keys] of key tile m into ordinal i's V slot: one
  // box of HEAD_DIM rows x BLOCK_N keys (128 bytes).
  auto tma_rows = [&](u32 dst, const vbw::TmaDesc* map, u32 b, int rows, int head, int row0, int batch) {
    mbar_expect_tx(b, (u32)rows * HEAD_DIM * sizeof(TI));
#pragma unroll
    for (int p = 0; p < HEAD_DIM / EPP; ++p) tma_load_4d(dst + p * rows * 128, map, b, p * EPP, head, row0, batch);
  };
  auto tma_vt = [&](int i, int m, int head, int batch) {
    mbar_expect_tx(vbar(i), KV_BYTES);
    tma_load_4d(kslot(i) + KV_BYTES, &tm_v, vbar(i), m * BLOCK_N, 0, head, batch);
  };
  // WS: the consumer warpgroups' turns at the tensor cores go round: 0, 1, (2,) 0, ...; named barrier 8 + w is
  // warpgroup w's (256 threads: the waiter and the one passing the turn)
  const int next_wg = wg + 1 == WGS ? 0 : wg + 1;
  auto turn_wait = [&]() { named_bar(8 + wg, 256); };
  auto turn_pass = [&]() { named_arrive(8 + next_wg, 256); };
  // The CTA's work again for the epilogue, from shared memory: recomputing it there (with the varlen offsets'
  // global loads) took ~720 clocks of a CTA's tail on the H100, and registers kept across the loop would cost
  // the loop. Written by thread 0; read after a barrier of the CTA (the first K/V tile's, or the one before
  // the epilogue when there is no tile). Not on the EDGE, nor PERSIST (whose epilogue recomputes it, dense).
  constexpr bool CTA_SH = !EDGE && !PERSIST;
  __shared__ vbw_attn::Cta cta_sh;

  // One work tile: BLOCK_M query rows of one (b, h). work = -1: the CTA's own, by its block index (PERSIST: the
  // consumers' part of work tile `work`; the producer walks the same tiles in `produce` below).
  auto body = [&](const int work) {
  const vbw_attn::Cta cta = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
  if (CTA_SH && tid == 0) cta_sh = cta;
  if (!PERSIST && cu_q != nullptr &&
      vbw_attn::varlen_bad<TO, BLOCK_M>(cta, cu_q, cu_k, batch, seqlen_q, seqlen_k, num_m, o, lse, q_rs, d,
                                        lse_stride_h, err))
    return;
  if (cta.m0 >= cta.sq) return;
  // The work tile's score transform. FP8: its descales (q, k, v: descale[0], [ds_ts], [2 ds_ts] past the
  // offset of batch b and KV head h / group, ds_bs / ds_hs 0 for one value a tensor) fold into the score scale
  // (S is in e4m3 units) and the output; P is stored as 256 p (<= 256 < 448, e4m3's subnormals then reach
  // p = 2^-17), which the row sums carry too.
  float sl2 = scale_log2, pre = cap_prescale, v_ds = 1.f;
  int mode = score_mode;
  if constexpr (FP8) {
    if (descale != nullptr) {
      const float* ds = descale + (long long)cta.b * ds_bs + (long long)(cta.h / group) * ds_hs;
      const float qk = ds[0] * ds[ds_ts];
      // sl2 must stay > 0 (the softmax subtracts the row max): a product that is not (qk <= 0 or NaN, or a
      // tiny qk whose product with sl2 underflows to 0) becomes a prescale of the scores instead, as
      // attention.py's score_transform does for softmax_scale <= 0
      if (mode != 0) pre *= qk;
      else if (sl2 * qk > 0.f) sl2 *= qk;
      else { mode = 2; pre = qk; }
      v_ds = ds[2 * ds_ts];
    }
  }
  const int sk = cta.sk;
  const int rows_q = min(BLOCK_M, cta.sq - cta.m0);
  const TI* kg = k + cta.k_start * kv_rs + (long long)(cta.h / group) * d;
  const long long vk = v - k;

  int n_lo, n_hi, nm_lo, nm_hi;
  vbw_attn::tile_range<BLOCK_N>(cta, rows_q, n_lo, n_hi, nm_lo, nm_hi);
  // The CTA's key tiles by ordinal i = 0 .. cnt - 1: dense, n_hi - 1 down to n_lo; sparse, the listed blocks.
  int cnt = n_hi - n_lo;
  const int* sp_list = nullptr;
  constexpr bool EARLY_Q = SPARSE && TMA;
  // WS: thread 0 issues the first K / V tile with Q, right after the barriers' initialization, instead of the
  // producer after the CTA barrier and its setmaxnreg (~900 clocks later on the H100); not with a sparse list,
  // which is read after Q's load is issued.
  constexpr bool EARLY_KV = WS && TMA && !EARLY_Q && !PERSIST;
  if constexpr (EARLY_Q) {
    // Q does not depend on the block list: its load is issued before the list is read, so the two latencies
    // overlap (dense layout only). Every way out below waits for it first (a CTA must not exit, nor reuse Q's
    // buffer, under a pending copy).
    if (tid == 0) {
      init_bars();
      mbar_expect_tx(bar, Q_LOAD);
#pragma unroll
      for (int p = 0; p < HEAD_DIM / EPP; ++p) tma_load_4d(sQ + p * BLOCK_M * 128, &tm_q, bar, p * EPP, cta.h, cta.m0, cta.b);
    }
  }
  if constexpr (SPARSE) {
    const long long pat = (long long)cta.b * (heads / group) + cta.h / group;
    const int* ip = sp_indptr + pat * sp_ptr_stride;
    const int qb = cta.m0 / BLOCK_M;
    const int s0 = ip[qb], s1 = ip[qb + 1];
    // a row longer than sp_nkb repeats a block: refused too (the ids are staged in shared memory, sp_nkb slots)
    int bad = (qb == 0 && s0 != 0) || s0 < 0 || s1 < s0 || s1 > sp_nnz || s1 - s0 > sp_nkb;
    const int* ids = sp_indices + pat * sp_idx_stride + (bad ? 0 : s0);
    // the ids go to shared memory after the K/V ring and its mbarriers: tile(i) is then one shared load, off
    // the critical path of the TMA issue and the mask test
    int* list = reinterpret_cast<int*>(smem_raw + (sK - raw) + 2 * STAGES * KV_BYTES + 8 * NBAR +
                                       8 * (NT / 32));
    if (!bad)
      for (int i = tid; i < s1 - s0; i += NT) {
        const int id = ids[i];
        bad |= (unsigned)id >= (unsigned)sp_nkb;
        list[i] = id;
      }
    sp_list = list;
    if (__syncthreads_or(bad)) {  // (also: thread 0's mbarrier initialization is seen by all from here on)
      if constexpr (EARLY_Q) mbar_wait(bar, 0);
      if (tid == 0) vbw_err::flag(err, vbw_err::SPARSE_INDICES, qb);
      const unsigned short nan = (unsigned short)vbw::pack2<TO>(__int_as_float(0x7fc00000), 0.f);  // TO's NaN bits
      unsigned short* o16 = reinterpret_cast<unsigned short*>(o + (cta.q_start + cta.m0) * q_rs + (long long)cta.h * d);
      for (int i = tid; i < rows_q * d; i += NT) o16[(long long)(i / d) * q_rs + i % d] = nan;
      if (lse != nullptr)
        for (int r = tid; r < rows_q; r += NT)
          lse[(long long)cta.h * lse_stride_h + (long long)cta.b * heads * seqlen_q + cta.m0 + r] =
              __int_as_float(0x7fc00000);
      return;
    }
    cnt = s1 - s0;
  }
  auto tile = [&](int i) -> int {
    if constexpr (SPARSE) return sp_list[i];
    return n_hi - 1 - i;
  };

  float acc_o[NO];
#pragma unroll
  for (int i = 0; i < NO; ++i) acc_o[i] = 0.f;
  float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};

  if (cnt > 0) {
    // The lambdas below take tile ordinals (the ring's slots: kslot etc. above); tile(i) is the key tile's index.
    // One thread issues a tile's TMA boxes at row row0 of the CTA's sequence. Dense maps are [d, heads, seqlen,
    // batch]: their bounds zero-fill columns past d and rows past the sequence. Packed (varlen) maps are [d,
    // heads, total tokens, 1]: rows past a sequence hold the next one's tokens, which the mask hides in S and
    // clear_v_tail zeroes in V (see attention.py).
    // (the issuing thread: 0, or WS's producer thread, NT; Q always comes from thread 0)
    auto tma_tile = [&](u32 dst, const vbw::TmaDesc* map, u32 b, int rows, int head, int row0, int who) {
      if (threadIdx.x == who) tma_rows(dst, map, b, rows, head, row0, cu_q != nullptr ? 0 : cta.b);
    };
    // The TMA row of K / V row 0 of this sequence (packed inputs: its first token).
    const int kv_row = cu_q != nullptr ? (int)cta.k_start : 0;
    // (who: the issuing thread of a TMA load)
    auto load_k = [&](int i, int who = WS ? 128 * WGS : 0) {  // (128 * WGS: NT, the producer thread)
      const int m = tile(i);
      if constexpr (TMA) {
        tma_tile(kslot(i), &tm_k, kbar(i), BLOCK_N, cta.h / group, kv_row + m * BLOCK_N, who);
      } else {
        vbw_attn::load_tile_sw<BLOCK_N, HEAD_DIM, NT>(kslot(i), kg + (long long)m * BLOCK_N * kv_rs, kv_rs,
                                                      sk - m * BLOCK_N, d);
      }
    };
    auto load_v = [&](int i, int who = WS ? 128 * WGS : 0) {  // (128 * WGS: NT, the producer thread)
      const int m = tile(i);
      if constexpr (FP8) {
        if (threadIdx.x == who) tma_vt(i, m, cta.h / group, cta.b);
      } else if constexpr (TMA) {
        tma_tile(kslot(i) + KV_BYTES, &tm_v, vbar(i), BLOCK_N, cta.h / group, kv_row + m * BLOCK_N, who);
      } else {
        vbw_attn::load_tile_sw<BLOCK_N, HEAD_DIM, NT>(kslot(i) + KV_BYTES,
                                                      kg + vk + (long long)m * BLOCK_N * kv_rs, kv_rs,
                                                      sk - m * BLOCK_N, d);
      }
    };
    // TMA: wait until tile m's K (V) has landed (its mbarrier phase completed). cp.async: nothing, the group
    // waits and the barrier before them did that.
    auto wait_k = [&](int i) { if constexpr (TMA) mbar_wait(kbar(i), phase(i)); };
    auto wait_v = [&](int i) { if constexpr (TMA) mbar_wait(vbar(i), phase(i)); };
    // Packed TMA loads: V rows of tile m past the sequence's end hold the next sequence's values, and
    // P (0 there) times an Inf or NaN would still be NaN: wait for V(m) and zero them. Only the tile holding
    // key sk - 1 has any, and it is the first tile a CTA runs (n_hi - 1) or none it runs (causal / window
    // bounds below sk), so this is called once, before the loop. Generic stores, then a proxy fence and a
    // barrier before wgmma reads the tile.
    auto clear_v_tail = [&](int it) {
      if constexpr (TMA && !FP8 && !PERSIST) {  // (FP8 and PERSIST run dense inputs only)
        const int r0 = sk - tile(it) * BLOCK_N;
        if (cu_q == nullptr || r0 >= BLOCK_N) return;
        wait_v(it);
        constexpr int CPR = HEAD_DIM / 8;
        const u32 vs = kslot(it) + KV_BYTES;
#pragma unroll  // (a fixed trip count: a loop bounded by r0 here cost the main loop 14-30 registers)
        for (int i = 0; i < (BLOCK_N * CPR + NT - 1) / NT; ++i) {
          const int c = tid + i * NT;
          const int r = c / CPR, ch = c % CPR;
          if (r >= r0 && r < BLOCK_N)
            *reinterpret_cast<uint4*>(smem_raw + (vs - raw) + (ch >> 3) * (BLOCK_N * 128) + r * 128 +
                                      (((ch & 7) ^ (r & 7)) << 4)) = make_uint4(0u, 0u, 0u, 0u);
        }
        fence_async_smem();
        if constexpr (WS) named_bar(5, NT); else __syncthreads();  // (WS: the consumers)
      }
    };
    const u32 q_wg = q_buf(nq) + wg * 64 * 128;  // this warpgroup's rows of every Q panel
    // S = Q K(m)^T, issued and committed (not waited for).
    auto issue_s = [&](float (&s)[NS], int i) {
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM * (int)sizeof(TI) / 32; ++kk) {  // 32-byte k steps: k16 (16-bit), k32 (FP8)
        const u32 col = (kk & 3) << 5;
        const u64 da = desc_sw128_k(q_wg + (kk >> 2) * (BLOCK_M * 128) + col);
        const u64 db = desc_sw128_k(kslot(i) + (kk >> 2) * (BLOCK_N * 128) + col);
        if constexpr (FP8) WgmmaSS8<BLOCK_N>::run(s, da, db, kk > 0);
        else WgmmaSS<T, BLOCK_N, 0>::run(s, da, db, kk > 0);
      }
      wg_commit();
    };
    // Online softmax of S(m) in registers: updates the row max and sums, writes P(m) (as wgmma A fragments,
    // k step t = keys 16t..16t+15) to pa, and returns the factor O must be scaled by before P(m) V(m) is added
    // (corr.x / .y for the thread's two rows; 1 when no row max of the warp moved).
    // softmax_s: the same, leaving P(m) in s as floats (pack_p then packs it).
    auto softmax_s = [&](float (&s)[NS], int it) -> float2 {
      const int m = tile(it);
      if (mode == 1) {
#pragma unroll
        for (int i = 0; i < NS; ++i) s[i] = tanhf(s[i] * pre);
      } else if (mode == 2) {
#pragma unroll
        for (int i = 0; i < NS; ++i) s[i] *= pre;
      }
      if (m < nm_lo || m >= nm_hi) {
        // (recomputed, not read from cta_sh: it runs on the uniform datapath, so it takes no registers at the
        // loop's peak, where cta_sh's loads cost 16 bytes of spills at D = 64)
        const vbw_attn::Cta c = EDGE ? VBW_CTA_LEAN_AT(work) : VBW_CTA_AT(work);
        const int c0 = m * BLOCK_N;
        const int lo_off = c.lo_base - c0;
        const int hi_off = c.hi_base - c0;
        const int hi_cap = min(BLOCK_N, c.sk - c0);
        vbw_attn::mask_tile<NN>(*reinterpret_cast<float(*)[NN][4]>(s),
                                (threadIdx.x >> 7) * 64 + ((threadIdx.x >> 5) & 3) * 16, lo_off, hi_off, hi_cap,
                                threadIdx.x & 31);
      }
      float msc[2], corr[2];
      {
        const bool moved =
            vbw_attn::online_max<NN>(*reinterpret_cast<float(*)[NN][4]>(s), row_max, sl2, msc, corr);
        if (!__any_sync(0xffffffffu, moved)) corr[0] = corr[1] = 1.f;
        row_sum[0] *= corr[0];
        row_sum[1] *= corr[1];
      }
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        s[i] = FP8 ? fast_exp2(fmaf(s[i] - msc[(i >> 1) & 1], sl2, 8.f))   // 256 p
                   : fast_exp2((s[i] - msc[(i >> 1) & 1]) * sl2);
        row_sum[(i >> 1) & 1] += s[i];
      }
      return make_float2(corr[0], corr[1]);
    };
    // P as wgmma A fragments, one per k step (KP of them). 16-bit: the accumulator layout is the A layout.
    // FP8 (k32): A byte k of a lane's rows is 4t + k % 4 (+ 16 for k >= 4), the accumulators hold keys 2t, 2t + 1
    // of each n8 tile; packed as they are, byte position p of a k32 step carries key
    // 16 (p / 16) + 2 ((p % 16) / 4) + (p % 2) + 8 ((p / 2) % 2) of it, and V^T's keys are stored in that order
    // (attention_fp8.cu), so P V needs no shuffle.
    auto pack_p = [&](const float (&s)[NS], u32 (&pa)[KP][4]) {
#pragma unroll
      for (int t = 0; t < KP; ++t) {
        if constexpr (FP8) {
          const float* x = s + 16 * t;
          pa[t][0] = vbw::e4m3x4(x[0], x[1], x[4], x[5]);
          pa[t][1] = vbw::e4m3x4(x[2], x[3], x[6], x[7]);
          pa[t][2] = vbw::e4m3x4(x[8], x[9], x[12], x[13]);
          pa[t][3] = vbw::e4m3x4(x[10], x[11], x[14], x[15]);
        } else {
          pa[t][0] = pack2<T>(s[8 * t + 0], s[8 * t + 1]);
          pa[t][1] = pack2<T>(s[8 * t + 2], s[8 * t + 3]);
          pa[t][2] = pack2<T>(s[8 * t + 4], s[8 * t + 5]);
          pa[t][3] = pack2<T>(s[8 * t + 6], s[8 * t + 7]);
        }
      }
    };
    auto softmax_p = [&](float (&s)[NS], int it, u32 (&pa)[KP][4]) -> float2 {
      const float2 corr = softmax_s(s, it);
      pack_p(s, pa);
      return corr;
    };
    auto rescale_o = [&](float2 corr) {
      if (__any_sync(0xffffffffu, corr.x != 1.f || corr.y != 1.f)) {
#pragma unroll
        for (int i = 0; i < NO; ++i) acc_o[i] *= (i & 2) ? corr.y : corr.x;
      }
    };
    // Before the wait for P(n) V(n) that follows a softmax: a shared-memory store of the row sums (lane 0, to
    // its warp's slot), which depend on every exponential. ptxas keeps a store and a wgmma wait in order, so the
    // softmax runs while that GEMM does; without it ptxas hoisted the wait up to the one for S(n + 1), and the
    // two never overlapped (H100: 5-13% of the ws kernel's time at D = 128 / 192 / 256 from 2k keys;
    // notes/kernel-history.md, attention_fwd.cu v9).
    auto pin_softmax = [&]() {
      asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %3, 0;\n@p st.shared.v2.f32 [%0], {%1, %2};\n}\n"
                   :: "r"(sink), "f"(row_sum[0]), "f"(row_sum[1]), "r"(lane) : "memory");
    };
    // O += P(m) V(m), issued and committed.
    auto issue_pv = [&](const u32 (&pa)[KP][4], int i) {
      // O += P V: V is the B operand read MN-major (rows are keys = k, columns d = n); 64-wide d panels
      // BLOCK_N * 128 bytes apart (LBO), 8-key groups 1024 bytes apart. FP8: V^T, K-major (HEAD_DIM rows of
      // BLOCK_N = 128 keys, one panel), k32 steps 32 bytes apart.
      wg_fence();
#pragma unroll
      for (int t = 0; t < KP; ++t) {
        if constexpr (FP8)
          WgmmaRS8<HEAD_DIM>::run(acc_o, pa[t][0], pa[t][1], pa[t][2], pa[t][3],
                                  desc_sw128_k(kslot(i) + KV_BYTES + ((t & 3) << 5)));
        else
          WgmmaRS<T, HEAD_DIM, 1>::run(acc_o, pa[t][0], pa[t][1], pa[t][2], pa[t][3],
                                       desc_sw128_mn(kslot(i) + KV_BYTES + t * 16 * 128, BLOCK_N * 128));
      }
      wg_commit();
    };

    int n = 0;  // the ordinal of the tile in hand
    if constexpr (TMA) {
      if constexpr (!EARLY_Q && !PERSIST) {  // (else issued above, before the list; PERSIST: by the producer)
        if (threadIdx.x == 0) {
          init_bars();  // (fenced for the async proxy: this thread's TMA may use them at once)
          tma_tile(sQ, &tm_q, bar, BLOCK_M, cta.h, (cu_q != nullptr ? (int)cta.q_start : 0) + cta.m0, 0);
          if constexpr (EARLY_KV) {
            load_k(0, 0);
            load_v(0, 0);
          }
        }
        __syncthreads();  // the barriers are initialized before anyone else waits on them
      }
    } else {
      vbw_attn::load_tile_sw<BLOCK_M, HEAD_DIM, NT>(sQ, q + (cta.q_start + cta.m0) * q_rs + (long long)cta.h * d,
                                                    q_rs, rows_q, d);
    }
    float s[NS];
    if constexpr (WS) {
      // Warp-specialized (FlashAttention-3's schedule): the last warpgroup is the producer, one thread of which
      // streams K and V through the ring as the consumers free the slots (their "empty" barriers); the
      // consumer warpgroups take turns at the tensor cores (named barriers 8 + wg): a warpgroup waits for its
      // turn, issues S(i+1) = Q K^T and O += P(i) V(i), hands the turn over, and runs the softmax of S(i+1)
      // while the others' GEMMs run. The producer gives its registers to the consumers (setmaxnreg).
      if (!PERSIST && wg == WGS) {  // (PERSIST: the producer runs `produce`, never this)
        setmaxnreg_dec<WS_P_REGS>();
        if (tid == NT) {
          for (int i = EARLY_KV ? 1 : 0; i < cnt; ++i) {  // (EARLY_KV: thread 0 issued the first tile's)
            if (i >= STAGES) mbar_wait(kempty(i), phase(i) ^ 1u);  // the slot's previous tile is released
            load_k(i);
            if (i >= STAGES) mbar_wait(vempty(i), phase(i) ^ 1u);
            load_v(i);
          }
        }
        return;  // (the epilogue is the consumers'; the CTA lives on until they finish)
      }
      if constexpr (!PERSIST) setmaxnreg_inc<WS_C_REGS>();
      auto release = [&](u32 b) { if (lane == 0) mbar_arrive(b); };
      if (!PERSIST && wg == WGS - 1) turn_pass();  // warpgroup 0 goes first (PERSIST: once, before its first tile)
      mbar_wait(q_full(nq), q_phase(nq));  // Q
      wait_k(0);
      clear_v_tail(0);
      turn_wait();
      issue_s(s, 0);
      turn_pass();
      wg_wait<0>();
      release(kempty(0));
      // One P register set: the softmax of S(i+1) runs on its float scores while P(i) V(i) reads P(i), and
      // P(i+1) is packed once that GEMM is done (FlashAttention-3 does the same; two sets cost BLOCK_N / 4
      // registers, which BLOCK_N = 192 at D = 128 cannot spare).
      u32 pa[KP][4];
      softmax_p(s, 0, pa);  // O is still 0: nothing to rescale
      for (; n < cnt - 1; ++n) {
        wait_k(n + 1);
        wait_v(n);
        turn_wait();
        issue_s(s, n + 1);
        issue_pv(pa, n);
        turn_pass();
        wg_wait<1>();
        release(kempty(n + 1));
        const float2 corr = softmax_s(s, n + 1);
        pin_softmax();
        wg_wait<0>();
        release(vempty(n));
        rescale_o(corr);
        pack_p(s, pa);
      }
      if constexpr (SEP_O) release(q_free(nq));  // every S of this tile is done: a later Q may land here
      wait_v(cnt - 1);
      turn_wait();
      issue_pv(pa, cnt - 1);
      if (PERSIST || wg != WGS - 1) turn_pass();  // (without PERSIST the last warpgroup's last turn has no taker)
      wg_wait<0>();
      if constexpr (PERSIST) release(vempty(cnt - 1));  // the ring runs on into the next tile
    } else if constexpr (!OVERLAP) {
      load_k(0);
      // Tiles n .. n - STAGES + 2 in flight before the loop; each iteration refills the slot of the tile just
      // finished with the tile STAGES - 1 ahead. cp.async commits a group every time (empty past the last
      // tile) so that "all but the newest STAGES - 2 groups" is always tile n.
      load_v(0);
      cp_async_commit();
#pragma unroll
      for (int i = 1; i < STAGES - 1; ++i) {
        if (i < cnt) {
          load_k(i);
          load_v(i);
        }
        cp_async_commit();
      }
      if constexpr (TMA) mbar_wait(bar, 0);  // Q
      clear_v_tail(0);
      for (; n < cnt; ++n) {
        if constexpr (!TMA) {
          cp_async_wait<STAGES - 2>();
          fence_async_smem();  // this thread's cp.async writes -> the async proxy that wgmma reads through
        }
        __syncthreads();  // (cp.async: everyone's K(n), V(n) landed;) everyone is done with tile n+1, refilled now
        if (n + STAGES - 1 < cnt) {
          load_k(n + STAGES - 1);
          load_v(n + STAGES - 1);
        }
        cp_async_commit();
        wait_k(n);
        wait_v(n);
        issue_s(s, n);
        wg_wait<0>();
        u32 pa[KP][4];
        rescale_o(softmax_p(s, n, pa));
        issue_pv(pa, n);
        wg_wait<0>();
      }
    } else {
      // FlashAttention-3's intra-warpgroup overlap: while P(m) V(m) runs on the tensor cores, S(m-1) (issued
      // just before it, waited for alone) goes through the softmax. O is rescaled for P(m-1) only once P(m) V(m)
      // is done, and P alternates between two register sets, so no register of an in-flight wgmma is touched.
      // Iteration m needs K(m-1) and V(m); it refills the slots of K(m) (S(m) finished) and V(m+1).
      load_k(0);
      cp_async_commit();
      load_v(0);
      if (cnt > 1) load_k(1);
      cp_async_commit();
      if constexpr (TMA) {
        mbar_wait(bar, 0);  // Q
        wait_k(0);
        clear_v_tail(0);
      } else {
        cp_async_wait<1>();
        fence_async_smem();
        __syncthreads();  // Q, K(n) landed
      }
      issue_s(s, 0);
      wg_wait<0>();
      u32 pa0[KP][4], pa1[KP][4];
      softmax_p(s, 0, pa0);  // O is still 0: nothing to rescale
      // Ordinals i < cnt - 1; the last one (no S(i+1)) is peeled off so every wgmma group here is unconditional
      // (with a conditional one, ptxas cannot tell which group wait_group 1 retires and serializes them all).
      auto step = [&](const u32 (&pa_cur)[KP][4], u32 (&pa_next)[KP][4], int i) {
        if constexpr (!TMA) {
          cp_async_wait<0>();
          fence_async_smem();
        }
        __syncthreads();  // (cp.async: K(i+1), V(i) landed;) everyone is done with K(i) and V(i-1)
        if (i + 2 < cnt) load_k(i + 2);
        load_v(i + 1);
        cp_async_commit();
        wait_k(i + 1);
        wait_v(i);
        issue_s(s, i + 1);
        issue_pv(pa_cur, i);
        wg_wait<1>();
        const float2 corr = softmax_p(s, i + 1, pa_next);
        pin_softmax();
        wg_wait<0>();
        rescale_o(corr);
      };
      auto last = [&](const u32 (&pa_cur)[KP][4]) {
        if constexpr (!TMA) {
          cp_async_wait<0>();
          fence_async_smem();
          __syncthreads();  // V(cnt - 1) landed
        }
        wait_v(cnt - 1);
        issue_pv(pa_cur, cnt - 1);
        wg_wait<0>();
      };
      for (;;) {
        if (n == cnt - 1) { last(pa0); break; }
        step(pa0, pa1, n++);
        if (n == cnt - 1) { last(pa1); break; }
        step(pa1, pa0, n++);
      }
    }
  }
  if constexpr (EARLY_Q) {
    if (cnt == 0) mbar_wait(bar, 0);  // an empty list: Q's copy lands before its buffer stages O
  }
  if constexpr (WS && !PERSIST) {
    if (wg == WGS) return;  // (cnt == 0: the producer had nothing to load)
  }
  if constexpr (PERSIST) {
    if (cnt > 0) {  // the ring and Q's barrier run on into the next work tile
      gb += cnt;
      ++nq;
    }
  }
  if constexpr (PERSIST && !SEP_O) {
    if (cnt == 0) {
      // No key (no Q was loaded for this tile): zero rows and -inf straight to global memory, since Q's buffer,
      // O's staging area here, may be taking the next tile's Q already.
      const vbw_attn::Cta cz = VBW_CTA_AT(work);
      const int rows_z = min(BLOCK_M, cz.sq - cz.m0), t = tid & 127;
      TO* oz = o + (cz.q_start + cz.m0) * q_rs + (long long)cz.h * d;
      for (int c = t; c < 64 * (d / 8); c += 128) {  // (d % 8 == 0: the wgmma kernel's inputs are 16-byte rows)
        const int r = wg * 64 + c / (d / 8);
        if (r < rows_z) *reinterpret_cast<uint4*>(oz + r * q_rs + (c % (d / 8)) * 8) = make_uint4(0u, 0u, 0u, 0u);
      }
      if (lse != nullptr && t < 64 && wg * 64 + t < rows_z)
        lse[(long long)cz.h * lse_stride_h + (long long)cz.b * heads * seqlen_q + cz.m0 + wg * 64 + t] = NEG_INF;
      return;
    }
  }

  // Epilogue: normalize, LSE, stage this warpgroup's O rows in its own (swizzled) rows of Q's buffer (SEP_O:
  // of O's area; no other warpgroup reads them, and this one's wgmma are drained), then 16-byte coalesced
  // stores (STORERS: by the warpgroup's storer warp, while the consumers go on to their next work tile).
  if (CTA_SH && cnt == 0) named_bar(6, NT);  // (no tile: no barrier since thread 0 wrote cta_sh; the consumers)
  const vbw_attn::Cta ce = CTA_SH ? cta_sh : PERSIST ? VBW_CTA_AT(work) : VBW_CTA_LEAN_AT(work);
  if constexpr (STORERS) named_bar(13 + wg, 160);  // O's area is free: the previous tile is sent
  else if constexpr (PERSIST) named_bar(1 + wg, 128);  // O's area is free: this warpgroup's previous tile is out
  const int m0 = ce.m0;
  const int rows_e = min(BLOCK_M, ce.sq - m0);
  TO* og = o + (ce.q_start + m0) * q_rs + (long long)ce.h * d;
  const long long lse_base =
      (long long)ce.h * lse_stride_h + (cu_q != nullptr ? ce.q_start : (long long)ce.b * heads * seqlen_q);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? v_ds / sum : vbw_attn::nan_or(sum, 0.f);  // NaN scores: NaN row
    const int r = wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      const int col = j * 8 + (lane & 3) * 2;
      *reinterpret_cast<u32*>(sO_ptr + vbw_attn::sw_offset<BLOCK_M>(r, col)) =
          pack2<TO>(acc_o[4 * j + 2 * hf] * inv, acc_o[4 * j + 2 * hf + 1] * inv);
    }
    if (lse != nullptr && (lane & 3) == 0 && r < rows_e) {
      // (FP8: the sums are of 256 p)
      const float val = sum > 0.f ? (row_max[hf] * sl2 + __log2f(sum) - (FP8 ? 8.f : 0.f)) * 0.69314718055994531f
                                  : vbw_attn::nan_or(sum, NEG_INF);
      lse[lse_base + m0 + r] = val;
    }
  }
  if constexpr (STORERS) {  // staged: the storer warp takes it from here
    if ((tid & 127) == 0) {
      *reinterpret_cast<TO**>(o_slot + 16 * wg) = og;
      *reinterpret_cast<int*>(o_slot + 16 * wg + 8) = rows_e;
    }
    mbar_arrive(o_staged + 8 * wg);
    return;
  }
  named_bar(1 + wg, 128);
  vbw_attn::store_rows_sw<BLOCK_M, HEAD_DIM, 128, 8 * HEAD_DIM / 128>(og, q_rs, sO_ptr, wg * 64, rows_e, d, tid & 127);
  if constexpr (PERSIST && !SEP_O) {  // this warp's reads of Q's buffer are done: the next Q may land there
    fence_async_smem();
    __syncwarp();
    if (lane == 0) mbar_arrive(q_empty);
  }
  };  // body

  if constexpr (PERSIST) {
    // Persistent CTAs (the launcher starts at most one an SM): CTA c takes one work tile of each round of
    // gridDim.x tiles in cta_info's order (work_of below). The producer thread walks the same tiles and runs
    // ahead across them: a tile's first K / V slots are refilled as the previous tile's consumers release them,
    // its Q as soon as both consumer warpgroups are done with that buffer's previous Q (q_free; QDB: the Q of
    // the tile two back, one buffer: the previous tile's), so the next tile's loads
    // are in flight during this one's last P V and epilogue. Dense inputs only (the launcher never passes
    // varlen offsets or a block list here).
    auto produce = [&](const int work) {
      const vbw_attn::Cta c = VBW_CTA_AT(work);
      int n_lo, n_hi, nm_lo, nm_hi;
      vbw_attn::tile_range<BLOCK_N>(c, min(BLOCK_M, c.sq - c.m0), n_lo, n_hi, nm_lo, nm_hi);
      const int cnt = n_hi - n_lo;
      if (cnt <= 0) return;  // (its consumers write zero rows; no loads, no Q)
      auto load_kv = [&](int i) {
        const int m = n_hi - 1 - i;
        if (gb + i >= STAGES) mbar_wait(kempty(i), phase(i) ^ 1u);  // the slot's previous tile is released
        tma_rows(kslot(i), &tm_k, kbar(i), BLOCK_N, c.h / group, m * BLOCK_N, c.b);
        if (gb + i >= STAGES) mbar_wait(vempty(i), phase(i) ^ 1u);
        if constexpr (FP8) tma_vt(i, m, c.h / group, c.b);
        else tma_rows(kslot(i) + KV_BYTES, &tm_v, vbar(i), BLOCK_N, c.h / group, m * BLOCK_N, c.b);
      };
      if constexpr (QDB) {  // Q first: its buffer was freed by the tile before the one in hand
        if (nq >= 2) mbar_wait(q_free(nq), (u32)((nq >> 1) - 1) & 1u);
        tma_rows(q_buf(nq), &tm_q, q_full(nq), BLOCK_M, c.h, c.m0, c.b);
        load_kv(0);
      } else {  // the first key tile's K / V, then Q (its buffer frees up after the previous tile's last S, when
                // the first slots are free too), then the rest
        load_kv(0);
        if (nq > 0) mbar_wait(q_empty, (u32)(nq - 1) & 1u);
        tma_rows(sQ, &tm_q, bar, BLOCK_M, c.h, c.m0, c.b);
      }
      for (int i = 1; i < cnt; ++i) load_kv(i);
      gb += cnt;
      ++nq;
    };
    if (tid == 0) init_bars();
    __syncthreads();  // the barriers are initialized before anyone waits on them
    const int total = num_m * batch * heads;
    // Round r of the grid takes work tiles r G .. r G + G - 1 (G = gridDim.x), forwards in even rounds and
    // backwards in odd ones: cta_info orders a section's tiles longest first, so under a causal mask the CTA
    // with a round's longest tile gets the next round's shortest (a plain stride gave CTA 0 the longest tile
    // of every round: 0.87x the non-persistent kernel at S = 2k causal, H100).
    // With a schedule (masked launches; sp_indices carries it, never a block list here: PERSIST is dense) CTA
    // c's tile of round r is sched[r G + c] instead (-1: none; the launcher's list has one row more than there
    // are rounds, all -1, so the look-ahead below reads inside it): attention.py's _persistent_schedule gives
    // each round's tiles, longest first, to the CTAs with the least work so far, which the alternating rounds
    // only approximate under a causal mask (by its cost model, 6-11% over the ideal at S = 512-2k and 54% at
    // D = 256 S = 16k against 1-3%).
    const int* const sched = sp_indices;
    auto work_of = [&](int r) {
      const int G = (int)gridDim.x, c = (int)blockIdx.x;
      if (sched != nullptr) return __ldg(sched + r * G + c);
      return r * G + ((r & 1) ? G - 1 - c : c);
    };
    const int rounds = (total + (int)gridDim.x - 1) / (int)gridDim.x;
    // (each role's loop under its own setmaxnreg: ptxas gives a region the registers of the setmaxnreg that
    // dominates it)
    if (wg == WGS) {
      setmaxnreg_dec<WSP_P_REGS>();
      if (tid == NT) {
        int w = work_of(0);
        for (int r = 0; r < rounds; ++r) {
          const int next = work_of(r + 1);  // (a schedule's entry loads during this tile)
          if ((unsigned)w < (unsigned)total) produce(w);
          w = next;
        }
      } else if (STORERS && (warp == 1 || warp == 2)) {
        // Consumer warpgroup `cw`'s storer: for each of its work tiles, wait for the 64 staged O rows, send them
        // with 16-byte stores, release the area; a row count of -1 in the hand-off slot ends it
        const int cw = warp - 1;
        named_arrive(13 + cw, 160);  // (the first tile's area is free)
        for (u32 t = 0;; ++t) {
          mbar_wait(o_staged + 8 * cw, t & 1u);
          const int rows_s = *reinterpret_cast<volatile int*>(o_slot + 16 * cw + 8);
          if (rows_s < 0) break;
          TO* const og = *reinterpret_cast<TO* volatile*>(o_slot + 16 * cw);
          vbw_attn::store_rows_sw<BLOCK_M, HEAD_DIM, 32, 4>(og, q_rs, sO_ptr, cw * 64, rows_s, d, lane);
          __syncwarp();
          named_arrive(13 + cw, 160);  // sent: the area is free for the warpgroup's next tile
        }
      }
      return;
    }
    setmaxnreg_inc<WSP_C_REGS>();
    // Warpgroup 0 goes first: the last one passes it the turn, the others arrive alone on barrier 10 (it
    // completes at once). The same instruction for all, no branch on wg: ptxas keeps code after such a branch
    // off the uniform datapath, and the loop's slot and descriptor arithmetic went to the vector units (H100: the
    // loop ran 8-13% slower).
    named_arrive(wg == WGS - 1 ? 8 + next_wg : 10, wg == WGS - 1 ? 256 : 128);
    int w = work_of(0);
    for (int r = 0; r < rounds; ++r) {
      const int next = work_of(r + 1);
      if ((unsigned)w < (unsigned)total) body(w);
      w = next;
    }
    if (wg == 0) turn_wait();  // (the last warpgroup's pass after its last tile)
    if constexpr (STORERS) {  // no more tiles: tell the storer warp
      named_bar(13 + wg, 160);
      if ((tid & 127) == 0) *reinterpret_cast<int*>(o_slot + 16 * wg + 8) = -1;
      mbar_arrive(o_staged + 8 * wg);
    }
  } else {
    body(-1);
  }
#else
  __trap();  // sm_90a only: the launcher never picks this kernel elsewhere
#endif
}

#undef VBW_CTA_LEAN
#undef VBW_CTA_AT
#undef VBW_CTA_LEAN_AT
