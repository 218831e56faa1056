// model.cu: the Llama block's small kernels around the GEMMs and attention (vbw_cupy/models/gpu.py).
//
// What: embedding lookup; residual add fused with RMSNorm; RoPE fused with the paged KV store; SwiGLU;
// decode-step positions; greedy and temperature sampling. All are memory-bound and one launch each, so a
// decode step is ~8 launches a layer and can be captured in one CUDA graph (no host values, no allocation).
//
// Layout: activations are rows of a packed batch, row t of [T, features], contiguous. The residual stream x
// is float32; what feeds a GEMM or attention is T (float16 / bfloat16). qkv is the fused projection's output
// [T, (Hq + 2 Hkv) * D] (q heads, then k heads, then v heads). The paged cache of one layer is
// [num_blocks, block_size, Hkv, D] with block_table [max_batch, max_blocks] and the token's slot and position.
// RoPE angles come from a float32 table [max_pos, D] built in float64 on the host: per position D / 2 cosines,
// then D / 2 sines.
//
// Tiling: one CTA per row (norm: 1024 threads, values in registers; embedding, sampling: 256 threads); rope_store is one CTA
// per (token, head) with D / 2 threads, one rotation pair each; silu_mul is a flat grid-stride loop.
//
// Safety: token ids outside the vocabulary, positions outside the RoPE table or the slot's block table, slots
// outside the batch and block ids outside the cache are flagged in the error word (errors.cuh) and give NaN
// rows; nothing is read or written through them.
//
// History: v1 measured inside the model's decode step; see notes/ for the per-kernel profile. v2: every kernel
// starts with pdl_start() (pdl.cuh), so the decode graph launches them as programmatic dependents.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "errors.cuh"
#include "fp4.cuh"
#include "pdl.cuh"

namespace vbw_model {

using vbw::from_float;
using vbw::to_float;

constexpr int THREADS = 256;

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }

// out[t] = table[ids[t]] as float32; an id outside [0, vocab) gives a NaN row and flags MODEL_TOKEN_IDS.
template <typename E>
__global__ void __launch_bounds__(THREADS) embedding(const E* __restrict__ table, const int* __restrict__ ids,
                                                     float* __restrict__ out, int dim, int vocab, int* err) {
  vbw::pdl_start();
  const int t = blockIdx.x;
  const int id = ids[t];
  float* o = out + (long long)t * dim;
  if ((unsigned)id >= (unsigned)vocab) {
    if (threadIdx.x == 0) vbw_err::flag(err, vbw_err::MODEL_TOKEN_IDS, t);
    for (int i = threadIdx.x; i < dim; i += THREADS) o[i] = nan_f();
    return;
  }
  const E* row = table + (long long)id * dim;
  for (int i = threadIdx.x; i < dim; i += THREADS) o[i] = to_float(row[i]);
}

// Row t: x += delta (when given), then out = x / sqrt(mean(x^2) + eps) * w in float32, stored as O. The
// reference's order: ms in float32, scale = 1 / sqrt(ms + eps), (x * scale) * w. NORM_THREADS threads a row,
// up to NORM_VALS values each kept in registers (dim <= 8192); wider rows re-read x.
constexpr int NORM_THREADS = 1024, NORM_VALS = 8;

__device__ __forceinline__ float norm_block_sum(float v) {
  __shared__ float part[NORM_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) part[w] = v;
  __syncthreads();
  v = l < NORM_THREADS / 32 ? part[l] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename D, typename O>
__global__ void __launch_bounds__(NORM_THREADS) add_rmsnorm(float* __restrict__ x, const D* __restrict__ delta,
                                                            const float* __restrict__ w, O* __restrict__ out,
                                                            int dim, float eps) {
  // w is a weight (no kernel of the stream writes it): read before waiting on the kernel before (pdl.cuh), so
  // its loads are not one more memory round trip after the reduction
  float wv[NORM_VALS];
#pragma unroll
  for (int j = 0; j < NORM_VALS; ++j) {
    const int i = threadIdx.x + j * NORM_THREADS;
    wv[j] = i < dim ? w[i] : 0.f;
  }
  vbw::pdl_start();
  const long long base = (long long)blockIdx.x * dim;
  float vals[NORM_VALS];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NORM_VALS; ++j) {
    const int i = threadIdx.x + j * NORM_THREADS;
    vals[j] = 0.f;
    if (i < dim) {
      float v = x[base + i];
      if (delta != nullptr) {
        v += to_float(delta[base + i]);
        x[base + i] = v;
      }
      vals[j] = v;
      ss += v * v;
    }
  }
  for (int i = threadIdx.x + NORM_VALS * NORM_THREADS; i < dim; i += NORM_THREADS) {
    float v = x[base + i];
    if (delta != nullptr) {
      v += to_float(delta[base + i]);
      x[base + i] = v;
    }
    ss += v * v;
  }
  const float scale = 1.f / sqrtf(norm_block_sum(ss) / dim + eps);
#pragma unroll
  for (int j = 0; j < NORM_VALS; ++j) {
    const int i = threadIdx.x + j * NORM_THREADS;
    if (i < dim) out[base + i] = from_float<O>(vals[j] * scale * wv[j]);
  }
  for (int i = threadIdx.x + NORM_VALS * NORM_THREADS; i < dim; i += NORM_THREADS)
    out[base + i] = from_float<O>(x[base + i] * scale * w[i]);
}

// Decode step start, slot b of the batch: when active[b], pos[b] = seq_lens[b] (the position of the token fed
// now) and seq_lens[b] += 1; an idle slot (a finished sequence) gets pos -1, stores nothing and keeps its length.
__global__ void step_positions(int* __restrict__ seq_lens, const int* __restrict__ active, int* __restrict__ pos,
                               int batch) {
  vbw::pdl_start();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) {
    const int p = seq_lens[b];
    pos[b] = active[b] ? p : -1;
    if (active[b]) seq_lens[b] = p + 1;
  }
}

// grid (T, Hq + Hkv), D / 2 threads. Head h < Hq: q_out[t, h] = rope(q); else kv head j = h - Hq: k = rope(k),
// v as is, both stored at position pos[t] of slot slot[t] in the paged cache and, when k_out is given, also
// packed into k_out / v_out [T, Hkv, D] (prefill's attention input). style 0 rotates pairs (2i, 2i + 1)
// (llama2.c), 1 pairs (i, i + D / 2) (Hugging Face). A bad slot, position or block id: NaN q rows, nothing
// stored, MODEL_POSITIONS or PAGED_BLOCK_TABLE flagged with the token index.
template <typename T>
__global__ void rope_store(const T* __restrict__ qkv, const int* __restrict__ pos, const int* __restrict__ slot,
                           const float* __restrict__ rope, int max_pos, T* __restrict__ q_out,
                           T* __restrict__ k_out, T* __restrict__ v_out, T* __restrict__ k_cache,
                           T* __restrict__ v_cache, const int* __restrict__ block_table, int max_batch,
                           int max_blocks, int num_blocks, int block_size, int Hq, int Hkv, int D, int style,
                           int* err) {
  vbw::pdl_start();
  const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half = D / 2;
  const int width = (Hq + 2 * Hkv) * D;
  const int a_idx = style == 0 ? 2 * i : i, b_idx = style == 0 ? 2 * i + 1 : i + half;
  // this thread's q or k pair (and v pair) requested with pos and slot: one memory round trip less before the
  // block table and RoPE rows (which wait for the position)
  const bool is_q = h < Hq;
  const int j = h - Hq;
  const T* src = qkv + (long long)t * width + (is_q ? h : Hq + j) * D;
  const float a = to_float(src[a_idx]), b = to_float(src[b_idx]);
  T va = from_float<T>(0.f), vb = va;
  if (!is_q) {
    const T* vs = qkv + (long long)t * width + (Hq + Hkv + j) * D;
    va = vs[a_idx];
    vb = vs[b_idx];
  }
  const int p = pos[t], s = slot[t];
  const bool pos_ok = (unsigned)p < (unsigned)max_pos && (unsigned)s < (unsigned)max_batch &&
                      (long long)p < (long long)max_blocks * block_size;
  int blk = -1;
  if (pos_ok) blk = block_table[(long long)s * max_blocks + p / block_size];
  const bool ok = pos_ok && (unsigned)blk < (unsigned)num_blocks;
  if (i == 0 && h == 0 && !ok && p != -1)  // -1: an idle row of a decode step (step_positions)
    vbw_err::flag(err, pos_ok ? vbw_err::PAGED_BLOCK_TABLE : vbw_err::MODEL_POSITIONS, t);
  float c = 0.f, sn = 0.f;
  if (ok) {
    c = rope[(long long)p * D + i];
    sn = rope[(long long)p * D + half + i];
  }
  if (is_q) {
    T* dst = q_out + ((long long)t * Hq + h) * D;
    dst[a_idx] = from_float<T>(ok ? a * c - b * sn : nan_f());
    dst[b_idx] = from_float<T>(ok ? a * sn + b * c : nan_f());
    return;
  }
  const T ka = from_float<T>(ok ? a * c - b * sn : nan_f()), kb = from_float<T>(ok ? a * sn + b * c : nan_f());
  if (!ok) va = vb = from_float<T>(nan_f());
  if (k_out != nullptr) {
    const long long o = ((long long)t * Hkv + j) * D;
    k_out[o + a_idx] = ka;
    k_out[o + b_idx] = kb;
    v_out[o + a_idx] = va;
    v_out[o + b_idx] = vb;
  }
  if (ok) {
    const long long o = (((long long)blk * block_size + p % block_size) * Hkv + j) * D;
    k_cache[o + a_idx] = ka;
    k_cache[o + b_idx] = kb;
    v_cache[o + a_idx] = va;
    v_cache[o + b_idx] = vb;
  }
}

// gu [T, 2 * H] (one fused GEMM: gate then up, or with inter 8 gate columns then the same 8 up columns in turn)
// -> out [T, H] = silu(gate) * up, in float32. (fp4_gemm_mmvk's FLAG_SWIGLU8 computes the same, fused.)
template <typename T>
__global__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, int H, long long n, int inter) {
  vbw::pdl_start();
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
    const long long t = e / H, c = e - t * H;
    const long long gi = t * 2 * H + (inter ? (c >> 3) * 16 + (c & 7) : c), ui = gi + (inter ? 8 : H);
    const float g = to_float(gu[gi]), u = to_float(gu[ui]);
    out[e] = from_float<T>(g / (1.f + expf(-g)) * u);
  }
}

// splitmix64: a counter-based generator, one 64-bit draw per (key, counter).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Row b of logits [B, vocab] -> tokens[b]. inv_temp == 0: argmax (lowest id on a tie, NaN never wins).
// Otherwise a draw from softmax(logits * inv_temp) by the Gumbel-max rule, argmax of logit * inv_temp + g with
// g = -log(-log(u)), u uniform in (0, 1) from splitmix64 keyed by (seed, b, pos[b], id): the same seed and
// positions give the same tokens, whatever the batch's other rows. The seed is read from a device word, so one
// captured decode graph serves every seed.
__global__ void __launch_bounds__(THREADS) sample_rows(const float* __restrict__ logits, int vocab, float inv_temp,
                                                       const unsigned long long* __restrict__ seed,
                                                       const int* __restrict__ pos, int* __restrict__ tokens) {
  vbw::pdl_start();
  const int b = blockIdx.x;
  const float* row = logits + (long long)b * vocab;
  const unsigned long long key = mix64(*seed ^ mix64(((unsigned long long)b << 32) | (unsigned)pos[b]));
  float best = -__int_as_float(0x7f800000);
  int arg = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += THREADS) {
    float v = row[i];
    if (inv_temp != 0.f) {
      const double u = ((mix64(key + (unsigned long long)i) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
      v = v * inv_temp - logf(-(float)log(u));
    }
    if (v > best) {  // i increases per thread: the first of equal values is kept
      best = v;
      arg = i;
    }
  }
  __shared__ float bv[THREADS];
  __shared__ int bi[THREADS];
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = arg;
  __syncthreads();
  for (int o = THREADS / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      const float v2 = bv[threadIdx.x + o];
      const int i2 = bi[threadIdx.x + o];
      if (v2 > bv[threadIdx.x] || (v2 == bv[threadIdx.x] && i2 < bi[threadIdx.x])) {
        bv[threadIdx.x] = v2;
        bi[threadIdx.x] = i2;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) tokens[b] = bi[0] == 0x7fffffff ? 0 : bi[0];
}

}  // namespace vbw_model
