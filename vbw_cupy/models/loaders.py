"""Checkpoint loaders (docs/models.md): llama2.c legacy `.bin` files and Hugging Face Llama folders.

Both return `(LlamaConfig, LlamaWeights)` with host arrays: the llama2.c file is memory-mapped once and its
tensors are views of the map; a Hugging Face folder is read through the `safetensors` NumPy API (the
`models` extra, imported only here). `load_model` picks the loader and builds a `Llama` on a backend.
"""
from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path

import numpy as np

from .llama import LayerWeights, Llama, LlamaConfig, LlamaWeights
from .ops import WEIGHT_FORMATS, numpy_ops

_HEADER = 7 * 4
_MAGIC = 0x616B3432  # "ak42": the versioned llama2.c export format


def require_extra(module: str):
    """Import `module` from the `models` extra, or ImportError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is needed for Hugging Face checkpoints and tokenizers: "
                          f"pip install 'vbw_cupy[models]'") from e


def _existing(path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    return path


def load_llama2c(path) -> tuple[LlamaConfig, LlamaWeights]:
    """A llama2.c legacy (version 0) checkpoint: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
    vocab_size, negative for a separate classifier, seq_len) then float32 tensors in run.c's order.

    The file is memory-mapped; every tensor is a view of the map (nothing is copied). ValueError naming the file
    with the expected and actual size in bytes when it is truncated or too long; versioned exports (magic
    "ak42") are refused by name."""
    path = _existing(path, "checkpoint")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    if len(head) >= 4 and int.from_bytes(head[:4], "little") == _MAGIC:
        version = int.from_bytes(head[4:8], "little") if len(head) >= 8 else "?"
        raise ValueError(f"{path}: a versioned llama2.c export (magic 'ak42', version {version}); only the legacy "
                         f"version 0 format is supported (export.py --version 0)")
    if len(head) < _HEADER:
        raise ValueError(f"{path}: truncated llama2.c checkpoint: expected at least {_HEADER} bytes for the header, "
                         f"got {size}")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = np.frombuffer(head, "<i4").tolist()
    try:
        config = LlamaConfig(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                             vocab_size=abs(vocab), seq_len=seq_len, shared_classifier=vocab > 0)
    except ValueError as e:   # not a model's header (a tokenizer.bin, another format)
        raise ValueError(f"{path}: not a llama2.c checkpoint, its header (dim, hidden_dim, n_layers, n_heads, "
                         f"n_kv_heads, vocab_size, seq_len = {dim}, {hidden}, {n_layers}, {n_heads}, {n_kv_heads}, "
                         f"{vocab}, {seq_len}) is not a model's: {e}") from None
    L, kv, V = n_layers, config.kv_dim, abs(vocab)
    shapes = [("token_embedding", (V, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)), ("wk", (L, kv, dim)),
              ("wv", (L, kv, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)), ("w1", (L, hidden, dim)),
              ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)), ("rms_final", (dim,)),
              ("freq_cis", (2, seq_len * config.head_dim // 2))]
    if not config.shared_classifier:
        shapes.append(("classifier", (V, dim)))
    counts = [int(np.prod(s)) for _, s in shapes]
    expected = _HEADER + 4 * sum(counts)
    if size != expected:
        raise ValueError(f"{path}: {'truncated' if size < expected else 'oversized'} llama2.c checkpoint: expected "
                         f"{expected} bytes for the shapes its header declares ({config}), got {size} bytes")
    flat = np.memmap(path, dtype="<f4", mode="r", offset=_HEADER, shape=(sum(counts),))
    t, offset = {}, 0
    for (name, shape), n in zip(shapes, counts):
        t[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    layers = [LayerWeights(**{n: t[n][i] for n in LayerWeights.__dataclass_fields__}) for i in range(L)]
    emb = t["token_embedding"]
    weights = LlamaWeights(emb, layers, t["rms_final"], t.get("classifier", emb))
    return config, weights


def save_llama2c(path, config: LlamaConfig, weights: LlamaWeights) -> Path:
    """Write `weights` as a llama2.c legacy checkpoint that `load_llama2c` (and run.c) read back: the inverse of
    the loader, float32, the classifier stored separately when it is not the embedding. With
    `llama.random_weights(config)` it makes a tiny model to try the command line on.

    >>> from vbw_cupy.models.llama import random_weights
    >>> cfg = LlamaConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, seq_len=64)
    >>> save_llama2c("tiny.bin", cfg, random_weights(cfg))      # doctest: +SKIP
    """
    path = Path(path)
    weights.check(config, str(path))
    shared = weights.classifier is weights.token_embedding
    if config.rope_style != "adjacent":
        raise ValueError(f"config: llama2.c files rotate adjacent pairs; rope_style {config.rope_style!r} cannot be "
                         "stored in one")
    if config.rope_theta != 10000.0 or config.rope_scaling:
        raise ValueError(f"config: llama2.c files (run.c) turn pairs by theta = 10000 unscaled; rope_theta "
                         f"{config.rope_theta} / rope_scaling {config.rope_scaling!r} cannot be stored in one")
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, dtype="<f4"))  # noqa: E731
    head = (config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
            config.vocab_size if shared else -config.vocab_size, config.seq_len)
    with open(path, "wb") as f:
        f.write(np.array(head, dtype="<i4").tobytes())
        f.write(f32(weights.token_embedding).tobytes())
        for name in ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3"):
            for layer in weights.layers:
                f.write(f32(getattr(layer, name)).tobytes())
        f.write(f32(weights.rms_final).tobytes())
        f.write(np.zeros(config.seq_len * config.head_dim, dtype="<f4").tobytes())  # run.c's unused RoPE tables
        if not shared:
            f.write(f32(weights.classifier).tobytes())
    return path


def _hf_config(folder: Path) -> LlamaConfig:
    path = _existing(folder / "config.json", "checkpoint")
    try:
        c = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(c).__name__}")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
              "num_key_value_heads", "max_position_embeddings", "head_dim"):
        v = c.get(k, 1)
        if v is None and k in ("num_key_value_heads", "head_dim"):
            continue   # (null: the default)
        if type(v) is not int or v < 1:
            raise ValueError(f"{path}: {k}: expected a positive int, got {v!r}")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (only 'silu', Llama's SwiGLU)")
    if c.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: model_type {c['model_type']!r} is not supported (only 'llama')")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError(f"{path}: linear biases (attention_bias / mlp_bias) are not supported")
    n_heads, width = c["num_attention_heads"], c["hidden_size"]
    if c.get("head_dim") is not None and c["head_dim"] * n_heads != width:
        raise ValueError(f"{path}: head_dim {c['head_dim']} * num_attention_heads {n_heads} != hidden_size {width} "
                         "is not supported")
    if width % n_heads:
        raise ValueError(f"{path}: hidden_size {width} is not a multiple of num_attention_heads {n_heads}")
    eos = c.get("eos_token_id", 2)
    try:
        return LlamaConfig(
            dim=width, hidden_dim=c["intermediate_size"], n_layers=c["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads, vocab_size=c["vocab_size"],
            seq_len=c.get("max_position_embeddings", 2048), norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 10000.0), rope_style="halves",
            rope_scaling=_rope_scaling(path, c.get("rope_scaling")),
            shared_classifier=bool(c.get("tie_word_embeddings", False)), bos_id=c.get("bos_token_id", 1),
            eos_ids=tuple(eos) if isinstance(eos, list) else (eos,))
    except ValueError as e:  # (a field's check, named as config.json's file)
        raise ValueError(f"{path}: {e}") from None


def _rope_scaling(path, rs) -> tuple:
    """config.json's rope_scaling as LlamaConfig.rope_scaling: none / "default" (), "linear", "llama3" (Llama
    3.1 / 3.2); the others (dynamic NTK, YaRN, ...) are refused by name."""
    if not rs:
        return ()
    kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
    try:
        if kind == "default":
            return ()
        if kind == "linear":
            return ("linear", float(rs["factor"]))
        if kind == "llama3":
            return ("llama3", float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                    float(rs["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: rope_scaling {rs!r}: {type(e).__name__} {e}") from None
    raise ValueError(f"{path}: rope_scaling {rs!r} is not supported (rope_type 'default', 'linear' or 'llama3')")


def load_hf(folder) -> tuple[LlamaConfig, LlamaWeights]:
    """A Hugging Face Llama folder: config.json and *.safetensors (float32, float16 or bfloat16 tensors, kept in
    their dtype). Its q/k projections are used as they are, with "halves" RoPE. KeyError naming a missing
    tensor; ValueError naming a tensor of the wrong shape."""
    folder = _existing(folder, "checkpoint")
    config = _hf_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # the shards it names (a stray file beside them is not read)
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty weight_map")
        files = [_existing(folder / f, "shard") for f in sorted(set(weight_map.values()))]
    else:
        weight_map, files = None, sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint: no *.safetensors file in {folder}")
    safetensors = require_extra("safetensors")
    with contextlib.ExitStack() as stack:
        shards = {}
        for f in files:
            try:
                shards[f.name] = stack.enter_context(safetensors.safe_open(str(f), framework="np"))
            except Exception as e:  # (safetensors' own error type: a truncated or corrupt file)
                raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        if weight_map is not None:
            where = {name: shards[f] for name, f in weight_map.items()}
        else:
            where = {}
            for f, shard in shards.items():
                for name in shard.keys():
                    if name in where:
                        raise ValueError(f"{folder}: tensor {name!r} is in two files ({f} and another); a "
                                         "model.safetensors.index.json says which shard to read")
                    where[name] = shard

        def get(name):
            if name not in where:
                raise KeyError(f"{folder}: tensor {name!r} not found in {', '.join(f.name for f in files)}")
            return where[name].get_tensor(name)

        return config, _hf_weights(config, get)


def _hf_weights(config: LlamaConfig, get) -> LlamaWeights:
    """The weights of a Hugging Face Llama, `get(name)` reading one tensor."""
    names = {"rms_att": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "rms_ffn": "post_attention_layernorm",
             "w1": "mlp.gate_proj", "w2": "mlp.down_proj", "w3": "mlp.up_proj"}
    layers = [LayerWeights(**{n: get(f"model.layers.{i}.{hf}.weight") for n, hf in names.items()})
              for i in range(config.n_layers)]
    emb = get("model.embed_tokens.weight")
    classifier = emb if config.shared_classifier else get("lm_head.weight")
    return LlamaWeights(emb, layers, get("model.norm.weight"), classifier)


def load_config(path) -> LlamaConfig:
    """The LlamaConfig of a checkpoint (a Hugging Face folder's config.json, a llama2.c file's header; its
    tensors are only memory-mapped, not read)."""
    path = _existing(path, "checkpoint")
    return _hf_config(path) if path.is_dir() else load_llama2c(path)[0]


def load_checkpoint(path) -> tuple[LlamaConfig, LlamaWeights]:
    """`load_hf` for a folder, `load_llama2c` for a file."""
    path = _existing(path, "checkpoint")
    config, weights = load_hf(path) if path.is_dir() else load_llama2c(path)
    weights.check(config, str(path))
    return config, weights


def load_model(path, weights: str | None = None, device: str = "cpu"):
    """A model from a llama2.c `.bin` file or a Hugging Face folder, its linear weights stored as `weights`
    (FP4 formats quantize each linear at load): on device "cpu" a `Llama` on the NumPy reference ("fp32",
    the default, "fp16", "nvfp4", "mxfp4"); on "gpu" a `LlamaGPU` ("fp16", the default, "nvfp4", "mxfp4").

    >>> model = load_model("stories15M.bin", weights="nvfp4", device="gpu")   # doctest: +SKIP
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device: expected 'cpu' or 'gpu', got {device!r}")
    if device == "gpu":
        from .gpu import GPU_WEIGHT_FORMATS as formats
    else:
        formats = WEIGHT_FORMATS
    if weights is not None and weights not in formats:
        raise ValueError(f"weights: expected one of {formats} on device {device!r}, got {weights!r}")
    if device == "gpu":
        from .gpu import LlamaGPU, require_gpu
        require_gpu()
        config, host = load_checkpoint(path)
        return LlamaGPU(config, host, weights or "fp16")
    config, host = load_checkpoint(path)
    return Llama(config, host, numpy_ops(), weights or "fp32")
