// attention_wgmma_tile.cuh: the shared-memory tile layout of the wgmma attention kernel (attn_fwd_wg in
// attention_fwd.cu): [ROWS][HEAD_DIM] tiles stored as 64-column panels of 128-byte rows with the 128-byte
// swizzle that wgmma's descriptors and TMA's SWIZZLE_128B use (wgmma.cuh); the cp.async loader for inputs
// without tensor maps (load_tile_sw), the byte offset of an element (sw_offset) and the epilogue's stores of a
// warpgroup's staged O rows (store_rows_sw).
#pragma once

#include "mma.cuh"

namespace vbw_attn {

// cp.async a [ROWS][HEAD_DIM] tile into 128B-swizzled column panels at s (1024-aligned); rows >= rows_valid and
// columns >= d are zero-filled.
template <int ROWS, int HEAD_DIM, int NT, typename T>
__device__ __forceinline__ void load_tile_sw(vbw::u32 s, const T* g, long long row_stride, int rows_valid, int d) {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  constexpr int CPR = HEAD_DIM / 8;
  constexpr int TOTAL = ROWS * CPR;
  constexpr int ITERS = (TOTAL + NT - 1) / NT;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int c = tid + i * NT;
    if ((TOTAL % NT) != 0 && c >= TOTAL) break;
    const int r = c / CPR, ch = c % CPR;
    const vbw::u32 dst = s + (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    const bool ok = r < rows_valid && ch * 8 < d;
    vbw::cp_async_16(dst, ok ? g + r * row_stride + ch * 8 : g, ok);
  }
}

// Byte offset of element (r, c) in such a tile of ROWS rows.
template <int ROWS>
__device__ __forceinline__ vbw::u32 sw_offset(int r, int c) {
  return (c >> 6) * (ROWS * 128) + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// 16-byte stores of a warpgroup's 64 staged rows row0..row0 + 63 of such a tile at s to g (row r at
// g + r * row_stride): chunk `first` and every STEP-th after it (STEP = the threads storing), UNROLL of them
// unrolled; rows >= rows_valid and columns >= d are not stored. 64 rows of HEAD_DIM / 8 chunks are a multiple of
// 128 chunks for every head dim (a multiple of 16).
template <int ROWS, int HEAD_DIM, int STEP, int UNROLL, typename TO>
__device__ __forceinline__ void store_rows_sw(TO* g, long long row_stride, const unsigned char* s, int row0,
                                              int rows_valid, int d, int first) {
  constexpr int CPR = HEAD_DIM / 8;
  static_assert(64 * CPR % STEP == 0, "whole rounds of STEP chunks");
#pragma unroll UNROLL
  for (int j = 0; j < 64 * CPR / STEP; ++j) {
    const int c = first + j * STEP;
    const int r = row0 + c / CPR, col = (c % CPR) * 8;
    if (r < rows_valid && col < d)
      *reinterpret_cast<uint4*>(g + r * row_stride + col) =
          *reinterpret_cast<const uint4*>(s + sw_offset<ROWS>(r, col));
  }
}

}  // namespace vbw_attn
