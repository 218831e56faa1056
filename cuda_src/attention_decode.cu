// attention_decode.cu: paged-KV decode attention (flash-decoding), one query token per sequence.
//
// Computes, for every sequence b and query head h (KV head kvh = h / G, G = Hq / Hkv):
//   o[b, h, :] = softmax_j(s_j) . v_j,   s_j = softcap(scale * q[b, h, :] . k_j)   for j in [start_b, L_b)
// where L_b = seq_lens[b], start_b = max(0, L_b - 1 - window_left) (0 when window_left < 0), and token j of
// sequence b lives at row (block_table[b, j >> log2_bs] << log2_bs) + (j & (bs - 1)) of the caches.
//
// Operands (all C-contiguous, checked by vbw_cupy/paged.py):
//   q        [B, Hq, D]                      T = __half or __nv_bfloat16
//   k_cache  [num_blocks, block_size, Hkv, D] T     (a token's head vector: D contiguous elements)
//   v_cache  [num_blocks, block_size, Hkv, D] T
//   block_table int32 [B, max_blocks], seq_lens int32 [B]
//   out      [B, Hq, D] T;  o_part float32 [B, Hq, max_splits, Dp], lse_part float32 [B, Hq, max_splits] (log2)
//   err      the device error word (errors.cuh)
// Index values are checked here, not on the host: a seq_lens[b] outside [1, max_blocks * block_size] or a block
// id in use outside [0, num_blocks) gives sequence b NaN rows and a flag in err, and is never dereferenced.
//
// Tiling (paged_decode<T, DP, NW, STAGES>): one CTA per (split, kv head x head tile, batch) = grid (max_splits,
// Hkv * ceil(G / 16), B). The CTA loads the (up to) 16 query heads of its group once, so every K/V byte it
// reads serves all of them (GQA). The sequence's KV range is cut in 16-token tiles; a sequence splits its
// tiles over up to max_splits CTAs (make_plan: at least min_tiles tiles per split, tiles per split rounded to
// NW); inside a CTA warp w takes tiles w, w + NW, ... and runs its OWN cp.async pipeline of STAGES tiles
// (K and V, 16 x DP each, XOR-swizzled 16-byte chunks) synchronised with __syncwarp only. Each lane loads
// the block-table entry of one token of the tile after next, so page lookups are off the critical path.
// Scores S[16 heads x 16 tokens] = Q K^T and O += P V use mma.sync m16n8k16 (fp32 accumulation), ldmatrix
// from shared memory; online softmax in base 2 with the scale folded into one multiply (softcap: tanhf).
// The NW warps' (m, l, O) are merged through shared memory; a sequence with one split writes o directly,
// otherwise the CTA writes its normalised partial o (rows padded to Dp = roundup(D, 4)) and lse, and
// paged_decode_combine<T> (one CTA per (head, batch)) merges the splits. Head dims are padded to DP in
// {64, 128, 256}: only ceil(D / 16) k-steps run, chunks past D are zero-filled in shared memory; D % 8 != 0
// (or unaligned caches) takes a scalar load path (vec16 = 0) that is correct but slow.
//
// History (the full log: notes/kernel-history.md, section attention_decode.cu). H200, fp16, D=128,
// bench/bench_decode.py (CUDA-graph replays, K/V rotated past L2); % of a 4.22 TB/s device-to-device copy.
//   v1 warp-private cp.async pipelines + mma.sync, split-KV + combine kernel: B=1 x 32k 48.3 us (66%), B=64 x 4k
//      280 us (91%).
//   v2 splits merged by the last CTA (no 2nd launch): tried, slower (52.1 vs 45.6 us at B=1 x 32k), dropped.
//   v3 Q loads first, 16-byte combine, splits by wave efficiency: B=1 x 32k 45.4 us (70%), B=64 x 4k 270 us (94%).
//   v4 index values checked on the device: the host call needs no copy of seq_lens / block_table and no sync.
//   v5 (H100) Q in 16-byte loads, the O rescale skipped while no row's max moves, only the group's rows staged
//      for the warp merge: the 7B decode shape (B=1, 32/32 heads, 640 tokens) 12.5 -> 11.3 us; v2's in-kernel
//      merge retried for <= 8 splits: 0.3 us faster there, 3 us slower at B=1 GQA 512, not kept.
//   v6 one 16-token tile a warp at least per split (paged.py _TILES_PER_WARP, was 2), and the combine kernel
//      requests every split's lse and o slice with seq_lens when there are <= 16 splits (one memory round trip,
//      was three): the 7B decode step in graph replay 2.271 -> 2.252 -> 2.233 ms.

#include "mma.cuh"
#include "errors.cuh"
#include "pdl.cuh"

namespace vbw_decode {

constexpr int TILE = 16;  // tokens per warp tile (the k extent of the P V mma)

struct Plan {
  int start, end, a0, n_tiles, tps, splits;
};

// The split of one sequence; paged_decode and paged_decode_combine must agree, so both call this.
__device__ __forceinline__ Plan make_plan(int L, int window_left, int max_splits, int min_tiles, int granule) {
  Plan p;
  p.end = L;
  p.start = window_left >= 0 ? max(0, L - 1 - window_left) : 0;
  p.a0 = p.start & ~(TILE - 1);
  p.n_tiles = L > p.start ? (L - p.a0 + TILE - 1) / TILE : 0;
  int s = p.n_tiles / max(min_tiles, 1);
  s = max(1, min(s, max_splits));
  int tps = (p.n_tiles + s - 1) / s;
  tps = max(granule, (tps + granule - 1) / granule * granule);
  p.tps = tps;
  p.splits = p.n_tiles > 0 ? (p.n_tiles + tps - 1) / tps : 1;
  return p;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// element offset of (row r, column c) in a [rows][DP] tile with 16-byte chunks XOR-swizzled by r % 8
template <int DP>
__device__ __forceinline__ int swz(int r, int c) {
  return r * DP + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

}  // namespace vbw_decode

template <typename T, int DP, int NW, int STAGES>
__global__ void __launch_bounds__(NW * 32)
paged_decode(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
             const int* __restrict__ block_table, const int* __restrict__ seq_lens,
             T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part,
             int Hq, int Hkv, int G, int D, int max_blocks, int log2_bs,
             float qk_scale, float cap2, int window_left, int max_splits, int min_tiles, int vec16, int Dp,
             int num_blocks, int* __restrict__ err) {
  using namespace vbw;
  using namespace vbw_decode;
  static_assert(DP == 64 || DP == 128 || DP == 256, "DP");
  constexpr int CH = DP / 8;           // 16-byte chunks per row
  constexpr int RPP = 32 / CH;         // tile rows one warp-wide pass covers
  constexpr int PASSES = TILE / RPP;
  constexpr int TE = TILE * DP;        // elements of one 16-row tile
  constexpr int NK = DP / 16;
  constexpr bool Q_REGS = DP <= 128;   // D = 256 keeps Q in shared memory (registers)
  constexpr unsigned FULL = 0xffffffffu;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = sQ + TE;                    // [NW][STAGES][2][TILE][DP]
  __shared__ float s_m[NW][16], s_l[NW][16];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int HT = (G + 15) >> 4;
  const int kvh = blockIdx.y / HT, ht = blockIdx.y - kvh * HT;
  const int b = blockIdx.z, split = blockIdx.x;
  const int g0 = ht * 16, gn = min(16, G - g0);
  const size_t orow0 = (size_t)b * Hq + (size_t)kvh * G + g0;   // first output row (b, head)
  pdl_start();  // q and the cache are written by the kernels before (the model's decode step)

  // Q tile [16 heads][DP] (zero-padded): global loads issued before anything waits (they do not depend on
  // seq_lens), stored to shared memory once the K/V prologue is in flight
  // (16-byte chunks when D % 8 == 0 and q is 16-byte aligned, else one element at a time)
  constexpr int QPT = TE / (NW * 32);  // elements per thread
  constexpr int QCH = (TE / 8 + NW * 32 - 1) / (NW * 32);   // 16-byte chunks per thread
  const bool qvec = vec16 && (reinterpret_cast<size_t>(q) & 15) == 0;
  unsigned short qv[QPT];
  uint4 qc[QCH];
  if (qvec) {
#pragma unroll
    for (int e = 0; e < QCH; ++e) {
      const int i = threadIdx.x + e * NW * 32, r = i / CH, c = i % CH;
      qc[e] = (i < TE / 8 && r < gn && c * 8 < D) ? *reinterpret_cast<const uint4*>(q + (orow0 + r) * D + c * 8)
                                                : make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
    const unsigned short* q16 = reinterpret_cast<const unsigned short*>(q);
#pragma unroll
    for (int e = 0; e < QPT; ++e) {
      const int i = threadIdx.x + e * NW * 32;
      const int r = i / DP, c = i % DP;
      qv[e] = (r < gn && c < D) ? q16[(orow0 + r) * D + c] : (unsigned short)0;
    }
  }
  const int L = seq_lens[b];
  if (L < 1 || L > ((long long)max_blocks << log2_bs)) {  // a bad length: NaN rows (split 0), the error word
    if (split == 0) {
      for (int i = threadIdx.x; i < gn * D; i += NW * 32) out[orow0 * D + i] = from_float<T>(__int_as_float(0x7fc00000));
      if (threadIdx.x == 0 && blockIdx.y == 0) vbw_err::flag(err, vbw_err::PAGED_SEQ_LENS, b);
    }
    return;
  }
  const Plan p = make_plan(L, window_left, max_splits, min_tiles, NW);
  if (split >= p.splits) return;

  const int nk = (D + 15) >> 4;        // k-steps (and PV n-tile pairs) that hold real dims
  const int used_ch = 2 * nk;
  const int bs_mask = (1 << log2_bs) - 1;
  const int* bt_row = block_table + (size_t)b * max_blocks;
  const int t_begin = split * p.tps;
  const int t_end = min(p.n_tiles, t_begin + p.tps);
  const int nloc = t_end - t_begin > warp ? (t_end - t_begin - warp + NW - 1) / NW : 0;

  // cache row index of token (lane % 16) of the warp's k-th tile; -1 when outside [start, end) or when its
  // block id is outside [0, num_blocks) (then `bad` is set: the CTA writes NaN and flags the error word)
  bool bad = false;
  auto row_of = [&](int k) -> int {
    if (k >= nloc) return -1;
    const int j = p.a0 + (t_begin + warp + k * NW) * TILE + (lane & 15);
    if (j < p.start || j >= p.end) return -1;
    const int page = __ldg(bt_row + (j >> log2_bs));
    if ((unsigned)page >= (unsigned)num_blocks) {
      bad = true;
      return -1;
    }
    return ((page << log2_bs) + (j & bs_mask)) * Hkv + kvh;
  };

  T* const sW = sKV + (size_t)warp * STAGES * 2 * TE;
  auto issue = [&](int stage, int rowreg) {
    T* sK = sW + stage * 2 * TE;
    T* sV = sK + TE;
    const int c = lane % CH;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int r = lane / CH + i * RPP;
      const int row = __shfl_sync(FULL, rowreg, r);
      if (c < used_ch) {
        const int soff = r * DP + ((c ^ (r & 7)) << 3);
        if (vec16) {
          const bool ok = row >= 0 && c * 8 < D;
          const size_t goff = ok ? (size_t)row * D + c * 8 : 0;
          cp_async_16(smem_addr(sK + soff), kc + goff, ok);
          cp_async_16(smem_addr(sV + soff), vc + goff, ok);
        } else {
          const unsigned short* k16 = reinterpret_cast<const unsigned short*>(kc);
          const unsigned short* v16 = reinterpret_cast<const unsigned short*>(vc);
          u32 kw[4], vw[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            u32 klo = 0, khi = 0, vlo = 0, vhi = 0;
            const int d0 = c * 8 + 2 * e;
            if (row >= 0 && d0 < D) {
              klo = k16[(size_t)row * D + d0];
              vlo = v16[(size_t)row * D + d0];
            }
            if (row >= 0 && d0 + 1 < D) {
              khi = k16[(size_t)row * D + d0 + 1];
              vhi = v16[(size_t)row * D + d0 + 1];
            }
            kw[e] = klo | (khi << 16);
            vw[e] = vlo | (vhi << 16);
          }
          *reinterpret_cast<uint4*>(sK + soff) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
          *reinterpret_cast<uint4*>(sV + soff) = make_uint4(vw[0], vw[1], vw[2], vw[3]);
        }
      }
    }
  };

  int next_row = row_of(0);

  // per-lane ldmatrix offsets (bytes); every row a lane addresses has row % 8 == lane % 8
  const int x7 = lane & 7;
  const u32 k_row = (u32)(((lane >> 4) * 8 + x7) * DP * 2);   // K: b-fragments of 2 n-tiles
  const int k_cs = (lane >> 3) & 1;
  const u32 a_row = (u32)((lane & 15) * DP * 2);              // Q (A) and V (trans B)
  const int a_cs = lane >> 4;
  const u32 sQa = smem_addr(sQ);

  float acc[2 * NK][4];
#pragma unroll
  for (int i = 0; i < 2 * NK; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = -__int_as_float(0x7f800000), m1 = -__int_as_float(0x7f800000), l0 = 0.f, l1 = 0.f;
  const int tq = lane & 3;

  // ---- pipeline prologue, then the Q tile into shared memory and fragments
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nloc) {
      issue(s, next_row);
      next_row = row_of(s + 1);
    }
    cp_async_commit();
  }
  if (qvec) {
#pragma unroll
    for (int e = 0; e < QCH; ++e) {
      const int i = threadIdx.x + e * NW * 32;
      if (i < TE / 8) *reinterpret_cast<uint4*>(sQ + swz<DP>(i / CH, (i % CH) * 8)) = qc[e];
    }
  } else {
    unsigned short* sq16 = reinterpret_cast<unsigned short*>(sQ);
#pragma unroll
    for (int e = 0; e < QPT; ++e) {
      const int i = threadIdx.x + e * NW * 32;
      sq16[swz<DP>(i / DP, i % DP)] = qv[e];
    }
  }
  __syncthreads();
  u32 qf[Q_REGS ? NK : 1][4];
  if constexpr (Q_REGS) {
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
      if (kk < nk) ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], sQa + a_row + (((2 * kk + a_cs) ^ x7) << 4));
  }

  for (int k = 0; k < nloc; ++k) {
    {
      const int kn = k + STAGES - 1;
      if (kn < nloc) {
        issue(kn % STAGES, next_row);
        next_row = row_of(kn + 1);
      }
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncwarp();

    const int st = k % STAGES;
    const u32 sKa = smem_addr(sW + st * 2 * TE);
    const u32 sVa = sKa + TE * 2;

    // S = Q K^T  (rows: heads, cols: the tile's 16 tokens as two n-tiles)
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      if (kk < nk) {
        u32 a[4];
        if constexpr (Q_REGS) {
          a[0] = qf[kk][0]; a[1] = qf[kk][1]; a[2] = qf[kk][2]; a[3] = qf[kk][3];
        } else {
          ldsm_x4(a[0], a[1], a[2], a[3], sQa + a_row + (((2 * kk + a_cs) ^ x7) << 4));
        }
        u32 b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, sKa + k_row + (((2 * kk + k_cs) ^ x7) << 4));
        mma_16816<T>(s[0], a, b0, b1);
        mma_16816<T>(s[1], a, b2, b3);
      }
    }

    // scale (+ softcap) into log2 units, mask tokens outside [start, end)
    const int jt = p.a0 + (t_begin + warp + k * NW) * TILE + 2 * tq;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e];
        x = cap2 > 0.f ? cap2 * tanhf(x * qk_scale) : x * qk_scale;
        const int j = jt + n * 8 + (e & 1);
        s[n][e] = (j >= p.start && j < p.end) ? x : -__int_as_float(0x7f800000);
      }
    }
    float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
    mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);   // finite: every tile holds a visible key
    const float al0 = fast_exp2(m0 - mn0), al1 = fast_exp2(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    float pr[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      pr[n][0] = fast_exp2(s[n][0] - mn0);
      pr[n][1] = fast_exp2(s[n][1] - mn0);
      pr[n][2] = fast_exp2(s[n][2] - mn1);
      pr[n][3] = fast_exp2(s[n][3] - mn1);
    }
    l0 = l0 * al0 + (pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1]);
    l1 = l1 * al1 + (pr[0][2] + pr[0][3] + pr[1][2] + pr[1][3]);
    u32 pa[4];
    pa[0] = pack2<T>(pr[0][0], pr[0][1]);
    pa[1] = pack2<T>(pr[0][2], pr[0][3]);
    pa[2] = pack2<T>(pr[1][0], pr[1][1]);
    pa[3] = pack2<T>(pr[1][2], pr[1][3]);

    // O = O * alpha + P V (the rescale skipped when no row's max moved: alpha is exactly 1 then)
    if (__any_sync(FULL, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
      for (int i = 0; i < 2 * NK; ++i) {
        acc[i][0] *= al0; acc[i][1] *= al0; acc[i][2] *= al1; acc[i][3] *= al1;
      }
    }
#pragma unroll
    for (int np = 0; np < NK; ++np) {
      if (np < nk) {
        u32 b0, b1, b2, b3;
        ldsm_x4_t(b0, b1, b2, b3, sVa + a_row + (((2 * np + a_cs) ^ x7) << 4));
        mma_16816<T>(acc[2 * np], pa, b0, b1);
        mma_16816<T>(acc[2 * np + 1], pa, b2, b3);
      }
    }
    __syncwarp();   // every lane is done with this stage before a later issue overwrites it
  }

  l0 += __shfl_xor_sync(FULL, l0, 1);
  l1 += __shfl_xor_sync(FULL, l1, 1);
  l0 += __shfl_xor_sync(FULL, l0, 2);
  l1 += __shfl_xor_sync(FULL, l1, 2);

  // ---- merge the NW warps through shared memory (the K/V stages are free now)
  cp_async_wait<0>();
  const bool any_bad = __syncthreads_or(bad);
  if (any_bad && threadIdx.x == 0) vbw_err::flag(err, vbw_err::PAGED_BLOCK_TABLE, b);
  float* sO = reinterpret_cast<float*>(sKV);   // [NW][16][DP]
  const int g = lane >> 2;
#pragma unroll
  for (int nt = 0; nt < 2 * NK; ++nt) {
    if (nt < used_ch) {   // rows past the group's heads are never read
      if (g < gn)
        *reinterpret_cast<float2*>(sO + (warp * 16 + g) * DP + nt * 8 + 2 * tq) = make_float2(acc[nt][0], acc[nt][1]);
      if (g + 8 < gn)
        *reinterpret_cast<float2*>(sO + (warp * 16 + g + 8) * DP + nt * 8 + 2 * tq) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  if (tq == 0) {
    s_m[warp][g] = m0;
    s_m[warp][g + 8] = m1;
    s_l[warp][g] = l0;
    s_l[warp][g + 8] = l1;
  }
  __syncthreads();

  const bool direct = p.splits == 1;
  for (int i = threadIdx.x; i < gn * D; i += NW * 32) {
    const int r = i / D, c = i - r * D;
    float M = -__int_as_float(0x7f800000);
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, s_m[w][r]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = fast_exp2(s_m[w][r] - M);   // 0 for a warp that had no tile (m = -inf)
      num += f * sO[(w * 16 + r) * DP + c];
      den += f * s_l[w][r];
    }
    const float o = any_bad ? __int_as_float(0x7fc00000) : num / den;   // NaN also poisons the combine
    if (direct) {
      out[(orow0 + r) * D + c] = from_float<T>(o);
    } else {
      const size_t prow = (orow0 + r) * max_splits + split;
      o_part[prow * Dp + c] = o;
      if (c == 0) lse_part[prow] = any_bad ? __int_as_float(0x7fc00000) : M + log2f(den);
    }
  }
}

// Merge the splits of one (head, batch): o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
// Sequences that used a single split were written by paged_decode and are skipped. The 4 warps take every
// 4th split and each lane 4 adjacent columns (o_part rows are padded to Dp, a multiple of 4), so a thread has
// ceil(splits / 4) independent 16-byte loads in flight instead of `splits` dependent 4-byte ones.
template <typename T>
__global__ void __launch_bounds__(128)
paged_decode_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                     const int* __restrict__ seq_lens, T* __restrict__ out, int Hq, int D, int Dp,
                     int window_left, int max_splits, int min_tiles, int granule, int capacity) {
  using namespace vbw_decode;
  constexpr int MAXS = 256;
  __shared__ float sl[MAXS];
  __shared__ __align__(16) float red[4][256];
  vbw::pdl_start();
  const int h = blockIdx.x, b = blockIdx.y;
  const size_t row = (size_t)b * Hq + h;
  const int grp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float4* op = reinterpret_cast<const float4*>(o_part + row * max_splits * Dp);
  const int nc4 = Dp >> 2;
  if (max_splits <= 16 && nc4 <= 32) {
    // Few splits (short contexts) and D <= 128: every split's lse and o slice is requested together with
    // seq_lens (one memory round trip instead of three; the ones past the sequence's split count are read but
    // not used), then merged as below. (One body for both paths, the early loads under a flag, measured
    // 0.2 us slower at 640 tokens and 1.2 us at 32k on the H100: the two stay separate.)
    const int L = seq_lens[b];
    const float ls = threadIdx.x < max_splits ? lse_part[row * max_splits + threadIdx.x] : 0.f;
    float4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int s = grp + 4 * j;
      v[j] = s < max_splits && lane < nc4 ? op[(size_t)s * nc4 + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (L < 1 || L > capacity) return;   // paged_decode wrote NaN rows and flagged it
    const Plan p = make_plan(L, window_left, max_splits, min_tiles, granule);
    if (p.splits <= 1) return;
    if (threadIdx.x < 16) sl[threadIdx.x] = ls;
    __syncthreads();
    float M = -__int_as_float(0x7f800000), den = 0.f;   // a NaN lse (a bad block id) makes the row NaN
    for (int s = 0; s < p.splits; ++s) M = fmaxf(M, sl[s]);
    for (int s = 0; s < p.splits; ++s) den += exp2f(sl[s] - M);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int s = grp + 4 * j;
      if (s < p.splits) {
        const float w = exp2f(sl[s] - M);
        acc.x += w * v[j].x; acc.y += w * v[j].y; acc.z += w * v[j].z; acc.w += w * v[j].w;
      }
    }
    if (lane < nc4) *reinterpret_cast<float4*>(&red[grp][4 * lane]) = acc;
    __syncthreads();
    const float inv = 1.f / den;
    for (int c = threadIdx.x; c < D; c += blockDim.x)
      out[row * D + c] = from_float<T>((red[0][c] + red[1][c] + red[2][c] + red[3][c]) * inv);
    return;
  }
  const int L = seq_lens[b];
  if (L < 1 || L > capacity) return;   // paged_decode wrote NaN rows and flagged it
  const Plan p = make_plan(L, window_left, max_splits, min_tiles, granule);
  if (p.splits <= 1) return;
  const int ns = min(p.splits, MAXS);
  for (int s = threadIdx.x; s < ns; s += blockDim.x) sl[s] = lse_part[row * max_splits + s];
  __syncthreads();
  // a split that met a bad block id stored lse NaN: den becomes NaN and so does the whole row
  float M = -__int_as_float(0x7f800000), den = 0.f;
  for (int s = 0; s < ns; ++s) M = fmaxf(M, sl[s]);
  for (int s = 0; s < ns; ++s) den += exp2f(sl[s] - M);
  for (int c4 = lane; c4 < nc4; c4 += 32) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = grp; s < ns; s += 4) {
      const float w = exp2f(sl[s] - M);
      const float4 v = op[(size_t)s * nc4 + c4];
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    *reinterpret_cast<float4*>(&red[grp][4 * c4]) = acc;
  }
  __syncthreads();
  const float inv = 1.f / den;
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    out[row * D + c] = from_float<T>((red[0][c] + red[1][c] + red[2][c] + red[3][c]) * inv);
}
