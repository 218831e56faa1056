// attention_softmax.cuh: the online-softmax pieces shared by the flash-attention kernels (attention_fwd.cu's
// attn_fwd and attn_fwd_wg, attention_sparse.cu): the per-row running max and rescale factor of an m16 row
// tile of scores (online_max) and the NaN rule of a row's sum (nan_or, docs/nan.md).
#pragma once

#include "mma.cuh"

namespace vbw_attn {

// `x` when it is NaN, else `otherwise`: a row whose softmax sum is NaN (a NaN query or score) gets NaN output
// and lse, not the 0 / -inf of a row that sees no key (docs/nan.md). A bit test, safe under any math flags.
__device__ __forceinline__ float nan_or(float x, float otherwise) {
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? x : otherwise;
}

// Online-softmax bookkeeping of one m16 row tile: the new row maxima (over the quad), msc = the max to subtract
// from a raw score (0 for a row that has seen no key) and corr = 2^((old max - new max) * scale_log2), the factor
// the row's O and sum must be scaled by (0 while the old max is -inf). Returns whether some corr != 1.
// Callers take p = 2^((s - msc) * scale_log2): the subtraction comes first, so the row's largest score gives
// exactly 2^0 however large s * scale_log2 is (fmaf(s, scale_log2, -max * scale_log2) leaves the rounding error
// of the product, up to 2^(e - 24) for a product of 2^e: past 2^31 that is an infinite p and a NaN row).
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
    msc[hf] = (mx == NEG_INF) ? 0.f : mx;
    corr[hf] = (row_max[hf] == NEG_INF) ? 0.f : vbw::fast_exp2((row_max[hf] - msc[hf]) * scale_log2);
    moved |= corr[hf] != 1.f;
    row_max[hf] = mx;
  }
  return moved;
}

}  // namespace vbw_attn
