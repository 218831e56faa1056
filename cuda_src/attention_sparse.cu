// attention_sparse.cu: block-sparse flash attention forward (a BSR pattern of kept key blocks), mma.sync
// m16n8k16, sm_80+.
//
// Computes, per (batch b, query head h, query row i), over the keys j that row i sees:
//   s_j = scale * q_i . k_j  (or softcap * tanh(scale * q_i . k_j / softcap)),
//   o_i = sum_j softmax(s)_j v_j,   lse_i = log sum_j exp(s_j)
// where row i (query block qb = i / block_q) sees key j iff j < Sk, j's key block j / block_k is listed in
// indices[indptr[qb] .. indptr[qb + 1]) of the pattern of (b, h / group), and, when causal, j <= i (positions
// aligned at 0, top-left). A row that sees no key gets o = 0 and lse = -inf.
//
// Operands (row-major, contiguous, T = __half or __nv_bfloat16): q, o [B, Sq, H, d]; k, v [B, Sk, Hkv, d];
//   lse float32 [B, H, Sq]; kv head = h / group. d is the real head dim, HEAD_DIM the compiled one (columns >= d
//   zero-filled in shared memory, never read or written in global memory); VEC: 16-byte aligned rows.
// Pattern (int32): indptr [P][num_qb + 1], indices [P][nnz], P = 1 (per_pattern = 0: one pattern for every
//   (b, h)) or B * Hkv (per_pattern = 1: pattern b * Hkv + kv head). Each CTA checks what it reads first:
//   0 <= indptr[qb] <= indptr[qb + 1] <= nnz (and indptr[0] == 0 for qb 0), every listed block id in
//   [0, num_kb). A bad q block gets NaN output rows (and NaN lse) and flags SPARSE_INDICES in the error word
//   (errors.cuh) with its q block index; nothing is read through a bad index. Duplicate block ids are not
//   detected here (they count twice; the host check rejects them).
//
// Tiling: one CTA = BLOCK_M = block_q query rows of one (b, h); WARPS warps, MT = BLOCK_M / (16 WARPS) m16 row
//   tiles a warp. The kept key blocks of the CTA's q block are streamed as a sequence of "slots" (block e of
//   the row's list holds slots e * block_k .. e * block_k + block_k - 1), cut into KV tiles of BLOCK_N slots.
//   Each 16-slot chunk of a tile is 16 consecutive keys of one block (block_k is a multiple of 16), so a tile is
//   gathered chunk by chunk when block_k < BLOCK_N and is one contiguous run of keys otherwise (block_k a
//   multiple of BLOCK_N). Lane c of each warp computes chunk c's first key position; the others get it by
//   shuffle. Shared memory: Q [BLOCK_M][HEAD_DIM + 8], K and V [2][BLOCK_N][HEAD_DIM + 8] (attention_tile.cuh's
//   padded rows). Pipeline as attention_fwd.cu's STAGES = 2: per tile, wait K(t), V(t) ; barrier ; cp.async
//   K(t+1), V(t+1) into the other stage ; S = Q K^T ; mask (only on tiles with a partial chunk, a chunk past Sk
//   or, when causal, a chunk right of the CTA's first row) ; online softmax (exp2, fp32) ; O += P V. Epilogue:
//   normalize, lse, O through Q's shared buffer, 16-byte stores. CTA order (1-D grid): (b, h) major, the last
//   q block first (under a causal pattern the longest rows go first).
//
// History.
//   v1: the mma.sync pipeline above (attention_fwd.cu v3's loop, gathered K/V tiles); not yet timed on a GPU.
//       One m16 row tile a warp (WARPS = block_q / 16): with two, D = 128 needs 255 registers and spills on
//       sm_90; with one, D <= 128 uses 106-175 registers and no instance spills except D = 256 at block_q = 16
//       (8-28 bytes). KV tile BLOCK_N = 64 keys, or 32 / 16 where shared memory is short (sm_86 / sm_89, D 256).
#include "mma.cuh"
#include "errors.cuh"
#include "attention_tile.cuh"
#include "attention_softmax.cuh"

namespace vbw_sparse {

constexpr int NO_KEY = -(1 << 30);  // the position of a chunk past the row's list

// First key position of 16-slot chunk c of KV tile t of a row whose list is ix[a .. e) (NO_KEY past the list).
// block_k = 1 << log_bk. The ids were checked by the CTA's first pass.
__device__ __forceinline__ int chunk_pos(const int* __restrict__ ix, int a, int e, int t, int c, int block_n,
                                         int log_bk) {
  const int u = t * block_n + c * 16;
  const int ent = a + (u >> log_bk);
  return ent < e ? (__ldg(ix + ent) << log_bk) + (u & ((1 << log_bk) - 1)) : NO_KEY;
}

// K and V of tile t into shared memory (sK, sV: this stage's buffers). Every thread of the CTA calls this.
template <int BLOCK_N, int HEAD_DIM, int NT, bool VEC, typename T>
__device__ __forceinline__ void load_kv(T* sK, T* sV, const T* kg, long long vk, long long kv_rs, int sk, int d,
                                        const int* __restrict__ ix, int a, int e, int t, int log_bk) {
  constexpr int NCH = BLOCK_N / 16;
  constexpr int LDS = HEAD_DIM + vbw_attn::PAD;
  const int lane = threadIdx.x & 31;
  if ((1 << log_bk) >= BLOCK_N) {  // block_k a multiple of BLOCK_N (powers of two): one run of keys
    const int pos = chunk_pos(ix, a, e, t, 0, BLOCK_N, log_bk);
    const int valid = pos >= 0 ? sk - pos : 0;
    const T* src = kg + (long long)max(pos, 0) * kv_rs;
    vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sK, src, kv_rs, valid, d, threadIdx.x);
    vbw_attn::load_tile<BLOCK_N, HEAD_DIM, NT, VEC>(sV, src + vk, kv_rs, valid, d, threadIdx.x);
  } else {
    const int mine = lane < NCH ? chunk_pos(ix, a, e, t, lane, BLOCK_N, log_bk) : NO_KEY;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      const int pos = __shfl_sync(0xffffffffu, mine, c);
      const int valid = pos >= 0 ? min(16, sk - pos) : 0;
      const T* src = kg + (long long)max(pos, 0) * kv_rs;
      vbw_attn::load_tile<16, HEAD_DIM, NT, VEC>(sK + c * 16 * LDS, src, kv_rs, valid, d, threadIdx.x);
      vbw_attn::load_tile<16, HEAD_DIM, NT, VEC>(sV + c * 16 * LDS, src + vk, kv_rs, valid, d, threadIdx.x);
    }
  }
}

}  // namespace vbw_sparse

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool VEC>
__global__ void __launch_bounds__(WARPS * 32)
attn_sparse_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                float* __restrict__ lse, const int* __restrict__ indptr, const int* __restrict__ indices,
                int seqlen_q, int seqlen_k, int heads, int group, int kv_heads, int d, int num_qb, int num_kb,
                int nnz, int per_pattern, int log_bk, int causal, float scale_log2, int score_mode,
                float cap_prescale, long long q_rs, long long kv_rs, int* __restrict__ err) {
  using namespace vbw;
  using vbw_attn::PAD;
  constexpr int NT = WARPS * 32;
  constexpr int MT = BLOCK_M / (16 * WARPS);
  static_assert(MT >= 1 && MT * 16 * WARPS == BLOCK_M, "BLOCK_M must be a multiple of 16 * WARPS");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 64 && HEAD_DIM % 32 == 0, "tile shape");
  constexpr int NN = BLOCK_N / 8;    // n8 tiles of S
  constexpr int NCH = BLOCK_N / 16;  // 16-key chunks of a KV tile
  constexpr int ND = HEAD_DIM / 8;   // n8 tiles of O
  constexpr int KD = HEAD_DIM / 16;  // k16 steps of Q K^T
  constexpr int KN = BLOCK_N / 16;   // k16 steps of P V
  constexpr int LDS = HEAD_DIM + PAD;
  const float NEG_INF = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BLOCK_M * LDS;
  T* sV = sK + 2 * BLOCK_N * LDS;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int bid = (int)blockIdx.x;
  const int qb = num_qb - 1 - bid % num_qb;
  const int bh = bid / num_qb;
  const int b = bh / heads;
  const int h = bh - b * heads;
  const int sq = seqlen_q, sk = seqlen_k;
  const int m0 = qb * BLOCK_M;
  const int rows_q = min(BLOCK_M, sq - m0);
  const long long q_row0 = (long long)b * sq + m0;  // first global q / o row of the CTA

  // The row's list, checked before anything is read through it.
  const long long pat = per_pattern ? (long long)b * kv_heads + h / group : 0;
  const int* ip = indptr + pat * (num_qb + 1);
  const int* ix = indices + pat * nnz;
  const int a = ip[qb], e = ip[qb + 1];
  bool bad = a < 0 || e < a || e > nnz || (qb == 0 && a != 0);
  if (!bad)
    for (int i = a + tid; i < e; i += NT) {
      const int id = __ldg(ix + i);
      bad |= id < 0 || id >= num_kb;
    }
  if (__syncthreads_or(bad)) {
    if (tid == 0) vbw_err::flag(err, vbw_err::SPARSE_INDICES, qb);
    const unsigned short nan = (unsigned short)pack2<T>(__int_as_float(0x7fc00000), 0.f);  // T's NaN bits
    unsigned short* o16 = reinterpret_cast<unsigned short*>(o);
    for (int i = tid; i < rows_q * d; i += NT)
      o16[(q_row0 + i / d) * q_rs + (long long)h * d + i % d] = nan;
    if (lse != nullptr)
      for (int r = tid; r < rows_q; r += NT) lse[((long long)b * heads + h) * sq + m0 + r] = __int_as_float(0x7fc00000);
    return;
  }
  const int ntiles = (int)((((long long)(e - a) << log_bk) + BLOCK_N - 1) / BLOCK_N);
  const T* kg = k + (long long)b * sk * kv_rs + (long long)(h / group) * d;
  const long long vk = v - k;

  float acc_o[MT][ND][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < ND; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) acc_o[mt][j][x] = 0.f;
    row_max[mt][0] = row_max[mt][1] = NEG_INF;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  // ldmatrix lane addresses, as in attention_fwd.cu (one lane offset for Q, K and V).
  const int warp_row = warp * MT * 16;
  const vbw::u32 lane_a = smem_addr(smem_raw) + 2 * (((lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (lane >> 4) * 8);
  const vbw::u32 sQ_a = lane_a + 2 * warp_row * LDS;
  constexpr vbw::u32 K_BYTES = 2u * BLOCK_M * LDS;
  constexpr vbw::u32 V_BYTES = K_BYTES + 2u * 2 * BLOCK_N * LDS;
  constexpr vbw::u32 STAGE_BYTES = 2u * BLOCK_N * LDS;

  if (ntiles > 0) {
    vbw_attn::load_tile<BLOCK_M, HEAD_DIM, NT, VEC>(sQ, q + q_row0 * q_rs + (long long)h * d, q_rs, rows_q, d, tid);
    cp_async_commit();
    vbw_sparse::load_kv<BLOCK_N, HEAD_DIM, NT, VEC>(sK, sV, kg, vk, kv_rs, sk, d, ix, a, e, 0, log_bk);
    cp_async_commit();
    vbw::u32 stage_off = 0;

    for (int t = 0; t < ntiles; ++t) {
      cp_async_wait<0>();
      __syncthreads();  // K(t), V(t) landed; every warp is done with tile t-1, whose stage is refilled now
      if (t + 1 < ntiles) {
        const vbw::u32 nxt = STAGE_BYTES - stage_off;
        vbw_sparse::load_kv<BLOCK_N, HEAD_DIM, NT, VEC>(sK + nxt / 2, sV + nxt / 2, kg, vk, kv_rs, sk, d, ix, a, e,
                                                        t + 1, log_bk);
        cp_async_commit();
      }

      float s[MT][NN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NN; ++j)
#pragma unroll
          for (int x = 0; x < 4; ++x) s[mt][j][x] = 0.f;

      // S = Q K^T
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        vbw::u32 af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldsm_x4(af[mt][0], af[mt][1], af[mt][2], af[mt][3], sQ_a + 2 * (mt * 16 * LDS + kk * 16));
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

      // Score transform (attention_fwd.cu's: softcap in mode 1, a scale <= 0 in mode 2; scale_log2 > 0 always).
      if (score_mode == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < NN; ++j)
#pragma unroll
            for (int x = 0; x < 4; ++x) s[mt][j][x] = tanhf(s[mt][j][x] * cap_prescale);
      } else if (score_mode == 2) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 0; j < NN; ++j)
#pragma unroll
            for (int x = 0; x < 4; ++x) s[mt][j][x] *= cap_prescale;
      }

      // Mask: keys past the list, past Sk, or (causal) right of the row. Chunk c's first key is lane c's.
      {
        const int mine = lane < NCH ? vbw_sparse::chunk_pos(ix, a, e, t, lane, BLOCK_N, log_bk) : 0;
        const bool need = lane < NCH && (mine < 0 || mine + 16 > sk || (causal && mine + 15 > m0));
        if (__any_sync(0xffffffffu, need)) {
          int pc[NCH];
#pragma unroll
          for (int c = 0; c < NCH; ++c) pc[c] = __shfl_sync(0xffffffffu, mine, c);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int qi = causal ? m0 + warp_row + mt * 16 + (lane >> 2) + hf * 8 : (1 << 30);
#pragma unroll
              for (int j = 0; j < NN; ++j)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                  const int key = pc[j >> 1] + (j & 1) * 8 + (lane & 3) * 2 + x;
                  if (pc[j >> 1] < 0 || key >= sk || key > qi) s[mt][j][2 * hf + x] = NEG_INF;
                }
            }
        }
      }

      // Online softmax (exp2, scale folded into one FFMA); O is rescaled only when some row max moved.
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
              for (int x = 0; x < 4; ++x) acc_o[mt][j][x] *= corr[mt][x >> 1];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) row_sum[mt][hf] *= corr[mt][hf];
      }

      // O += P V
#pragma unroll
      for (int kt = 0; kt < KN; ++kt) {
        vbw::u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int j = 2 * kt; j < 2 * kt + 2; ++j)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              s[mt][j][x] = fast_exp2((s[mt][j][x] - msc[mt][x >> 1]) * scale_log2);
              row_sum[mt][x >> 1] += s[mt][j][x];
            }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pack2<T>(s[mt][2 * kt][0], s[mt][2 * kt][1]);
          pa[mt][1] = pack2<T>(s[mt][2 * kt][2], s[mt][2 * kt][3]);
          pa[mt][2] = pack2<T>(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
          pa[mt][3] = pack2<T>(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < ND / 2; ++dp) {
          vbw::u32 b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, lane_a + V_BYTES + stage_off + 2 * (kt * 16 * LDS + dp * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(acc_o[mt][2 * dp], pa[mt], b0, b1);
            mma_16816<T>(acc_o[mt][2 * dp + 1], pa[mt], b2, b3);
          }
        }
      }
      stage_off = STAGE_BYTES - stage_off;
    }
  }

  // Epilogue: normalize, LSE, O through Q's buffer (a warp only ever read its own rows of Q; the __syncwarp
  // orders its lanes' last ldmatrix of them before any lane's store: racecheck flagged the pair), 16-byte stores.
  __syncwarp();
  T* og = o + q_row0 * q_rs + (long long)h * d;
  const long long lse_base = ((long long)b * heads + h) * sq + m0;
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
      if (lse != nullptr && (lane & 3) == 0 && r < rows_q)
        lse[lse_base + r] = sum > 0.f ? (row_max[mt][hf] * scale_log2 + __log2f(sum)) * 0.69314718055994531f
                                      : vbw_attn::nan_or(sum, NEG_INF);
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
      if (r < rows_q && col < d) {
        const T* src = sQ + r * LDS + col;
        T* dst = og + r * q_rs + col;
        if constexpr (VEC) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          const int nv = min(8, d - col);
          for (int x = 0; x < nv; ++x) dst[x] = src[x];
        }
      }
    }
  }
}
