// attention_tile.cuh: device helpers shared by the mma.sync flash-attention kernels (attention_fwd.cu,
// attention_sparse.cu): the padded shared-memory tile loader and the online-softmax row bookkeeping.
#pragma once

#include "mma.cuh"

namespace vbw_attn {

// `x` when it is NaN, else `otherwise`: a row whose softmax sum is NaN (a NaN query or score) gets NaN output
// and lse, not the 0 / -inf of a row that sees no key (docs/nan.md). A bit test, safe under any math flags.
__device__ __forceinline__ float nan_or(float x, float otherwise) {
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? x : otherwise;
}

constexpr int PAD = 8;  // elements of padding per shared-memory row (16 bytes)

// Load a [ROWS][HEAD_DIM] tile (global rows `row_stride` elements apart, `rows_valid` real rows, `d` real
// columns) into shared memory with row pitch HEAD_DIM + PAD; everything outside is zero-filled.
template <int ROWS, int HEAD_DIM, int NT, bool VEC, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long row_stride, int rows_valid, int d,
                                          int tid_arg) {
  // The thread index is re-read (volatile) so the per-thread offsets below are recomputed at each call (a few
  // integer ops) instead of being hoisted out of the KV loop into registers that the accumulators need.
  (void)tid_arg;
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  // Thread tid owns 16-byte column chunk tid % CPR of rows tid / CPR, tid / CPR + RPI, ... (when CPR does not
  // divide NT the last NT % CPR threads idle). One pointer per thread, advanced by a constant: no per-chunk
  // 64-bit address math for the compiler to hoist out of the KV loop into registers.
  constexpr int CPR = HEAD_DIM / 8;
  constexpr int LDS = HEAD_DIM + PAD;
  constexpr int RPI = NT / CPR;
  constexpr int ITERS = (ROWS + RPI - 1) / RPI;
  static_assert(RPI >= 1, "too few threads for one row");
  if ((NT % CPR) != 0 && tid >= RPI * CPR) return;
  const int r0 = tid / CPR;
  const int col = (tid % CPR) * 8;
  const bool col_ok = col < d;
  const T* src = g + r0 * row_stride + col;
  const long long step = RPI * row_stride;
  T* dst = s + r0 * LDS + col;
  if constexpr (VEC) {
    const vbw::u32 dst_a = vbw::smem_addr(dst);
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      if ((ROWS % RPI) != 0 && r0 + i * RPI >= ROWS) break;
      const bool ok = col_ok && r0 + i * RPI < rows_valid;
      vbw::cp_async_16(dst_a + 2 * i * RPI * LDS, src, ok);  // src-size 0 reads nothing when !ok
      src += step;
    }
  } else {
    // Any alignment, any d: element-wise loads, zero-filled tail, one 16-byte shared store per chunk.
#pragma unroll 1
    for (int i = 0; i < ITERS; ++i) {
      const int r = r0 + i * RPI;
      if (r >= ROWS) break;
      const bool ok = col_ok && r < rows_valid;
      const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
      vbw::u32 w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const vbw::u32 lo = (ok && col + 2 * j < d) ? s16[2 * j] : 0u;
        const vbw::u32 hi = (ok && col + 2 * j + 1 < d) ? s16[2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(dst + i * RPI * LDS) = make_uint4(w[0], w[1], w[2], w[3]);
      src += step;
    }
  }
}

// Online-softmax bookkeeping of one m16 row tile: the new row maxima (over the quad), msc = max * scale_log2 (0
// for a row that has seen no key) and corr = 2^(old max - new max) (scaled), the factor the row's O and sum
// must be scaled by (0 while the old max is -inf). Returns whether some corr != 1.
template <int NN>
__device__ __forceinline__ bool online_max(const float (&s)[NN][4], float (&row_max)[2], float scale_log2,
                                           float (&msc)[2], float (&corr)[2]) {
  const float NEG_INF = __int_as_float(0xff800000);
  bool moved = false;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float mx = row_max[hf];
#pragma unroll
    for (int j = 0; j < NN; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hf], s[j][2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    msc[hf] = (mx == NEG_INF) ? 0.f : mx * scale_log2;
    corr[hf] = (row_max[hf] == NEG_INF) ? 0.f : vbw::fast_exp2(row_max[hf] * scale_log2 - msc[hf]);
    moved |= corr[hf] != 1.f;
    row_max[hf] = mx;
  }
  return moved;
}


}  // namespace vbw_attn
