"""The Llama architecture (docs/models.md): its configuration, its weights, and the forward pass.

The forward pass is written once over an `ArrayOps` backend (`ops.py`): a packed prefill of prompts of
different lengths (varlen causal attention, K and V written into a paged cache), then decode steps of one
token per sequence (paged attention). `Llama.prefill` and `Llama.decode` return logits; sampling and the
generation loop live in `generate.py`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._checks import _is_int, _is_real
from .ops import ROPE_STYLES, WEIGHT_FORMATS, ArrayOps, numpy_ops


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and conventions of a Llama model.

    dim: model width; hidden_dim: FFN width; n_heads query heads and n_kv_heads key/value heads (grouped
    query attention: query head h reads KV head h // (n_heads // n_kv_heads)); seq_len: the longest sequence
    (prompt plus generated tokens, less the last one, which is never fed back). rope_style "adjacent" rotates
    pairs (2j, 2j + 1) of a head (llama2.c), "halves" pairs (j, j + head_dim / 2) (Hugging Face); pair j turns
    by pos * rope_theta^(-2j / head_dim), changed by `rope_scaling` when it is not empty: ("linear", factor)
    divides every frequency by factor; ("llama3", factor, low_freq_factor, high_freq_factor, original_max_len)
    is Llama 3.1's (see `rope_inv_freq`). shared_classifier: the logits use the token embedding. Generation
    stops at BOS or any of `eos_ids`.
    """
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_style: str = "adjacent"
    rope_scaling: tuple = ()
    shared_classifier: bool = True
    bos_id: int = 1
    eos_ids: tuple = (2,)

    def __post_init__(self):
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        for name in ("norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (_is_real(v) and 0 < v < np.inf):
                raise ValueError(f"{name}: expected a positive finite number, got {v!r}")
        if not _is_int(self.bos_id) or self.bos_id < 0:
            raise ValueError(f"bos_id: expected an int token id >= 0, got {self.bos_id!r}")
        if type(self.eos_ids) is not tuple or not all(_is_int(t) and t >= 0 for t in self.eos_ids):
            raise ValueError(f"eos_ids: expected a tuple of int token ids >= 0, got {self.eos_ids!r}")
        if not isinstance(self.shared_classifier, (bool, np.bool_)):
            raise ValueError(f"shared_classifier: expected a bool, got {self.shared_classifier!r}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"n_heads: expected a divisor of dim = {self.dim} with an even head size, "
                             f"got {self.n_heads}")
        if self.dim // self.n_heads > 256:  # the attention kernels' (and paged caches') head dims: 1..256
            raise ValueError(f"n_heads: expected head size dim / n_heads <= 256 (the attention ops' limit), got "
                             f"{self.dim} / {self.n_heads} = {self.dim // self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads = {self.n_heads}, got {self.n_kv_heads}")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style: expected one of {ROPE_STYLES}, got {self.rope_style!r}")
        rs = self.rope_scaling
        numbers = type(rs) is tuple and all(type(v) in (int, float) and 0 < v < np.inf for v in rs[1:])
        if rs != () and not (numbers and ((len(rs) == 2 and rs[0] == "linear") or
                                          (len(rs) == 5 and rs[0] == "llama3" and rs[2] < rs[3]))):
            raise ValueError("rope_scaling: expected (), ('linear', factor) or ('llama3', factor, low_freq_factor, "
                             f"high_freq_factor, original_max_len) with positive finite numbers and low < high, "
                             f"got {rs!r}")

    @property
    def head_dim(self) -> int:
        """dim / n_heads: the size of a head."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """head_dim * n_kv_heads: the width of K and V."""
        return self.head_dim * self.n_kv_heads

    def rope_inv_freq(self) -> np.ndarray:
        """float64 [head_dim / 2]: the angle a position turns pair j by (the model's, the reference's and the
        GPU table's one definition). Llama 3.1's scaling keeps the frequencies whose wavelength 2 pi / f is below
        original_max_len / high_freq_factor, divides those above original_max_len / low_freq_factor by factor,
        and in between blends f / factor and f by (original_max_len / wavelength - low) / (high - low)."""
        D = self.head_dim
        f = float(self.rope_theta) ** (-np.arange(0, D, 2, dtype=np.float64) / D)
        if not self.rope_scaling:
            return f
        kind, factor = self.rope_scaling[0], float(self.rope_scaling[1])
        if kind == "linear":
            return f / factor
        low, high, old_len = (float(v) for v in self.rope_scaling[2:])
        ratio = old_len * f / (2 * np.pi)  # original_max_len / wavelength
        blend = np.clip((ratio - low) / (high - low), 0.0, 1.0)  # 0: long wavelengths (scaled), 1: short (kept)
        return (1.0 - blend) * f / factor + blend * f

    @property
    def stop_ids(self) -> frozenset:
        """The ids generation stops at: BOS and every EOS."""
        return frozenset((self.bos_id, *self.eos_ids))


@dataclasses.dataclass
class LayerWeights:
    """One transformer block; linear weights are [out, in]."""
    rms_att: object   # [dim]
    wq: object        # [dim, dim]
    wk: object        # [kv_dim, dim]
    wv: object        # [kv_dim, dim]
    wo: object        # [dim, dim]
    rms_ffn: object   # [dim]
    w1: object        # [hidden, dim] (gate)
    w2: object        # [dim, hidden] (down)
    w3: object        # [hidden, dim] (up)

    LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclasses.dataclass
class LlamaWeights:
    """All weights; `classifier` is `token_embedding` itself when the classifier is shared."""
    token_embedding: object   # [vocab, dim]
    layers: list
    rms_final: object         # [dim]
    classifier: object        # [vocab, dim]

    def check(self, config: LlamaConfig, source: str) -> None:
        """ValueError naming `source` and the tensor when a shape disagrees with `config`."""
        c = config
        want = {"token_embedding": (c.vocab_size, c.dim), "rms_final": (c.dim,), "classifier": (c.vocab_size, c.dim)}
        got = {n: getattr(self, n) for n in want}
        per_layer = {"rms_att": (c.dim,), "wq": (c.dim, c.dim), "wk": (c.kv_dim, c.dim), "wv": (c.kv_dim, c.dim),
                     "wo": (c.dim, c.dim), "rms_ffn": (c.dim,), "w1": (c.hidden_dim, c.dim),
                     "w2": (c.dim, c.hidden_dim), "w3": (c.hidden_dim, c.dim)}
        if len(self.layers) != c.n_layers:
            raise ValueError(f"{source}: expected {c.n_layers} layers, got {len(self.layers)}")
        for i, layer in enumerate(self.layers):
            for n, shape in per_layer.items():
                want[f"layers[{i}].{n}"] = shape
                got[f"layers[{i}].{n}"] = getattr(layer, n)
        for n, shape in want.items():
            if tuple(got[n].shape) != shape:
                raise ValueError(f"{source}: {n}: expected shape {shape}, got {tuple(got[n].shape)}")


def check_model_args(config, weights, sharded: bool = False) -> None:
    """TypeError unless config is a LlamaConfig and weights LlamaWeights; ValueError when a weight's shape
    disagrees with config (not for a rank's shard)."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config: expected a LlamaConfig, got {type(config).__name__}")
    if not isinstance(weights, LlamaWeights):
        raise TypeError(f"weights: expected LlamaWeights, got {type(weights).__name__}")
    if not sharded:
        weights.check(config, "weights")


def check_prefill(prompts, slots, max_batch: int, capacity: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, slots) as int64 arrays; ValueError unless there is one distinct slot in [0, max_batch) a
    prompt, at least one, every prompt holds 1..min(capacity, seq_len) tokens (both models' prefill)."""
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    if slots.size != lens.size or not lens.size or slots.min() < 0 or slots.max() >= max_batch or \
            np.unique(slots).size != slots.size:
        raise ValueError(f"slots: expected {lens.size} distinct slots (one a prompt, at least one) in "
                         f"[0, {max_batch}), got {slots.tolist()}")
    if (lens < 1).any():
        raise ValueError("prompts: every prompt needs at least one token")
    if (lens > capacity).any() or (lens > seq_len).any():
        raise ValueError(f"prompts: {int(lens.max())} tokens, more than the cache's {capacity} or the "
                         f"model's seq_len = {seq_len}")
    return lens, slots


class LlamaKVCache:
    """The KV cache of every layer: one `PagedKVCache` per layer, all allocating the same blocks in step.

    Sequence slots 0..max_batch-1 each hold up to max_tokens tokens."""

    def __init__(self, ops: ArrayOps, config: LlamaConfig, max_batch: int, max_tokens: int, block_size: int = 16,
                 n_kv_heads: int | None = None):
        # n_kv_heads: the KV heads held here, fewer than the config's on a tensor-parallel rank (vbw_cupy.dist.tp)
        per_seq = -(-max_tokens // block_size)
        n_kv_heads = n_kv_heads or config.n_kv_heads
        self.layers = [ops.new_kv_cache(max_batch * per_seq, block_size, n_kv_heads, config.head_dim,
                                        max_batch, per_seq) for _ in range(config.n_layers)]

    def lengths(self, slots) -> np.ndarray:
        """Tokens held by each slot of `slots` (host ints)."""
        return self.layers[0].lengths(slots)

    def free(self, slot: int) -> None:
        """Empty sequence slot `slot` in every layer (its blocks go back to the free lists)."""
        for cache in self.layers:
            cache.free(slot)


class Llama:
    """A Llama model on a backend: `prefill` packed prompts, then `decode` one token per sequence.

    Build one with `vbw_cupy.models.load_model(path, weights=..., device=...)`, or from a config and host
    weights with `Llama(config, weights, ops, weight_format)`: the linear weights are stored as
    `weight_format` ("fp32", "fp16", "nvfp4", "mxfp4"); norms, embedding and classifier stay float32.
    """

    _SHARDED = False  # (a tensor-parallel rank's class holds a shard: dist.tp checked the full weights)

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, ops: ArrayOps | None = None,
                 weight_format: str = "fp32"):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}")
        check_model_args(config, weights, self._SHARDED)
        self.config = config
        self.ops = ops = ops or numpy_ops()
        self.weight_format = weight_format
        dense = lambda a: ops.asarray(a, np.float32)
        emb = dense(weights.token_embedding)
        self.weights = LlamaWeights(
            token_embedding=emb,
            layers=[LayerWeights(**{n: ops.linear(getattr(lw, n), weight_format) if n in LayerWeights.LINEARS
                                    else dense(getattr(lw, n)) for n in LayerWeights.__dataclass_fields__})
                    for lw in weights.layers],
            rms_final=dense(weights.rms_final),
            classifier=emb if weights.classifier is weights.token_embedding else dense(weights.classifier))

    def new_cache(self, max_batch: int, max_tokens: int) -> LlamaKVCache:
        """An empty KV cache for `max_batch` sequences of up to `max_tokens` tokens each."""
        return LlamaKVCache(self.ops, self.config, max_batch, max_tokens)

    def prefill(self, prompts, cache: LlamaKVCache, slots, all_logits: bool = False):
        """Run the prompts (lists of token ids) at positions 0.., writing their K and V into cache slots `slots`
        (what they held before is dropped, as on the GPU). Returns float32 logits of each prompt's last token
        [B, vocab], or with all_logits=True of every token [sum of lengths, vocab] (packed in prompt order), as a
        backend array. Every argument is checked before any slot changes."""
        kv0 = cache.layers[0]
        lens, slots = check_prefill(prompts, slots, kv0.max_batch, kv0.block_table.shape[1] * kv0.block_size,
                                    self.config.seq_len)
        slots = slots.tolist()
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        positions = np.concatenate([np.arange(n) for n in lens])
        ops, max_len = self.ops, int(lens.max())

        def attend(layer, q, k, v):
            kv_cache = cache.layers[layer]
            for b, slot in enumerate(slots):
                kv_cache.append(k[None, cu[b]:cu[b + 1]], v[None, cu[b]:cu[b + 1]], seqs=[slot])
            return ops.attention_prefill(q, k, v, cu, max_len)

        x = ops.embedding(self.weights.token_embedding, ids)  # (checks the ids before a slot changes)
        for slot in slots:
            cache.free(slot)
        x = self._blocks(x, positions, attend)
        return self._logits(x if all_logits else x[ops.xp.asarray(cu[1:] - 1)])

    def decode(self, tokens, cache: LlamaKVCache, slots):
        """One token per sequence: `tokens[i]` is fed to cache slot `slots[i]` at the position after its cached
        tokens. Returns float32 logits [B, vocab] as a backend array."""
        positions = cache.lengths(slots)
        ops = self.ops

        def attend(layer, q, k, v):
            cache.layers[layer].append(k, v, seqs=slots)
            return ops.attention_decode(q, cache.layers[layer], slots)

        x = self._blocks(ops.embedding(self.weights.token_embedding, np.asarray(tokens, dtype=np.int64)),
                         positions, attend)
        return self._logits(x)

    def _blocks(self, x, positions, attend):
        """The transformer blocks over x [T, dim] float32; attend(layer, q, k, v) does the attention."""
        c, ops = self.config, self.ops
        T, hd, adt = x.shape[0], c.head_dim, ops.attn_dtype
        inv_freq = c.rope_inv_freq()   # (once a forward, not once a layer)
        for i, lw in enumerate(self.weights.layers):
            h = ops.rmsnorm(x, lw.rms_att, c.norm_eps)
            # heads from the weights' rows: all of them here, a rank's share in vbw_cupy.dist.tp
            q = ops.matmul(h, lw.wq).reshape(T, -1, hd)
            k = ops.matmul(h, lw.wk).reshape(T, -1, hd)
            v = ops.matmul(h, lw.wv).reshape(T, -1, hd)
            q, k = ops.rope(q, k, positions, c.rope_style, inv_freq)
            o = attend(i, q.astype(adt), k.astype(adt), v.astype(adt))
            x = x + self._reduce(ops.matmul(o.reshape(T, -1), lw.wo))
            h = ops.rmsnorm(x, lw.rms_ffn, c.norm_eps)
            x = x + self._reduce(ops.matmul(ops.silu_mul(ops.matmul(h, lw.w1), ops.matmul(h, lw.w3)), lw.w2))
        return x

    def _reduce(self, partial):
        """The output of a row-parallel linear (wo, w2) summed over the ranks that share it: nothing to do on
        one device; an all-reduce in vbw_cupy.dist.tp."""
        return partial

    def _logits(self, x):
        return self.ops.matmul(self.ops.rmsnorm(x, self.weights.rms_final, self.config.norm_eps),
                               self.weights.classifier)


def random_weights(config: LlamaConfig, seed: int = 0, xp=np, dtype=np.float32) -> LlamaWeights:
    """Random weights of a plausible scale (linear entries ~ N(0, 1 / in), norms ~ 1 + N(0, 0.1)) for tests and
    benchmarks, generated with `xp` (numpy or cupy) in `dtype`."""
    c = config
    rng = xp.random.default_rng(seed)
    normal = lambda shape: rng.standard_normal(shape, dtype=np.float32)

    def lin(out, inp):
        return (normal((out, inp)) * np.float32(inp ** -0.5)).astype(dtype)

    def norm():
        return (1.0 + 0.1 * normal((c.dim,))).astype(np.float32)

    layers = [LayerWeights(rms_att=norm(), wq=lin(c.dim, c.dim), wk=lin(c.kv_dim, c.dim), wv=lin(c.kv_dim, c.dim),
                           wo=lin(c.dim, c.dim), rms_ffn=norm(), w1=lin(c.hidden_dim, c.dim),
                           w2=lin(c.dim, c.hidden_dim), w3=lin(c.hidden_dim, c.dim)) for _ in range(c.n_layers)]
    emb = normal((c.vocab_size, c.dim)).astype(dtype)
    return LlamaWeights(emb, layers, norm(), emb if c.shared_classifier else lin(c.vocab_size, c.dim))
