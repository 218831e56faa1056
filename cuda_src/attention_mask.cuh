// attention_mask.cuh: where a flash-attention CTA works and which keys its rows see, shared by attn_fwd and
// attn_fwd_wg (attention_fwd.cu): the CTA's (b, h, m0) and visible key band (Cta, cta_info), the varlen offset
// checks (varlen_bad), the KV tiles a CTA visits and which of them need a mask (tile_range), and the mask of
// one m16 row tile of scores (mask_tile).
#pragma once

#include "mma.cuh"
#include "errors.cuh"

namespace vbw_attn {

// Where a CTA works: (b, h), its first query row m0, the sequence lengths, and the visible key range of its rows
// (row m0 + r sees keys [r + lo_base, min(r + hi_base, sk))). Sequence lengths are < 2^30 (checked by the
// launcher), so these and every tile-local offset fit in an int.
// CTA order: (b, h) pairs are cut into sections of sect_heads consecutive pairs (sized by the launcher so a
// section's K and V fit in L2); within a section the longest Q tiles (largest m) of all its heads go first.
// The block index is read with a volatile move so that calling this again (in the rarely taken mask branch and
// in the epilogue) recomputes the values instead of keeping them alive in registers across the KV loop.
// work >= 0 (attn_fwd_wg's persistent CTAs): the place of work tile `work` instead of the block index's.
struct Cta {
  int b, h, m0, sq, sk, lo_base, hi_base;
  long long q_start, k_start;
};

// a / d for 0 <= a < 2^31 and d >= 1, given m = ceil(2^32 / d) (0 for d = 1; the launcher computes it,
// attention.py _div_magic): __umulhi(a, m) is the quotient or one more, and one multiply tells which. ~4
// dependent instructions instead of an integer division's ~20: plain divisions took ~900 of the ~1700 clocks
// before a CTA's first load was issued (H100).
__device__ __forceinline__ int fast_div(int a, int d, unsigned m) {
  if (m == 0u) return a;  // d == 1
  unsigned q = __umulhi((unsigned)a, m);
  if (q * (unsigned)d > (unsigned)a) --q;
  return (int)q;
}

// FAST = false: plain divisions (fewer registers where every one counts; the multipliers are not used).
template <int BLOCK_M, bool FAST = true>
__device__ __forceinline__ Cta cta_info(const int* __restrict__ cu_q, const int* __restrict__ cu_k, int batch,
                                        int seqlen_q, int seqlen_k, int heads, int num_m, int sect_heads,
                                        unsigned mg_sec, unsigned mg_sect, unsigned mg_heads, int win_left,
                                        int win_right, int work = -1) {
  unsigned bid = (unsigned)work;
  if (work < 0) asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));
  Cta c;
  const int total = batch * heads;
  const int per_sec = sect_heads * num_m;
  const int sec = FAST ? fast_div((int)bid, per_sec, mg_sec) : (int)bid / per_sec;
  const int r = (int)bid - sec * per_sec;
  const int size = min(sect_heads, total - sec * sect_heads);  // (the last section may hold fewer pairs)
  const int rs = FAST && size == sect_heads ? fast_div(r, size, mg_sect) : r / size;
  const int m_block = num_m - 1 - rs;
  const int hh = sec * sect_heads + (r - rs * size);
  c.b = FAST ? fast_div(hh, heads, mg_heads) : hh / heads;
  c.h = hh - c.b * heads;
  if (cu_q != nullptr) {
    c.q_start = cu_q[c.b];
    c.sq = cu_q[c.b + 1] - cu_q[c.b];
    c.k_start = cu_k[c.b];
    c.sk = cu_k[c.b + 1] - cu_k[c.b];
  } else {
    c.q_start = (long long)c.b * seqlen_q;
    c.sq = seqlen_q;
    c.k_start = (long long)c.b * seqlen_k;
    c.sk = seqlen_k;
  }
  c.m0 = m_block * BLOCK_M;
  constexpr long long BIG = 1LL << 30;
  const long long diag = (long long)c.sk - c.sq;
  c.lo_base = win_left >= 0 ? (int)max(-BIG, min(BIG, c.m0 + diag - win_left)) : -(int)BIG;
  c.hi_base = win_right >= 0 ? (int)max(-BIG, min(BIG, c.m0 + diag + win_right + 1)) : (int)BIG;
  return c;
}

// Varlen inputs (cu_q != nullptr): whether sequence c.b's offsets are bad (cu[b] < 0, cu[b + 1] < cu[b],
// cu[b + 1] > the tokens, cu[0] != 0, cu[B] != the tokens, or more query rows than the grid's num_m * BLOCK_M). If so the CTA writes NaN into its
// share of the sequence's rows [cu_q[b], cu_q[b + 1]) that lie inside [0, total_q) (the last m-block takes every
// row past the grid), flags the error word and the caller returns: nothing is read through the bad offsets.
// In varlen mode the kernel's seqlen_q / seqlen_k arguments carry total_q / total_k.
template <typename T, int BLOCK_M>
__device__ __noinline__ bool varlen_bad(const Cta& c, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                        int batch, int total_q, int total_k, int num_m, T* __restrict__ o,
                                        float* __restrict__ lse, long long q_rs, int d, long long lse_stride_h,
                                        int* __restrict__ err) {
  const long long q0 = cu_q[c.b], q1 = cu_q[c.b + 1], k0 = cu_k[c.b], k1 = cu_k[c.b + 1];
  const bool first = c.b == 0, last = c.b == batch - 1;   // the offsets must also start at 0 and end at the total
  const bool bad_q = q0 < 0 || q1 < q0 || q1 > total_q || q1 - q0 > (long long)num_m * BLOCK_M ||
                     (first && q0 != 0) || (last && q1 != total_q);
  const bool bad_k = k0 < 0 || k1 < k0 || k1 > total_k || (first && k0 != 0) || (last && k1 != total_k);
  if (!bad_q && !bad_k) return false;
  if (threadIdx.x == 0 && c.h == 0 && c.m0 == 0) {
    if (bad_q) vbw_err::flag(err, vbw_err::VARLEN_CU_Q, c.b);
    if (bad_k) vbw_err::flag(err, vbw_err::VARLEN_CU_K, c.b);
  }
  const long long lo = max(0LL, max(q0, q0 + c.m0));
  const long long hi = min((long long)total_q, c.m0 + BLOCK_M >= (long long)num_m * BLOCK_M ? q1 : min(q1, q0 + c.m0 + BLOCK_M));
  const unsigned short nan = (unsigned short)vbw::pack2<T>(__int_as_float(0x7fc00000), 0.f);  // T's NaN bits
  unsigned short* o16 = reinterpret_cast<unsigned short*>(o);
  for (long long i = threadIdx.x; i < (hi - lo) * d; i += blockDim.x) {
    const long long r = lo + i / d;
    o16[r * q_rs + (long long)c.h * d + i % d] = nan;
  }
  if (lse != nullptr)
    for (long long r = lo + threadIdx.x; r < hi; r += blockDim.x) lse[(long long)c.h * lse_stride_h + r] = __int_as_float(0x7fc00000);
  return true;
}

// KV tiles that some row of the CTA (rows_q rows) sees: [n_lo, n_hi); tiles in [nm_lo, nm_hi) need no mask.
template <int BLOCK_N>
__device__ __forceinline__ void tile_range(const Cta& c, int rows_q, int& n_lo, int& n_hi, int& nm_lo, int& nm_hi) {
  n_lo = n_hi = 0;
  const int lo = max(0, c.lo_base);
  const int hi = min(c.sk, c.hi_base + rows_q - 1);
  if (hi > lo) {
    n_lo = lo / BLOCK_N;
    n_hi = (hi + BLOCK_N - 1) / BLOCK_N;
  }
  const int last_lo = c.lo_base + rows_q - 1;  // the last row's first key
  nm_lo = last_lo > 0 ? (last_lo + BLOCK_N - 1) / BLOCK_N : 0;
  nm_hi = min(c.sk, c.hi_base) >= 0 ? min(c.sk, c.hi_base) / BLOCK_N : -1;
}

// The scores of one m16 row tile, as an mma.sync / wgmma accumulator: s[j][e] is row rl0 + g + 8 (e / 2) of the
// CTA, key 8j + 2t + e % 2 of the KV tile (g = lane / 4, t = lane % 4). Keys a row does not see become -inf:
// row r sees keys [r + lo_off, min(r + hi_off, hi_cap)) of the tile.
template <int NN>
__device__ __forceinline__ void mask_tile(float (&s)[NN][4], int rl0, int lo_off, int hi_off, int hi_cap, int lane) {
  const float NEG_INF = __int_as_float(0xff800000);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int rl = rl0 + (lane >> 2) + hf * 8;
    const int lo_t = rl + lo_off;
    const int hi_t = min(rl + hi_off, hi_cap);
#pragma unroll
    for (int j = 0; j < NN; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = j * 8 + (lane & 3) * 2 + e;
        if (col < lo_t || col >= hi_t) s[j][2 * hf + e] = NEG_INF;
      }
  }
}

}  // namespace vbw_attn
