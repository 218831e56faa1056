"""Tensor-parallel Llama (Megatron-style): each rank holds a slice of every layer and one all-reduce joins the
slices after the attention output projection and after the FFN down projection.

Rank r of N holds query heads [r Hq/N, (r+1) Hq/N) and KV heads [r Hkv/N, (r+1) Hkv/N) (so its query heads
read only its KV heads, and its KV cache holds only those), and a slice of the FFN width:

- column-parallel (rows of the [out, in] weight): wq, wk, wv by heads, w1 and w3 by FFN units;
- row-parallel (columns): wo by heads, w2 by FFN units; their partial outputs are summed by `Comm.all_reduce`;
- replicated: the embedding, the norms, the classifier (every rank computes the same logits).

`TPLlama` is `models.Llama` on a shard (NumPy ranks, the CPU test bed) and `TPLlamaGPU` is `models.LlamaGPU` on
a shard (fused GEMMs, the decode step with its two all-reduces a layer captured in one CUDA graph per rank):
the same forward pass, whose head counts come from the weights' shapes, with `_reduce` an all-reduce.
`TPGroup` drives the N ranks from one host thread, so `models.generate_ids` runs a group as it runs one model.
"""
from __future__ import annotations

import atexit
import dataclasses
import weakref

import numpy as np

from .._checks import _is_int
from ..models.gpu import LlamaGPU
from ..models.llama import Llama, LlamaConfig, LlamaKVCache, LlamaWeights, check_model_args
from ..models.ops import ArrayOps, numpy_ops
from .comm import Comm, NcclComm, RankThreads, SimGroup


def _check_tp_size(size) -> None:
    if not _is_int(size) or size < 1:
        raise ValueError(f"tp: expected a positive int, got {size!r}")


def check_tp(config: LlamaConfig, size: int) -> None:
    """ValueError when `config` cannot be split over `size` ranks."""
    _check_tp_size(size)
    if config.n_kv_heads % size:
        raise ValueError(f"tp: expected a divisor of n_kv_heads = {config.n_kv_heads} (each rank holds whole KV "
                         f"heads and the query heads that read them), got {size}")
    if config.hidden_dim < size:
        raise ValueError(f"tp: expected at most hidden_dim = {config.hidden_dim} ranks, got {size}")


def _part(n: int, rank: int, size: int) -> slice:
    """Rank's share of n units, as even as can be (the first n % size ranks hold one more)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def shard_weights(config: LlamaConfig, weights: LlamaWeights, rank: int, size: int) -> LlamaWeights:
    """Rank `rank`'s slice of host weights `weights` (see the module docstring). Slices are views where NumPy
    allows (a memory-mapped checkpoint reads only its rows), so a rank converts only what it holds.

    >>> shard = shard_weights(cfg, weights, rank=1, size=2)      # doctest: +SKIP
    >>> shard.layers[0].wq.shape                                  # doctest: +SKIP
    (cfg.dim // 2, cfg.dim)
    """
    check_tp(config, size)
    check_model_args(config, weights)
    if not 0 <= rank < size:
        raise ValueError(f"rank: expected 0 <= rank < {size}, got {rank}")
    hd = config.head_dim
    q_rows = _part(config.n_heads, rank, size)
    kv_rows = _part(config.n_kv_heads, rank, size)
    q_rows, kv_rows = slice(q_rows.start * hd, q_rows.stop * hd), slice(kv_rows.start * hd, kv_rows.stop * hd)
    ffn = _part(config.hidden_dim, rank, size)
    layers = [dataclasses.replace(lw, wq=lw.wq[q_rows], wk=lw.wk[kv_rows], wv=lw.wv[kv_rows], wo=lw.wo[:, q_rows],
                                  w1=lw.w1[ffn], w3=lw.w3[ffn], w2=lw.w2[:, ffn]) for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers)


class TPLlama(Llama):
    """Rank `comm.rank` of a tensor-parallel Llama: `Llama` on its shard of the full host `weights`, with an
    all-reduce over `comm` after wo and after w2. prefill / decode give every rank the same logits; the KV
    cache of a rank holds its n_kv_heads / N heads.

    >>> group = SimGroup(2)                                                           # doctest: +SKIP
    >>> logits = group.run(lambda comm: TPLlama(cfg, w, comm).prefill(...))          # doctest: +SKIP
    """

    _SHARDED = True

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, comm: Comm, ops: ArrayOps | None = None,
                 weight_format: str = "fp32"):
        super().__init__(config, shard_weights(config, weights, comm.rank, comm.size), ops, weight_format)
        self.comm = comm

    def new_cache(self, max_batch: int, max_tokens: int) -> LlamaKVCache:
        kv = _part(self.config.n_kv_heads, self.comm.rank, self.comm.size)
        return LlamaKVCache(self.ops, self.config, max_batch, max_tokens, n_kv_heads=kv.stop - kv.start)

    def _reduce(self, partial):
        return self.comm.all_reduce(partial)


class TPLlamaGPU(LlamaGPU):
    """Rank `comm.rank` of a tensor-parallel `LlamaGPU`: its shard of the full host `weights` (q, k, v fused per
    rank: its wq rows, then its wk rows, then its wv rows; gate / up likewise), an all-reduce over `comm` (an
    `NcclComm`, on the current stream, so the decode graph captures it) after the O and down projections.
    Every rank computes the same logits; its KV cache holds n_kv_heads / N heads."""

    _SHARDED = True

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, comm: Comm, weight_format: str = "fp16", *,
                 act_dtype=np.float16):
        super().__init__(config, shard_weights(config, weights, comm.rank, comm.size), weight_format,
                         act_dtype=act_dtype)
        self.comm = comm

    def _reduce(self, partial):
        return self.comm.all_reduce(partial)

    def __del__(self):
        # the decode graphs hold NCCL work of this rank's communicator: destroyed first, while the communicator
        # (which this model keeps alive until now) still exists
        self._graphs = {}


class _GroupCache:
    """The KV caches of a group's ranks, one each, freed together."""

    def __init__(self, caches):
        self.ranks = caches

    def lengths(self, slots) -> np.ndarray:
        return self.ranks[0].lengths(slots)

    def free(self, slot: int) -> None:
        for cache in self.ranks:
            cache.free(slot)


class TPGroup:
    """The N ranks of a tensor-parallel model driven from one host thread: prefill / decode / new_cache run on
    every rank (one thread each, through `run(fn)`, which calls fn(comm) per rank) and return rank 0's result,
    so `models.generate_ids(group, ...)` generates with it. Build one with `simulated` (NumPy, SimComm) or
    `on_gpus` (CuPy, NCCL)."""

    def __init__(self, models, run, where: str = ""):
        self.models, self._run = models, run
        self.where = where or f"tp {len(models)}"   # for status lines
        self.config, self.ops, self.weight_format = models[0].config, models[0].ops, models[0].weight_format

    @property
    def size(self) -> int:
        return len(self.models)

    @classmethod
    def simulated(cls, config: LlamaConfig, weights: LlamaWeights, size: int, weight_format: str = "fp32"):
        """`size` ranks on NumPy in this process (`SimGroup`): the CPU test bed and demo."""
        check_tp(config, size)
        group = SimGroup(size)
        models = group.run(lambda comm: TPLlama(config, weights, comm, numpy_ops(), weight_format))
        return cls(models, group.run, f"cpu, tp {size} on simulated ranks (a {size}-GPU run needs {size} visible "
                                      "GPUs and NCCL: --device gpu)")

    @classmethod
    def on_gpus(cls, config: LlamaConfig, weights: LlamaWeights, size: int, weight_format: str = "fp16", *,
                act_dtype=np.float16):
        """`size` ranks on GPUs 0..size-1 of this host, one long-lived thread each (`RankThreads`), NCCL
        between them; each rank is a `TPLlamaGPU` (decode steps replayed from one CUDA graph per rank)."""
        check_tp(config, size)
        require_gpus(size)
        comms = NcclComm.init_all(range(size))
        # a rank that fails aborts every communicator (RankThreads' default for NCCL comms): its peers, waiting in
        # NCCL for it, get errors, not a hang
        run = RankThreads(comms)
        try:
            models = run(lambda comm: TPLlamaGPU(config, weights, comm, weight_format, act_dtype=act_dtype))
        except BaseException:
            run.close()
            raise
        group = cls(models, run, f"gpu, tp {size} over NCCL")
        _live_groups.add(group)
        return group

    def close(self) -> None:
        """End the ranks: every rank drops its captured graphs (they hold NCCL work) before its communicator is
        destroyed, then the rank threads stop. The group is unusable after. GPU groups still open at exit are
        closed then (atexit); a group dropped unclosed frees each rank's graphs before its communicator."""
        _live_groups.discard(self)
        run = self._run
        if not isinstance(run, RankThreads) or run.closed:   # simulated ranks hold nothing to end
            return
        for model in self.models:   # graphs first, from this thread (a broken group runs no jobs)
            model._graphs = {}
        try:
            if run.broken is None:
                run(lambda comm: comm.close())
        finally:   # (a communicator that fails to close still ends the rank threads)
            run.close()

    def host_weights(self) -> LlamaWeights:
        """The weights as the GPU ranks compute with them (FP4 shards dequantized), float32 on the host and put
        back together: the reference a TP model is checked against (`LlamaGPU.host_weights` of one GPU)."""
        parts = self._run(lambda comm: self.models[comm.rank].host_weights())
        cat = lambda name, axis, i: np.concatenate([getattr(p.layers[i], name) for p in parts], axis=axis)  # noqa: E731
        layers = [dataclasses.replace(parts[0].layers[i], wq=cat("wq", 0, i), wk=cat("wk", 0, i), wv=cat("wv", 0, i),
                                      wo=cat("wo", 1, i), w1=cat("w1", 0, i), w3=cat("w3", 0, i), w2=cat("w2", 1, i))
                  for i in range(len(parts[0].layers))]
        return dataclasses.replace(parts[0], layers=layers)

    def new_cache(self, max_batch: int, max_tokens: int) -> _GroupCache:
        return _GroupCache(self._run(lambda comm: self.models[comm.rank].new_cache(max_batch, max_tokens)))

    def prefill(self, prompts, cache: _GroupCache, slots, all_logits: bool = False):
        return self._run(lambda comm: self.models[comm.rank].prefill(prompts, cache.ranks[comm.rank], slots,
                                                                     all_logits))[0]

    def decode(self, tokens, cache: _GroupCache, slots, **kwargs):
        return self._run(lambda comm: self.models[comm.rank].decode(tokens, cache.ranks[comm.rank], slots,
                                                                    **kwargs))[0]

    def recycle(self, cache: _GroupCache) -> None:
        """Each rank's LlamaGPU.recycle of its cache (generate_ids calls this when done); nothing for ranks
        without one."""
        if hasattr(self.models[0], "recycle"):
            self._run(lambda comm: self.models[comm.rank].recycle(cache.ranks[comm.rank]))

    def __getattr__(self, name):
        # decode_sample and decode_steps where the ranks have them (LlamaGPU): generate_ids then samples on the
        # GPU. Every rank samples the same ids from the same logits (the all-reduces give every rank the same
        # bits); rank 0's come back.
        models = self.__dict__.get("models")
        if name in ("decode_sample", "decode_steps") and models and hasattr(models[0], name):
            def sample(tokens, cache, slots, *args, **kwargs):
                return self._run(lambda comm: getattr(self.models[comm.rank], name)(
                    tokens, cache.ranks[comm.rank], slots, *args, **kwargs))[0]
            return sample
        raise AttributeError(name)


_live_groups = weakref.WeakSet()   # GPU groups not closed yet: closed at exit, in order


@atexit.register
def _close_live_groups():
    for group in list(_live_groups):
        group.close()


def require_gpus(size: int) -> None:
    """RuntimeError saying what a `size`-GPU tensor-parallel run needs when this machine lacks it."""
    from .. import _runtime as rt
    if not rt.have_cupy():
        raise RuntimeError(f"--tp {size} on the GPU needs CuPy with NCCL (import failed: {rt._CUPY_IMPORT_ERROR}): "
                           f"install vbw_cupy[cuda12] or [cuda13] and nvidia-nccl-cu12 / -cu13, or run the same "
                           f"sharding on {size} simulated ranks with --device cpu.")
    try:
        have = rt.cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver reads as no GPU
        have = 0
    if have < size:
        raise RuntimeError(f"--tp {size} on the GPU needs {size} visible GPU{'s' if size > 1 else ''} (one rank "
                           f"each) and NCCL (cupy.cuda.nccl); {have} visible. Set CUDA_VISIBLE_DEVICES to {size} "
                           f"GPUs, or run the same sharding on {size} simulated ranks with --device cpu.")
    from .comm import _nccl
    _nccl()


def load_tp_model(path, size: int, weights: str | None = None, device: str = "cpu") -> TPGroup:
    """A checkpoint (as `models.load_model` reads it) split over `size` tensor-parallel ranks: simulated ranks on
    NumPy for device "cpu", GPUs 0..size-1 over NCCL for "gpu"."""
    from ..models.loaders import load_checkpoint, load_config
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
    _check_tp_size(size)
    if device == "gpu":
        require_gpus(size)
    config = load_config(path)   # (the split checked before the weights are read)
    check_tp(config, size)
    config, host = load_checkpoint(path)
    if device == "gpu":
        return TPGroup.on_gpus(config, host, size, weights or "fp16")
    return TPGroup.simulated(config, host, size, weights or "fp32")
