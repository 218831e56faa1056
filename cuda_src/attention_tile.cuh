// attention_tile.cuh: the padded shared-memory tile of the mma.sync flash-attention kernels (attn_fwd in
// attention_fwd.cu, attention_sparse.cu): rows of HEAD_DIM + PAD elements, so the 8 row addresses of an ldmatrix
// hit distinct bank groups, and its loader (cp.async, or element-wise for unaligned inputs).
#pragma once

#include "mma.cuh"

namespace vbw_attn {

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

}  // namespace vbw_attn
