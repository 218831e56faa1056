// paged_store.cu: PagedKVCache.append on the GPU: new K/V tokens written at each sequence's length on the device.
//
// What: for row b of the new tokens (cache slot slots[b]) and token t < Tn, the K and V rows [Hkv * D] go to
// position seq_lens[slot] + t of that slot (block block_table[slot][pos / block_size], offset pos % block_size);
// advance_lens then adds Tn to seq_lens[slot]. The lengths are read on the device, so a captured append replays
// correctly step after step (the host reserves the blocks beforehand).
//
// Layout: k_new, v_new [B, Tn, Hkv, D] contiguous; caches [num_blocks, block_size, Hkv, D]; E is the element
// (2 bytes for float16 / bfloat16, 4 for float32: a plain copy, no arithmetic).
//
// Tiling: one CTA of 128 threads per (token, row), a strided copy of the token's Hkv * D elements.
//
// Safety: a slot outside [0, max_batch), a position past the slot's table or a block id outside the cache flags
// the error word (PAGED_SEQ_LENS / PAGED_BLOCK_TABLE, index = row b) and stores nothing.
//
// History: v1 replaces CuPy fancy-index assignment with host-computed offsets (not capturable).
#include "errors.cuh"

namespace vbw_store {

template <typename E>
__global__ void __launch_bounds__(128) paged_append(const E* __restrict__ k_new, const E* __restrict__ v_new,
                                                    const int* __restrict__ slots, const int* __restrict__ seq_lens,
                                                    const int* __restrict__ block_table, int max_batch,
                                                    int max_blocks, int num_blocks, int block_size,
                                                    E* __restrict__ k_cache, E* __restrict__ v_cache, int Tn, int row,
                                                    int* err) {
  const int t = blockIdx.x, b = blockIdx.y;
  const int s = slots[b];
  if ((unsigned)s >= (unsigned)max_batch) {
    if (threadIdx.x == 0 && t == 0) vbw_err::flag(err, vbw_err::PAGED_SEQ_LENS, b);
    return;
  }
  const long long pos = (long long)seq_lens[s] + t;
  if (pos < 0 || pos >= (long long)max_blocks * block_size) {
    if (threadIdx.x == 0) vbw_err::flag(err, vbw_err::PAGED_SEQ_LENS, b);
    return;
  }
  const int blk = block_table[(long long)s * max_blocks + pos / block_size];
  if ((unsigned)blk >= (unsigned)num_blocks) {
    if (threadIdx.x == 0) vbw_err::flag(err, vbw_err::PAGED_BLOCK_TABLE, b);
    return;
  }
  const long long src = ((long long)b * Tn + t) * row;
  const long long dst = ((long long)blk * block_size + pos % block_size) * row;
  for (int i = threadIdx.x; i < row; i += 128) {
    k_cache[dst + i] = k_new[src + i];
    v_cache[dst + i] = v_new[src + i];
  }
}

// seq_lens[slots[b]] += Tn for each row b (after paged_append, which read the old lengths).
__global__ void advance_lens(int* __restrict__ seq_lens, const int* __restrict__ slots, int B, int max_batch,
                             int Tn) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < B && (unsigned)slots[b] < (unsigned)max_batch) seq_lens[slots[b]] += Tn;
}

}  // namespace vbw_store
