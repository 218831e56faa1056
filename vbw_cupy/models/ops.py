"""The array operations the Llama forward pass is written in: one small backend, NumPy today, CuPy later.

`ArrayOps(xp, attn_dtype)` implements every operation with array-module calls and the library's public,
dispatching ops (`vbw_cupy.quantize`, `fp4_matmul`, `flash_attention_varlen`, `PagedKVCache`): NumPy arrays
run the float64 reference (`vbw_cupy.reference`), so `numpy_ops()` is the CPU path. The GPU path is
`gpu.LlamaGPU`, written with fused kernels rather than these operations.

Conventions: activations are [T, features] (T tokens of a packed batch); the residual stream, norms and
matmul outputs are float32; q, k, v enter attention and the KV cache in `attn_dtype`; a linear weight is
[out, in] (a dense array or an `FP4Tensor`), so `matmul(x, w)` is x @ w.T.
"""
from __future__ import annotations

import numpy as np

from ..attention import flash_attention_varlen
from ..fp4 import FP4Tensor, dequantize, quantize
from ..gemm import fp4_matmul
from ..paged import PagedKVCache

#: weight storage choices for the linear layers (the FP4 formats of docs/formats.md, or dense).
WEIGHT_FORMATS = ("fp32", "fp16", "nvfp4", "mxfp4")
ROPE_STYLES = ("adjacent", "halves")


class ArrayOps:
    """Backend of the Llama forward pass over array module `xp` (numpy or cupy).

    attn_dtype: dtype of q, k, v in attention and of the KV cache (float32 on NumPy; the GPU kernels take
    float16 or bfloat16).
    """

    def __init__(self, xp=np, attn_dtype=np.float32):
        self.xp = xp
        self.attn_dtype = np.dtype(attn_dtype)

    # -- moving data
    def asarray(self, x, dtype=None):
        """A host array (a memory map, say) as a backend array; on NumPy a view when no cast is needed."""
        return self.xp.asarray(x, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        """x as a NumPy array (a copy from the GPU for CuPy arrays)."""
        return x if isinstance(x, np.ndarray) else x.get()

    def linear(self, w: np.ndarray, weights: str):
        """A linear layer's weight [out, in] (host array) stored as `weights` (see WEIGHT_FORMATS): dense float32
        or float16, or quantized along `in` to NVFP4 / MXFP4 (on NumPy through the bit-exact reference)."""
        if weights == "fp32":
            return self.asarray(w, np.float32)
        if weights == "fp16":
            return self.asarray(w, np.float16)
        return quantize(self.asarray(w, np.float32), weights)

    # -- the operations
    def embedding(self, table, ids):
        """Rows `ids` (host int array [T]) of `table` [vocab, dim], as float32 [T, dim]; ValueError for an id
        outside [0, vocab) (NumPy indexing would wrap a negative one)."""
        ids = np.asarray(ids)
        bad = np.flatnonzero((ids < 0) | (ids >= table.shape[0]))
        if bad.size:
            raise ValueError(f"token ids: expected values in [0, {table.shape[0]}), got {int(ids[bad[0]])} at "
                             f"position {int(bad[0])}")
        return table[self.xp.asarray(ids)].astype(np.float32)

    def rmsnorm(self, x, w, eps: float):
        """x / sqrt(mean(x^2) + eps) * w over the last axis, float32."""
        xp = self.xp
        ms = xp.mean(xp.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x * (1.0 / xp.sqrt(ms + np.float32(eps)))).astype(np.float32) * w.astype(np.float32, copy=False)

    def matmul(self, x, w):
        """x [T, in] float32 times a weight [out, in] (dense or FP4Tensor): x @ w.T as float32 [T, out]."""
        if isinstance(w, FP4Tensor):
            if self.xp is not np:
                return fp4_matmul(x, w, out_dtype=np.float32)
            # the reference GEMM decodes the weight at every call: decode it once, keep it with the tensor
            dense = w._cache.get("dense_float32")
            if dense is None:
                dense = w._cache["dense_float32"] = dequantize(w, np.float32)
            w = dense
        if self.xp is np:  # BLAS has float32, not float16: widen the weight (no copy when it is float32)
            return x @ w.astype(np.float32, copy=False).T
        return (x.astype(w.dtype) @ w.T).astype(np.float32)

    def silu_mul(self, a, b):
        """silu(a) * b, elementwise (the SwiGLU gate)."""
        return a / (1.0 + self.xp.exp(-a)) * b

    def rope(self, q, k, positions, style: str, inv_freq: np.ndarray):
        """Rotary embedding of q [T, Hq, D] and k [T, Hkv, D] at host int positions [T]: pair j of a head
        turns by angle pos * inv_freq[j] (float64 [D / 2], LlamaConfig.rope_inv_freq). style "adjacent" pairs
        elements (2j, 2j + 1) (llama2.c); "halves" pairs (j, j + D / 2) (Hugging Face)."""
        ang = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
        cos = self.xp.asarray(np.cos(ang)[:, None, :], dtype=np.float32)
        sin = self.xp.asarray(np.sin(ang)[:, None, :], dtype=np.float32)
        return _rotate(self.xp, q, cos, sin, style), _rotate(self.xp, k, cos, sin, style)

    def attention_prefill(self, q, k, v, cu_seqlens: np.ndarray, max_seqlen: int):
        """Causal grouped-query attention of packed prompts: q [T, Hq, D], k, v [T, Hkv, D] in attn_dtype,
        sequence b on rows cu_seqlens[b]:cu_seqlens[b + 1] (host int32). Returns [T, Hq, D] float32."""
        cu = self.xp.asarray(cu_seqlens, dtype=np.int32)
        o = flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True)
        return o.astype(np.float32)

    def new_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, max_batch: int,
                     max_blocks_per_seq: int) -> PagedKVCache:
        """One layer's paged KV cache in attn_dtype."""
        return PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, self.attn_dtype, max_batch=max_batch,
                            max_blocks_per_seq=max_blocks_per_seq, xp=self.xp)

    def attention_decode(self, q, cache: PagedKVCache, slots):
        """One query token per sequence, q [B, Hq, D] in attn_dtype, over cache slots `slots` (host ints, the
        current token already appended). Returns [B, Hq, D] float32."""
        return cache.attention(q, seqs=slots).astype(np.float32)


def _rotate(xp, x, cos, sin, style):
    x = x.astype(np.float32, copy=False)
    if style == "adjacent":
        a, b = x[..., 0::2], x[..., 1::2]
        out = xp.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def numpy_ops() -> ArrayOps:
    """The CPU backend: NumPy arrays, float32 activations, attention by the float64 reference."""
    return ArrayOps(np, np.float32)
