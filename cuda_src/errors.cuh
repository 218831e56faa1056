// errors.cuh: the device error word, how kernels report bad index values without a host sync.
//
// Each device has one int32[16] buffer (vbw_cupy/_errors.py owns it; zero = no error). A kernel that finds a
// bad value in an index array (a block id outside the cache, a sequence length past its table, cu_seqlens out
// of order) writes NaN into the output rows of that sequence, never reads or writes out of bounds, and records
// the smallest bad sequence of each code c as err[c] = max(err[c], 0x7fffffff - sequence). Codes and their
// messages are listed once, in vbw_cupy/_errors.py (CODES); keep the two in step.
#pragma once

namespace vbw_err {

enum : int {
  PAGED_SEQ_LENS = 1,     // seq_lens[b] outside [1, max_blocks * block_size]
  PAGED_BLOCK_TABLE = 2,  // a block id in use outside [0, num_blocks)
  VARLEN_CU_Q = 3,        // cu_seqlens_q[b..b+1] out of order, past the tokens, or longer than max_seqlen_q
  VARLEN_CU_K = 4,        // cu_seqlens_k likewise (max_seqlen_k)
  NVFP4_NONFINITE = 5,    // quantize nvfp4 with a given global_scale met NaN or Inf (index not recorded)
  MODEL_TOKEN_IDS = 6,    // a token id outside [0, vocab) (models: embedding)
  MODEL_POSITIONS = 7,    // a position outside the RoPE table or the slot's block table, or a bad slot
  NVFP4_SATURATED = 8,    // quantize nvfp4: global_scale so small that a block scale exceeds 512 (index not recorded)
  SPARSE_INDICES = 9,     // block_sparse_attention: indptr out of order / past indices, or a block id outside [0, n_k_blocks)
};

__device__ __forceinline__ void flag(int* err, int code, int index) {
  if (err != nullptr) atomicMax(err + code, 0x7fffffff - index);
}

}  // namespace vbw_err
