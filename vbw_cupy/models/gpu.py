"""The Llama forward pass on the GPU: the library's GEMMs and attention with fused kernels around them
(cuda_src/model.cu), and a decode step captured in one CUDA graph.

`LlamaGPU` has the interface of `Llama` (`new_cache`, `prefill`, `decode`), so `generate_ids` and the CLI run
either; it adds `decode_sample` (the next tokens sampled on the GPU, only B ints copied back per step) and
`decode_steps` (several such steps in one call and one graph, the ids fed back on the device).

Per layer: x (float32 residual) -> add_rmsnorm -> one fused QKV GEMM -> rope_store (RoPE on q and k, K and V
stored into the paged cache at each token's position) -> flash_attention_varlen (prefill) or paged_attention
(decode) -> O GEMM -> add_rmsnorm -> one fused gate/up GEMM -> silu_mul -> down GEMM (at decode, one token and FP4
weights, gate/up and silu_mul are one GEMV: gemm.swiglu_gemv). GEMMs are
`fp4_matmul` for nvfp4 / mxfp4 weights and cuBLAS (`_blas.matmul_nt`, capturable) for dense ones ("fp16",
stored in the activations' dtype);
activations entering a GEMM or attention are float16 (or bfloat16, `act_dtype`).

The cache reserves each slot's blocks up front (`GPUKVCache`): block_table never changes during decoding, so
a decode step needs no host values. `seq_lens` lives on the device and is advanced by the step itself
(`step_positions`); the host keeps a mirror for planning. A decode graph is captured per (batch, context
bucket): the bucket is the smallest power of two >= the longest sequence, the max_seqlen paged_attention
plans its split for, so a step costs what its context needs. Each graph owns a private CuPy memory pool for
the arrays it allocated while being captured, so nothing the graph writes is ever handed to another array.
A sampling loop's host cost is kept off the GPU's critical path: the step copies its sampled ids into
page-locked memory itself, and a call that continues the previous step (same cache and slots, its ids fed
back, the cache untouched since) replays after a few comparisons (`_replay_again`).
"""
from __future__ import annotations

import weakref

import numpy as np

from .. import _blas
from .. import _checks
from .. import _errors
from .. import _runtime as rt
from ..attention import flash_attention_varlen
from ..fp4 import FP4Tensor, dequantize, quantize
from ..gemm import fp4_matmul, swiglu_gemv
from ..paged import paged_attention
from .llama import LayerWeights, LlamaConfig, LlamaWeights, check_model_args, check_prefill
from .ops import ArrayOps

_SOURCE = "model.cu"
_NS = "vbw_model::"
_THREADS = 256
#: weight storage on the GPU: dense float16 (cuBLAS) or FP4 (fp4_matmul)
GPU_WEIGHT_FORMATS = ("fp16", "nvfp4", "mxfp4")
_ACT = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
# The decode graph launches the kernels that allow it as programmatic dependents (cuda_src/pdl.cuh): each one's
# launch and weight loads overlap the kernel before it. False: plain launches (A/B runs; read at capture).
_PDL = True
#: the most decode steps one call (and one CUDA graph) may run: `LlamaGPU.decode_steps`
MAX_STEPS = 16


def kernel_instances() -> list[tuple[str, str]]:
    names = [f"{_NS}embedding<float>", f"{_NS}step_positions", f"{_NS}sample_rows"]
    for t in _ACT.values():
        names += [f"{_NS}rope_store<{t}>", f"{_NS}silu_mul<{t}>", f"{_NS}add_rmsnorm<{t}, {t}>"]
    return [(_SOURCE, n) for n in names]


def _kernel(name: str):
    return rt.get_kernel(_SOURCE, _NS + name)


def rope_table(config: LlamaConfig) -> np.ndarray:
    """float32 [seq_len, head_dim]: per position the head_dim / 2 cosines then sines of pos * inv_freq[j]
    (config.rope_inv_freq()), computed in float64 (as the reference's `ArrayOps.rope`)."""
    ang = np.arange(config.seq_len, dtype=np.float64)[:, None] * config.rope_inv_freq()[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


class _KVStorage:
    """A GPUKVCache's device arrays: what its decode graphs are captured over. A model hands the storage of a
    cache nobody holds any more to its next cache of the same size (LlamaGPU.new_cache), so that cache replays
    the graphs instead of capturing them again."""
    __slots__ = ("k", "v", "block_table", "seq_lens", "active", "__weakref__")

    def __init__(self, k, v, block_table, seq_lens, active):
        self.k, self.v, self.block_table, self.seq_lens, self.active = k, v, block_table, seq_lens, active


class GPUKVCache:
    """Every layer's paged KV cache in one pair of arrays [n_layers, num_blocks, block_size, Hkv, D], with one
    block table and one seq_lens shared by the layers (Hkv: n_kv_heads, a tensor-parallel rank's own). Slot b
    owns blocks b * per_seq .. (b + 1) * per_seq - 1 for its whole life (reserved at creation), so decoding
    never allocates. `storage`: the arrays of an earlier cache of this size to take over, emptied."""

    def __init__(self, config: LlamaConfig, max_batch: int, max_tokens: int, dtype, block_size: int = 16,
                 n_kv_heads: int | None = None, storage: _KVStorage | None = None):
        cp = rt.require_cupy()
        per_seq = -(-max_tokens // block_size)
        nb = max_batch * per_seq
        shape = (config.n_layers, nb, block_size, n_kv_heads or config.n_kv_heads, config.head_dim)
        self.block_size, self.num_blocks, self.capacity = block_size, nb, per_seq * block_size
        if storage is None:
            storage = _KVStorage(cp.zeros(shape, dtype=dtype), cp.zeros(shape, dtype=dtype),
                                 cp.arange(nb, dtype=cp.int32).reshape(max_batch, per_seq),
                                 cp.ones(max_batch, dtype=cp.int32),  # an idle slot attends one (zero) key
                                 cp.zeros(max_batch, dtype=cp.int32))
        else:
            if storage.k.shape != shape or storage.k.dtype != np.dtype(dtype) or storage.block_table.shape != (
                    max_batch, per_seq):
                raise ValueError(f"storage: expected K/V {shape} {np.dtype(dtype)}, got {storage.k.shape} "
                                 f"{storage.k.dtype}")
            with storage.k.device:   # emptied as a new cache is: no stale keys for idle slots to read
                storage.k.fill(0)
                storage.v.fill(0)
                storage.seq_lens.fill(1)
                storage.active.fill(0)
        self.storage = storage
        self.k, self.v, self.block_table = storage.k, storage.v, storage.block_table
        self.seq_lens, self.active = storage.seq_lens, storage.active
        self._active = np.zeros(max_batch, dtype=np.int32)   # host mirror of `active`
        self._lens = np.zeros(max_batch, dtype=np.int64)
        self._version = 0   # bumped by every change of the mirrors and every step (LlamaGPU._step's memo)

    @property
    def max_batch(self) -> int:
        return int(self._lens.shape[0])

    def retire(self) -> None:
        """Give up the arrays (LlamaGPU.recycle): any later use of this cache fails instead of writing into a
        storage that another cache owns."""
        self.storage = self.k = self.v = self.block_table = self.seq_lens = self.active = None

    def lengths(self, slots) -> np.ndarray:
        """Tokens held by each slot of `slots` (the host mirror; no device access)."""
        return self._lens[np.asarray(slots, dtype=np.int64)].copy()

    def free(self, slot: int) -> None:
        """Empty slot `slot` (its blocks stay reserved for the next sequence put there). It stays idle in decode
        steps (no position, nothing stored) until a prefill fills it again."""
        _check_live(self)
        self._version += 1
        self._lens[slot] = 0
        with self.seq_lens.device:   # a tensor-parallel rank's cache, freed from the caller's thread
            self.seq_lens[slot] = 1
            self.active[slot] = 0
        self._active[slot] = 0


def _bucket(longest: int, capacity: int) -> int:
    """The context bucket of a decode step whose longest sequence holds `longest` tokens (its graph's key)."""
    return min(1 << (longest - 1).bit_length(), capacity)


def _state_key(cache, inv_temp) -> tuple:
    """LlamaGPU._graphs' key of the decode state of a cache's storage and sampling mode (the seed is not in it:
    the graphs read it from the state's seed buffer)."""
    return id(cache.storage), inv_temp


def _check_live(cache) -> None:
    if cache.storage is None:
        raise ValueError("cache: this cache was recycled (its arrays belong to a newer cache)")


def _interleave8(w1, w3):
    """[w1; w3] with rows in blocks of 8 taken in turn (8 of w1, the same 8 of w3, ...): the gate / up layout
    whose decode GEMV computes silu(gate) * up in its epilogue (gemm.swiglu_gemv). H % 8 == 0."""
    H, D = w1.shape
    return rt.cupy.stack([w1.reshape(H // 8, 8, D), w3.reshape(H // 8, 8, D)], axis=1).reshape(2 * H, D)


class _Linear:
    """A linear layer's weight [out, in] on the GPU: dense in the activations' dtype (cuBLAS, through `_blas`
    so that it can be captured) or an FP4Tensor (fp4_matmul)."""
    __slots__ = ("w",)

    def __init__(self, w_gpu_f32, fmt: str, act_dtype):
        self.w = w_gpu_f32.astype(act_dtype) if fmt == "fp16" else quantize(w_gpu_f32, fmt)

    def __call__(self, x, out_dtype=None):
        if isinstance(self.w, FP4Tensor):
            return fp4_matmul(x, self.w, out_dtype=out_dtype)
        return _blas.matmul_nt(x, self.w, out_dtype)

    def swiglu(self, x):
        """silu(gate) * up of a gate / up weight interleaved by 8 rows (`_interleave8`) in one launch, for one
        token and FP4 weights; None otherwise (then: the GEMM, then silu_mul)."""
        return swiglu_gemv(x, self.w) if isinstance(self.w, FP4Tensor) and x.shape[0] == 1 else None

    def dense(self) -> np.ndarray:
        """The weight as the GEMM sees it, float32 on the host."""
        w = self.w
        return (dequantize(w, np.float32) if isinstance(w, FP4Tensor) else w.astype(np.float32)).get()


class LlamaGPU:
    """A Llama model on the GPU (see the module docs). Build one with `load_model(path, weights=..., device="gpu")`
    or `LlamaGPU(config, weights, weight_format)` from host (NumPy, memory-mapped) or CuPy weights.

    weight_format: "fp16" (cuBLAS), "nvfp4" or "mxfp4" (fp4_matmul; quantized at load). q, k and v are fused
    into one [dim + 2 kv_dim, dim] weight and gate / up into one [2 hidden_dim, dim] weight (an FP4 tensor
    quantizes each row on its own, so fusing changes nothing but NVFP4's per-tensor scale). The classifier is
    a linear layer of the same format; norms and the embedding stay float32.

    Head counts and the FFN width are read from the weights' shapes, so a tensor-parallel rank
    (`dist.TPLlamaGPU`) runs this class on its shard; `_reduce` (the identity here) joins the ranks' partial
    outputs of the O and down projections.
    """

    _SHARDED = False  # (dist.TPLlamaGPU holds a shard: dist.tp checked the full weights)

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, weight_format: str = "fp16", *,
                 act_dtype=np.float16):
        cp = rt.require_cupy()
        if weight_format not in GPU_WEIGHT_FORMATS:
            raise ValueError(f"weight_format: expected one of {GPU_WEIGHT_FORMATS} on the GPU, got {weight_format!r}")
        check_model_args(config, weights, self._SHARDED)
        act_dtype = np.dtype(act_dtype)
        if act_dtype.name not in _ACT:
            raise TypeError(f"act_dtype: expected float16 or bfloat16, got {act_dtype}")
        self.config, self.weight_format, self.act_dtype = config, weight_format, act_dtype
        hd, lw0 = config.head_dim, weights.layers[0]
        self.n_heads, self.n_kv_heads = lw0.wq.shape[0] // hd, lw0.wk.shape[0] // hd   # this model's (or shard's)
        self.hidden_dim = lw0.w1.shape[0]
        self._t = _ACT[act_dtype.name]
        self.ops = ArrayOps(cp, act_dtype)  # generate_ids uses ops.to_host
        f32 = lambda a: cp.asarray(a, dtype=cp.float32)
        lin = lambda *parts: _Linear(cp.concatenate([f32(p) for p in parts]) if len(parts) > 1 else f32(parts[0]),
                                     weight_format, act_dtype)
        self.embedding = f32(weights.token_embedding)
        # gate / up: one GEMM, rows interleaved by 8 where the hidden size allows (the decode step then fuses
        # silu(gate) * up into the GEMV), else [w1; w3]
        self._inter = self.hidden_dim % 8 == 0
        w13 = (lambda lw: _Linear(_interleave8(f32(lw.w1), f32(lw.w3)), weight_format, act_dtype)) if self._inter \
            else (lambda lw: lin(lw.w1, lw.w3))
        self.layers = [dict(rms_att=f32(lw.rms_att), rms_ffn=f32(lw.rms_ffn), wqkv=lin(lw.wq, lw.wk, lw.wv),
                            wo=lin(lw.wo), w13=w13(lw), w2=lin(lw.w2)) for lw in weights.layers]
        self.rms_final = f32(weights.rms_final)
        self.classifier = lin(weights.classifier)
        self.rope = cp.asarray(rope_table(config))
        self._graphs: dict = {}
        self._memo = None   # the last decode step's arguments and state (_replay_again)
        self._spare = (None, lambda: None)   # (storage of the last cache made, weakref to that cache)

    # -- host view of what runs (for the tests' reference runs)
    def host_weights(self) -> LlamaWeights:
        """The weights as the GPU computes with them (FP4 weights dequantized), float32 on the host, unfused."""
        c = self.config
        layers = []
        for L in self.layers:
            qkv, w13 = L["wqkv"].dense(), L["w13"].dense()
            q, kv, ffn = self.n_heads * c.head_dim, self.n_kv_heads * c.head_dim, self.hidden_dim
            if self._inter:  # back to [w1; w3]
                w13 = w13.reshape(ffn // 8, 2, 8, -1).transpose(1, 0, 2, 3).reshape(2 * ffn, -1)
            layers.append(LayerWeights(
                rms_att=L["rms_att"].get(), wq=qkv[:q], wk=qkv[q:q + kv], wv=qkv[q + kv:],
                wo=L["wo"].dense(), rms_ffn=L["rms_ffn"].get(), w1=w13[:ffn], w2=L["w2"].dense(), w3=w13[ffn:]))
        return LlamaWeights(self.embedding.get(), layers, self.rms_final.get(), self.classifier.dense())

    def new_cache(self, max_batch: int, max_tokens: int) -> GPUKVCache:
        """An empty cache for max_batch sequences of up to max_tokens tokens. The model keeps the arrays of the
        last cache it made: when that cache is no longer referenced, a new one of the same size takes them over
        (emptied), and the decode graphs captured over them replay instead of being captured again (each
        `generate` call makes a cache). `release_cache()` lets that memory go."""
        args = (self.config, max_batch, max_tokens, self.act_dtype)
        spare, owner = self._spare
        reuse = None
        if spare is not None and owner() is None:
            if spare.block_table.shape == (max_batch, -(-max_tokens // 16)):
                reuse = spare
            else:  # another size: let the dead arrays (and graphs over them) go before allocating new ones
                self._spare = (None, lambda: None)
                self._graphs = {k: st for k, st in self._graphs.items() if st.cache() is not spare}
                spare = None   # (this name too held them)
        cache = GPUKVCache(*args, n_kv_heads=self.n_kv_heads, storage=reuse)
        self._spare = (cache.storage, weakref.ref(cache))
        return cache

    def recycle(self, cache: GPUKVCache) -> None:
        """Hand `cache`'s arrays to the next new_cache of its size now, whoever still refers to the cache object
        (generate_ids does this when it is done: a traceback's frames, say, can keep a finished cache alive).
        The cache cannot be used afterwards."""
        if cache.storage is None:
            return
        if self._spare[0] is cache.storage:
            self._spare = (cache.storage, lambda: None)
        cache.retire()

    def release_cache(self) -> None:
        """Forget the arrays kept for the next cache and the decode graphs captured over them."""
        self._spare = (None, lambda: None)
        self._graphs = {}

    def _reduce(self, partial):
        """The O and down projections' outputs joined over tensor-parallel ranks (one model: as they are)."""
        return partial

    # -- the kernels
    def _norm(self, x, delta, w):
        cp = rt.cupy
        out = cp.empty(x.shape, dtype=self.act_dtype)
        rt.launch(_kernel(f"add_rmsnorm<{self._t}, {self._t}>"), (x.shape[0],), (1024,),
                  (x, rt.NULL if delta is None else delta, w, out, np.int32(x.shape[1]), np.float32(self.config.norm_eps)))
        return out

    def _embed(self, ids):
        cp, c = rt.cupy, self.config
        x = cp.empty((ids.shape[0], c.dim), dtype=cp.float32)
        rt.launch(_kernel("embedding<float>"), (ids.shape[0],), (_THREADS,),
                  (self.embedding, ids, x, np.int32(c.dim), np.int32(c.vocab_size),
                   _errors.buffer(cp.cuda.Device().id)))
        return x

    def _rope_store(self, qkv, pos, slots, cache: GPUKVCache, layer: int, packed_kv: bool):
        cp, c = rt.cupy, self.config
        T, D = qkv.shape[0], c.head_dim
        Hq, Hkv = self.n_heads, self.n_kv_heads
        q = cp.empty((T, Hq, D), dtype=self.act_dtype)
        k = cp.empty((T, Hkv, D), dtype=self.act_dtype) if packed_kv else None
        v = cp.empty((T, Hkv, D), dtype=self.act_dtype) if packed_kv else None
        bt = cache.block_table
        rt.launch(_kernel(f"rope_store<{self._t}>"), (T, Hq + Hkv), (D // 2,),
                  (qkv, pos, slots, self.rope, np.int32(c.seq_len), q, rt.NULL if k is None else k,
                   rt.NULL if v is None else v, cache.k[layer], cache.v[layer], bt,
                   np.int32(bt.shape[0]), np.int32(bt.shape[1]), np.int32(cache.num_blocks),
                   np.int32(cache.block_size), np.int32(Hq), np.int32(Hkv), np.int32(D),
                   np.int32(0 if c.rope_style == "adjacent" else 1), _errors.buffer(cp.cuda.Device().id)))
        return q, k, v

    def _swiglu(self, gu):
        cp = rt.cupy
        H = gu.shape[1] // 2
        out = cp.empty((gu.shape[0], H), dtype=self.act_dtype)
        n = out.size
        rt.launch(_kernel(f"silu_mul<{self._t}>"), (min(-(-n // _THREADS), 4096),), (_THREADS,),
                  (gu, out, np.int32(H), np.int64(n), np.int32(1 if self._inter else 0)))
        return out

    def _ffn_hidden(self, w13, h):
        """silu(h W1^T) * (h W3^T): fused into the GEMV for one token with FP4 weights, else GEMM + silu_mul."""
        s = w13.swiglu(h) if self._inter else None
        return s if s is not None else self._swiglu(w13(h))

    def _forward(self, x, pos, slots, cache, attend, packed_kv, rows=None):
        """The blocks and the classifier over x [T, dim] float32 (consumed): float32 logits [T, vocab], or of
        the rows `rows` (a CuPy index array) only."""
        c = self.config
        T = x.shape[0]
        h = self._norm(x, None, self.layers[0]["rms_att"])
        for i, L in enumerate(self.layers):
            q, k, v = self._rope_store(L["wqkv"](h), pos, slots, cache, i, packed_kv)
            o = attend(i, q, k, v).reshape(T, self.n_heads * c.head_dim)
            h = self._norm(x, self._reduce(L["wo"](o)), L["rms_ffn"])
            d = self._reduce(L["w2"](self._ffn_hidden(L["w13"], h)))
            h = self._norm(x, d, self.layers[i + 1]["rms_att"] if i + 1 < len(self.layers) else self.rms_final)
        return self.classifier(h if rows is None else h[rows], out_dtype=np.float32)

    # -- prefill
    def prefill(self, prompts, cache: GPUKVCache, slots, all_logits: bool = False):
        """Run prompts (lists of token ids) at positions 0.. into empty cache slots `slots` (one varlen causal
        attention per layer). Returns float32 logits of each prompt's last token [B, vocab], or with
        all_logits=True of every token [sum of lengths, vocab], as CuPy arrays."""
        cp = rt.cupy
        _check_live(cache)
        lens, slots = check_prefill(prompts, slots, cache.max_batch, cache.capacity, self.config.seq_len)
        cu_h = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ids = cp.asarray(np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts]))
        pos = cp.asarray(np.concatenate([np.arange(n, dtype=np.int32) for n in lens]))
        tok_slot = cp.asarray(np.repeat(slots, lens).astype(np.int32))
        cu, max_len = cp.asarray(cu_h), int(lens.max())

        def attend(layer, q, k, v):
            return flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)

        cache._version += 1   # before the forward: it writes the slots' K/V even if it raises later
        logits = self._forward(self._embed(ids), pos, tok_slot, cache, attend, packed_kv=True,
                               rows=None if all_logits else cp.asarray(cu_h[1:] - 1))
        cache._lens[slots] = lens
        cache.seq_lens[cp.asarray(slots)] = cp.asarray(lens.astype(np.int32))
        cache.active[cp.asarray(slots)] = 1
        cache._active[slots] = 1
        return logits

    # -- decode
    def _decode_step(self, st: "_StepState", cache: GPUKVCache, bucket: int, n: int = 1):
        """n decode steps over slots 0..B-1 on the state's buffers (no host values: capturable). Each step after
        the first feeds back the ids the one before sampled, on the device; step i's ids go to st.pinned[i]."""
        cp = rt.cupy
        B = st.tokens.shape[0]
        table, lens = cache.block_table[:B], cache.seq_lens[:B]
        assert n == 1 or st.inv_temp is not None, "several steps need sampling on the device"

        def attend(layer, q, k, v):
            return paged_attention(q, cache.k[layer], cache.v[layer], table, lens, max_seqlen=bucket)

        for i in range(n):
            rt.launch(_kernel("step_positions"), (-(-B // 128),), (128,), (cache.seq_lens, cache.active, st.pos,
                                                                             np.int32(B)))
            logits = self._forward(self._embed(st.tokens), st.pos, st.slots, cache, attend, packed_kv=False)
            st.logits[...] = logits
            if st.inv_temp is not None:
                rt.launch(_kernel("sample_rows"), (B,), (_THREADS,),
                          (st.logits, np.int32(self.config.vocab_size), np.float32(st.inv_temp), st.seed_buf,
                           st.pos, st.tokens))
                # the ids to page-locked host memory within the step (a graph then needs no copy after it)
                cp.cuda.runtime.memcpyAsync(st.pinned[i].ctypes.data, st.tokens.data.ptr, st.tokens.nbytes,
                                            cp.cuda.runtime.memcpyDeviceToHost, cp.cuda.get_current_stream().ptr)

    def _state(self, cache: GPUKVCache, inv_temp, seed) -> "_StepState":
        """The step buffers (and graphs) for this cache's storage and sampling mode; those of other storages are
        dropped. A state holds a weak reference to its storage: new arrays that reuse a dead storage's id()
        never replay graphs captured over the dead one's (freed) arrays, while a cache that took over a storage
        (new_cache) replays its graphs."""
        key = _state_key(cache, inv_temp)
        st = self._graphs.get(key)
        if st is None or st.cache() is not cache.storage:
            for k in [k for k, s in self._graphs.items() if s.cache() is not cache.storage]:
                del self._graphs[k]
            st = self._graphs[key] = _StepState(cache.max_batch, self.config.vocab_size, inv_temp)
            st.cache = weakref.ref(cache.storage)
        if st.seed != seed:  # (on the stream, before the step or replay that reads it)
            st.seed_buf.fill(np.uint64(seed))
            st.seed = seed
        return st

    def decode(self, tokens, cache: GPUKVCache, slots, *, graph: bool = True):
        """Feed `tokens[i]` to cache slot `slots[i]` (one token each, after its cached ones); slots of the cache
        not listed stay idle. Returns float32 logits [len(slots), vocab] (CuPy). With graph=True the step is
        replayed from a CUDA graph (captured on first use for this batch size and context bucket)."""
        st = self._step(tokens, cache, slots, graph, None, 0, 1)
        return st.logits[rt.cupy.asarray(np.asarray(slots, dtype=np.int64))]

    def decode_sample(self, tokens, cache: GPUKVCache, slots, *, temperature: float = 0.0, seed: int = 0,
                      graph: bool = True) -> np.ndarray:
        """`decode` then the next token of each listed slot sampled on the GPU: greedy at temperature 0, else
        a draw from softmax(logits / temperature) (Gumbel-max, keyed by seed, slot and position). Returns
        host int64 ids [len(slots)] (the only copy to the host)."""
        return self.decode_steps(tokens, cache, slots, 1, temperature=temperature, seed=seed, graph=graph)[0]

    def decode_steps(self, tokens, cache: GPUKVCache, slots, steps: int, *, temperature: float = 0.0,
                     seed: int = 0, graph: bool = True) -> np.ndarray:
        """`steps` decode_sample steps in one call (1 <= steps <= MAX_STEPS): step 0 feeds `tokens`, each later
        step the ids the step before sampled, without the host in between (one CUDA graph runs them all).
        Returns host int64 ids [steps, len(slots)], row i the ids step i sampled: those of `steps` calls of
        decode_sample, except that every step runs with the context bucket of the last one (paged attention's
        split count follows the bucket, so where the steps cross one a near-tie can round the other way).
        Every slot advances `steps` tokens: a caller that stops a sequence at a stop id drops what that slot
        sampled after it (and frees the slot)."""
        if not temperature >= 0.0:
            raise ValueError(f"temperature: expected a value >= 0, got {temperature}")
        if not _checks._is_int(steps) or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"steps: expected an int in [1, {MAX_STEPS}], got {steps!r}")
        n = int(steps)
        inv = 0.0 if temperature == 0.0 else 1.0 / float(temperature)
        st = self._step(tokens, cache, slots, graph, inv, int(seed) & ((1 << 64) - 1), n)
        if not graph:  # the steps copied their ids into st.pinned; a replay has waited for them already
            rt.cupy.cuda.get_current_stream().synchronize()
        ids = st.pinned[:n].copy()
        st.held = ids[n - 1]
        return ids[:, np.asarray(slots, dtype=np.int64)].astype(np.int64)

    def _step(self, tokens, cache, slots, graph, inv_temp, seed, n):
        """n steps (n > 1 only when sampling) after the checks, or through _replay_again's fast path."""
        fast = self._replay_again(tokens, cache, slots, graph, inv_temp, seed, n)
        if fast is not None:
            return fast
        self._memo = None   # set again only once this step has run
        _check_live(cache)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        B = cache.max_batch
        if not slots.size or slots.min() < 0 or slots.max() >= B or \
                (slots.size > 1 and np.unique(slots).size != slots.size):
            raise ValueError(f"slots: expected at least one slot, distinct, in [0, {B}), got {slots.tolist()}")
        if np.size(tokens) != slots.size:
            raise ValueError(f"tokens: expected one token per slot ({slots.size}), got {np.size(tokens)}")
        lens = cache._lens[slots]
        shortest, held = int(lens.min()), int(lens.max())
        longest = held + n
        if shortest < 1:
            raise ValueError("slots: every slot needs a prefilled sequence")
        what = "a sequence" if n == 1 else f"a sequence ({held} tokens) {n} steps on"
        if longest > cache.capacity:
            raise ValueError(f"slots: {what} would pass the cache's capacity of {cache.capacity} tokens")
        if longest > self.config.seq_len:  # the RoPE table's rows: rope_store would flag it
            raise ValueError(f"slots: {what} would pass the model's seq_len = {self.config.seq_len}")
        st = self._state(cache, inv_temp, seed)
        bucket = _bucket(longest, cache.capacity)
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if st.held is None or not np.array_equal(st.held[slots], tokens):  # a sampling loop feeds back what it got
            host_tokens = np.zeros(B, dtype=np.int32)
            host_tokens[slots] = tokens
            st.tokens.set(host_tokens)
            st.held = host_tokens
        active = np.zeros(B, dtype=np.int32)
        active[slots] = 1
        if not np.array_equal(active, cache._active):
            cache.active.set(active)
            cache._active = active
        if not graph:
            self._decode_step(st, cache, bucket, n)
        else:
            g = st.graphs.get((bucket, n))
            if g is None:
                g = st.graphs[bucket, n] = _capture(lambda: self._decode_step(st, cache, bucket, n),
                                                    (cache.seq_lens, st.tokens))
            else:
                g.replay()
        cache._lens[slots] += n
        cache._version += 1   # every step moves it: another model's memo of this cache is stale now
        self._memo = _Memo(cache, slots, graph, inv_temp, seed, longest)
        return st

    def _replay_again(self, tokens, cache, slots, graph, inv_temp, seed, n):
        """The steady state of a decode loop in a few comparisons: the call before was a step of this cache
        and slots (nothing else changed the cache's mirrors since: its version), and the tokens are the ones
        that step sampled (already on the device). Replays or runs the step and returns its state, or None
        when the call needs _step's full checks."""
        m = self._memo
        if m is None or m.cache() is not cache or cache.storage is not m.storage() or \
                cache._version != m.version or (graph, inv_temp, seed) != m.options:
            return None
        if isinstance(slots, (list, tuple)):
            if tuple(slots) != m.key:
                return None
        elif not (isinstance(slots, np.ndarray) and slots.shape == m.slots.shape and (slots == m.slots).all()):
            return None
        # the state through _graphs, as _state keys it: dropping the graphs (release_cache, new_cache, a
        # tensor-parallel group's close) drops what the memo could replay
        st = self._graphs.get(_state_key(cache, inv_temp))
        if st is None or st.held is None or np.shape(tokens) != m.slots.shape or \
                not (st.held[m.slots] == tokens).all():
            return None
        longest = m.longest + n
        if longest > cache.capacity or longest > self.config.seq_len:
            return None   # the full path says which
        bucket = _bucket(longest, cache.capacity)

        def account():
            cache._lens[m.slots] += n
            cache._version += 1
            m.version, m.longest = cache._version, longest

        if not graph:
            self._decode_step(st, cache, bucket, n)
            account()
        else:
            g = st.graphs.get((bucket, n))
            if g is None:
                return None
            g.replay(then=account)   # the bookkeeping while the step runs
        return st


class _Memo:
    """What LlamaGPU._replay_again compares a call with: the last step's cache (weak references: a memo must not
    keep a dropped cache, whose storage new_cache hands on, alive), the cache's version after it, its slots,
    options and longest sequence."""
    __slots__ = ("cache", "storage", "version", "key", "slots", "options", "longest")

    def __init__(self, cache, slots, graph, inv_temp, seed, longest):
        self.cache, self.storage, self.version = weakref.ref(cache), weakref.ref(cache.storage), cache._version
        self.slots = slots.copy()
        self.key = tuple(self.slots.tolist())
        self.options = (graph, inv_temp, seed)
        self.longest = longest


class _StepState:
    """The fixed buffers a decode graph reads and writes: next-token ids in and out, positions, slot ids,
    logits; and the graphs captured over them (one per context bucket and number of steps)."""

    def __init__(self, B: int, vocab: int, inv_temp):
        cp = rt.require_cupy()
        self.tokens = cp.zeros(B, dtype=cp.int32)
        import cupyx
        self.pinned = cupyx.empty_pinned((MAX_STEPS, B), dtype=np.int32)   # row i: `tokens` after step i's sampling
        self.held = None   # host copy of `tokens` when known (skips the upload when the caller feeds it back)
        self.pos = cp.zeros(B, dtype=cp.int32)
        self.slots = cp.arange(B, dtype=cp.int32)
        self.logits = cp.zeros((B, vocab), dtype=cp.float32)
        self.inv_temp = inv_temp
        self.seed_buf, self.seed = cp.zeros(1, dtype=cp.uint64), 0   # the sampling seed the graphs read
        self.cache = lambda: None   # weakref.ref of the cache storage the graphs were captured over (_state)
        self.graphs: dict = {}


class _Graph:
    """A captured step: the graph, the private memory pool of the arrays it allocated, and the stream it was
    captured on. The graph replays on the caller's stream; the capture stream is kept alive because the scratch
    buffers the graph's kernels write are the ones `_plans.scratch` handed to that stream's handle, which a new
    stream could otherwise reuse and share them with eager calls."""

    def __init__(self, graph, pool, stream):
        self.graph, self.pool, self.stream = graph, pool, stream

    def replay(self, then=None):
        """Launch on the current stream (after whatever the caller queued there: no sync needed before), run
        `then()` on the host while the step runs, wait for the step."""
        stream = rt.cupy.cuda.get_current_stream()
        self.graph.launch(stream=stream)
        if then is not None:
            then()
        stream.synchronize()


def _capture(step, state) -> _Graph:
    """Run `step` once eagerly (it builds every plan and scratch buffer), put the arrays `state` back as they
    were, capture `step` on a private stream and memory pool (its kernels as programmatic dependents when
    _PDL), and replay it once: the call is one step."""
    cp = rt.require_cupy()
    saved = [a.copy() for a in state]
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(pool.malloc):
        step()
        for a, b in zip(state, saved):
            a[...] = b
        stream.synchronize()
        stream.begin_capture()
        try:
            if _PDL:
                with rt.programmatic_launches():
                    step()
            else:
                step()
        finally:
            graph = stream.end_capture()
    g = _Graph(graph, pool, stream)
    g.replay()
    return g


def require_gpu() -> None:
    """RuntimeError saying why the GPU model cannot run here (no CuPy, or no visible device)."""
    if not rt.gpu_available():
        raise RuntimeError("device gpu: " + ("CuPy is not installed (pip install vbw_cupy[cuda12])"
                                             if not rt.have_cupy() else "no CUDA device is visible"))


def reference_logits(model: LlamaGPU, prompts, steps: int):
    """Greedy decode of `steps` tokens on the GPU from `prompts`, then the float64-reference model (NumPy,
    the GPU's weights dequantized) run over the same tokens (teacher forcing): (gpu logits, reference
    logits) of every decoded position, host float64 [steps + 1, B, vocab], and the relative error of each."""
    from .llama import Llama
    from .ops import numpy_ops
    B = len(prompts)
    cache = model.new_cache(B, max(map(len, prompts)) + steps)
    gpu = [model.prefill(prompts, cache, range(B)).get()]
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = gpu[-1].argmax(axis=1)
        for s, t in zip(seqs, nxt):
            s.append(int(t))
        gpu.append(model.decode(nxt, cache, range(B)).get())
    ref_model = Llama(model.config, model.host_weights(), numpy_ops(), "fp32")
    full = ref_model.prefill(seqs, ref_model.new_cache(B, max(map(len, seqs))), list(range(B)), all_logits=True)
    lens = [len(p) for p in prompts]
    offs = np.concatenate([[0], np.cumsum([n + steps for n in lens])])
    ref = np.stack([np.stack([full[offs[b] + lens[b] - 1 + i] for b in range(B)]) for i in range(steps + 1)])
    got = np.stack(gpu).astype(np.float64)
    err = np.array([np.linalg.norm(got[i] - ref[i]) / np.linalg.norm(ref[i]) for i in range(steps + 1)])
    return got, ref, err


def selftest_cases():
    def case():
        from .. import _timing
        from .llama import LlamaConfig, random_weights
        cfg = LlamaConfig(dim=256, hidden_dim=768, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000, seq_len=256)
        rows = []
        for fmt in ("fp16", "nvfp4"):
            model = LlamaGPU(cfg, random_weights(cfg, seed=3), fmt)
            rng = np.random.default_rng(4)
            prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 5, 64)]
            _, _, err = reference_logits(model, prompts, 6)
            cache = model.new_cache(1, 200)
            model.prefill([prompts[0]], cache, [0])
            t = _timing.time_ms(lambda: model.decode_sample([5], cache, [0]), warmup=2, rep=20)
            rows.append({"op": "LlamaGPU", "shape": f"dim 256 x 2 layers, GQA 8/2, {fmt}, prefill 3 + 6 decode steps",
                         "error": float(err.max()), "bound": 2e-2, "ok": bool(err.max() <= 2e-2),
                         "time_ms": t, "peer": "-(decode step, graph)", "peer_ms": None})
        return rows
    case.__qualname__ = "LlamaGPU[tiny, fp16 and nvfp4, vs float64 model]"
    return [case]
