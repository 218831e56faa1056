"""vbw_cupy.models on NumPy: tiny checkpoints written here in both formats, checked against an independent
float64 forward pass that follows llama2.c's run.c step by step (one token at a time, a dense KV cache)."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from vbw_cupy import dequantize, quantize
from vbw_cupy.cli import main as cli_main
from vbw_cupy.models import (Llama2cTokenizer, Sampler, generate, generate_ids, load_checkpoint, load_model,
                             load_tokenizer, sampling_probs)

# ---------------------------------------------------------------------------------------------- checkpoints

RUN_C_ORDER = ("token_embedding", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final")


def random_weights(rng, dim, hidden, n_layers, n_heads, n_kv_heads, vocab, shared):
    """float32 weights in run.c's layout ([out, in] matrices, stacked over layers)."""
    kv = dim * n_kv_heads // n_heads
    shapes = {"token_embedding": (vocab, dim), "rms_att": (n_layers, dim), "wq": (n_layers, dim, dim),
              "wk": (n_layers, kv, dim), "wv": (n_layers, kv, dim), "wo": (n_layers, dim, dim),
              "rms_ffn": (n_layers, dim), "w1": (n_layers, hidden, dim), "w2": (n_layers, dim, hidden),
              "w3": (n_layers, hidden, dim), "rms_final": (dim,)}
    w = {}
    for name, shape in shapes.items():
        if name.startswith("rms"):
            w[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1]) * (3.0 if name == "token_embedding" else 1.0)
                       ).astype(np.float32)
    w["wcls"] = w["token_embedding"] if shared else (rng.standard_normal((vocab, dim)) * 0.3).astype(np.float32)
    w["sizes"] = dict(dim=dim, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      vocab=vocab)
    return w


def write_llama2c(path, w, seq_len, shared):
    s = w["sizes"]
    head = (s["dim"], s["hidden"], s["n_layers"], s["n_heads"], s["n_kv_heads"], s["vocab"] * (1 if shared else -1),
            seq_len)
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", *head))
        for name in RUN_C_ORDER:
            f.write(w[name].astype("<f4").tobytes())
        f.write(np.zeros(2 * seq_len * (s["dim"] // s["n_heads"]) // 2, "<f4").tobytes())  # freq_cis, unused
        if not shared:
            f.write(w["wcls"].astype("<f4").tobytes())
    return path


def to_halves(m, n_heads):
    """Reorder the rows of a q/k projection so that each head's pairs (2j, 2j+1) become (j, j + D/2): what
    Hugging Face's Llama conversion does to Meta's weights."""
    out, dim = m.shape
    return m.reshape(n_heads, out // n_heads // 2, 2, dim).transpose(0, 2, 1, 3).reshape(out, dim)


def write_hf(folder, w, seq_len, shared, rope_theta, dtype, **config):
    pytest.importorskip("safetensors")   # (the models extra: the tests that write a folder skip without it)
    from safetensors.numpy import save_file
    s = w["sizes"]
    folder.mkdir()
    cfg = {"model_type": "llama", "hidden_size": s["dim"], "intermediate_size": s["hidden"],
           "num_hidden_layers": s["n_layers"], "num_attention_heads": s["n_heads"],
           "num_key_value_heads": s["n_kv_heads"], "vocab_size": s["vocab"], "max_position_embeddings": seq_len,
           "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "tie_word_embeddings": shared, "bos_token_id": 1,
           "eos_token_id": 2, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": w["token_embedding"], "model.norm.weight": w["rms_final"]}
    if not shared:
        t["lm_head.weight"] = w["wcls"]
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = to_halves(w["wq"][i], s["n_heads"])
        t[p + "self_attn.k_proj.weight"] = to_halves(w["wk"][i], s["n_kv_heads"])
        for ours, theirs in (("wv", "self_attn.v_proj"), ("wo", "self_attn.o_proj"), ("w1", "mlp.gate_proj"),
                             ("w2", "mlp.down_proj"), ("w3", "mlp.up_proj"), ("rms_att", "input_layernorm"),
                             ("rms_ffn", "post_attention_layernorm")):
            t[p + theirs + ".weight"] = w[ours][i]
    half = len(t) // 2  # two shards, as large checkpoints come
    items = sorted(t.items())
    save_file({k: np.ascontiguousarray(v).astype(dtype) for k, v in items[:half]}, str(folder / "a.safetensors"))
    save_file({k: np.ascontiguousarray(v).astype(dtype) for k, v in items[half:]}, str(folder / "b.safetensors"))
    return folder


# ---------------------------------------------------------------------- the independent float64 forward pass

def run_c_forward(w, token, pos, key_cache, value_cache, theta=10000.0, scaled=None):
    """llama2.c's forward(transformer, token, pos) in float64: logits of one token; fills the caches at pos.
    `scaled(freq)`: the frequency a RoPE scaling puts in freq's place."""
    s = w["sizes"]
    dim, n_heads, n_kv = s["dim"], s["n_heads"], s["n_kv_heads"]
    head_size = dim // n_heads
    kv_dim = head_size * n_kv
    kv_mul = n_heads // n_kv
    f = lambda name: w[name].astype(np.float64)

    def rmsnorm(x, weight):
        return weight * (x / np.sqrt(np.mean(x * x) + 1e-5))

    x = f("token_embedding")[token].copy()
    for l in range(s["n_layers"]):
        xb = rmsnorm(x, f("rms_att")[l])
        q = f("wq")[l] @ xb
        k = f("wk")[l] @ xb
        v = f("wv")[l] @ xb
        for i in range(0, dim, 2):
            freq = 1.0 / theta ** ((i % head_size) / head_size)
            freq = scaled(freq) if scaled else freq
            fcr, fci = np.cos(pos * freq), np.sin(pos * freq)
            for vec in (q, k) if i < kv_dim else (q,):
                v0, v1 = vec[i], vec[i + 1]
                vec[i], vec[i + 1] = v0 * fcr - v1 * fci, v0 * fci + v1 * fcr
        key_cache[l, pos], value_cache[l, pos] = k, v
        att_out = np.zeros(dim)
        for h in range(n_heads):
            qh = q[h * head_size:(h + 1) * head_size]
            kvh = slice((h // kv_mul) * head_size, (h // kv_mul + 1) * head_size)
            scores = np.array([qh @ key_cache[l, t, kvh] for t in range(pos + 1)]) / np.sqrt(head_size)
            att = np.exp(scores - scores.max())
            att /= att.sum()
            att_out[h * head_size:(h + 1) * head_size] = sum(att[t] * value_cache[l, t, kvh] for t in range(pos + 1))
        x = x + f("wo")[l] @ att_out
        xb = rmsnorm(x, f("rms_ffn")[l])
        hb, hb2 = f("w1")[l] @ xb, f("w3")[l] @ xb
        x = x + f("w2")[l] @ (hb * (1.0 / (1.0 + np.exp(-hb))) * hb2)
    return f("wcls") @ rmsnorm(x, f("rms_final"))


def run_c_greedy(w, prompt, steps, seq_len, theta=10000.0, scaled=None):
    """run.c's generate loop, greedy: feed the prompt, then argmax, until BOS / EOS or `steps` new tokens or
    seq_len positions; returns (generated ids, logits of every fed position)."""
    s = w["sizes"]
    kv_dim = s["dim"] // s["n_heads"] * s["n_kv_heads"]
    kc, vc = np.zeros((2, s["n_layers"], seq_len, kv_dim))
    out, all_logits, token = [], [], prompt[0]
    for pos in range(seq_len):
        logits = run_c_forward(w, token, pos, kc, vc, theta, scaled)
        all_logits.append(logits)
        if pos + 1 < len(prompt):
            token = prompt[pos + 1]
            continue
        token = int(np.argmax(logits))
        if token in (1, 2):
            break
        out.append(token)
        if len(out) == steps:
            break
    return out, np.array(all_logits)


def random_prompts(rng, lengths, vocab):
    return [[1] + [int(t) for t in rng.integers(3, vocab, n - 1)] for n in lengths]


# -------------------------------------------------------------------------------------------------- model

SHAPES = {  # dim, hidden, layers, heads, kv heads, vocab
    "mha-shared": (32, 48, 2, 4, 4, 97, True),
    "gqa-separate": (48, 80, 2, 6, 2, 113, False),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_llama2c_greedy_matches_run_c(tmp_path, shape):
    *sizes, shared = SHAPES[shape]
    rng = np.random.default_rng(1)
    w = random_weights(rng, *sizes, shared)
    seq_len = 40
    model = load_model(write_llama2c(tmp_path / "m.bin", w, seq_len, shared))
    assert model.config.shared_classifier == shared
    prompts = random_prompts(rng, (1, 5, 11), sizes[-1])
    got = generate_ids(model, prompts, max_new_tokens=16)
    for p, seq in zip(prompts, got.sequences):
        want, _ = run_c_greedy(w, p, 16, seq_len)
        assert seq.ids == want
        assert seq.finish_reason == ("length" if len(want) == 16 else "stop")


def test_llama2c_memory_mapped(tmp_path):
    w = random_weights(np.random.default_rng(2), 32, 48, 2, 4, 2, 97, False)
    config, weights = load_checkpoint(write_llama2c(tmp_path / "m.bin", w, 16, False))
    for a in (weights.token_embedding, weights.layers[1].w2, weights.classifier):
        assert isinstance(a.base, np.memmap)
    np.testing.assert_array_equal(weights.layers[1].wk, w["wk"][1])
    np.testing.assert_array_equal(weights.classifier, w["wcls"])
    assert (config.n_kv_heads, config.shared_classifier) == (2, False)


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_halves_rope_matches_run_c(tmp_path, shape):
    pytest.importorskip("safetensors")
    *sizes, shared = SHAPES[shape]
    rng = np.random.default_rng(3)
    w = random_weights(rng, *sizes, shared)
    for name in RUN_C_ORDER + ("wcls",):  # the reference reads what bfloat16 storage keeps
        w[name] = w[name].astype(ml_dtypes.bfloat16).astype(np.float32)
    if shared:
        w["wcls"] = w["token_embedding"]
    seq_len, theta = 32, 500000.0
    model = load_model(write_hf(tmp_path / "hf", w, seq_len, shared, theta, ml_dtypes.bfloat16))
    assert model.config.rope_style == "halves" and model.config.rope_theta == theta
    prompts = random_prompts(rng, (3, 8), sizes[-1])
    got = generate_ids(model, prompts, max_new_tokens=12)
    for p, seq in zip(prompts, got.sequences):
        assert seq.ids == run_c_greedy(w, p, 12, seq_len, theta)[0]


def llama3_frequency(freq, factor, low, high, old_len):
    """Llama 3.1's RoPE scaling of one frequency, as Hugging Face's _compute_llama3_parameters describes it:
    wavelengths below old_len / high kept, above old_len / low divided by factor, smoothed in between."""
    wavelen = 2 * np.pi / freq
    if wavelen < old_len / high:
        return freq
    if wavelen > old_len / low:
        return freq / factor
    smooth = (old_len / wavelen - low) / (high - low)
    return (1 - smooth) * freq / factor + smooth * freq


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_hf_rope_scaling_matches_run_c(tmp_path, kind):
    pytest.importorskip("safetensors")
    rng = np.random.default_rng(9)
    w = random_weights(rng, 64, 48, 2, 4, 2, 101, False)   # head size 16: 8 frequencies
    seq_len, theta = 40, 10000.0
    # original length 32, high 4 / low 1: wavelength < 8 kept (pair 0), > 32 scaled (pairs 2-7), pair 1 smoothed
    rs = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32} if kind == "llama3" else {"type": "linear", "factor": 2.5})
    scaled = ((lambda f: llama3_frequency(f, 8.0, 1.0, 4.0, 32)) if kind == "llama3" else (lambda f: f / 2.5))
    model = load_model(write_hf(tmp_path / "hf", w, seq_len, False, theta, np.float32, rope_scaling=rs))
    assert model.config.rope_scaling[0] == kind
    prompt = random_prompts(rng, (38,), 101)[0]
    got = model.prefill([prompt], model.new_cache(1, seq_len), [0], all_logits=True)
    want = run_c_greedy(w, prompt, 0, len(prompt), theta, scaled)[1]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    unscaled = run_c_greedy(w, prompt, 0, len(prompt), theta)[1]
    assert np.abs(unscaled - want).max() > 1e-2   # (the scaling changes the logits: the comparison can fail)


def test_hf_config_rope_scaling_and_head_dim_errors(tmp_path):
    from vbw_cupy.models import load_config
    w = random_weights(np.random.default_rng(10), 32, 48, 1, 4, 2, 50, False)
    folder = write_hf(tmp_path / "a", w, 16, False, 10000.0, np.float32, rope_scaling={"rope_type": "default"})
    assert load_config(folder).rope_scaling == ()
    for i, (extra, match) in enumerate((
            ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling .*'dynamic'.* not supported"),
            ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling .*KeyError 'low_freq_factor'"),
            ({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}, "rope_scaling: expected"),
            ({"head_dim": 16}, "head_dim 16 \\* num_attention_heads 4 != hidden_size 32"),
            ({"num_attention_heads": 3}, "hidden_size 32 is not a multiple of num_attention_heads 3"))):
        folder = write_hf(tmp_path / f"b{i}", w, 16, False, 10000.0, np.float32, **extra)
        with pytest.raises(ValueError, match=match):
            load_config(folder)


def test_hf_shards_by_index_and_duplicates(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(11)
    w = random_weights(rng, 32, 48, 1, 4, 2, 50, False)
    folder = write_hf(tmp_path / "hf", w, 16, False, 10000.0, np.float32)
    want = load_model(folder).prefill([[1, 7, 9]], load_model(folder).new_cache(1, 16), [0])
    # a stray file beside the shards holding a tensor again, with other values
    emb = load_file(str(folder / "a.safetensors"))["model.embed_tokens.weight"]
    save_file({"model.embed_tokens.weight": emb + 1}, str(folder / "stray.safetensors"))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is in two files"):
        load_model(folder)
    names = {f: list(load_file(str(folder / f))) for f in ("a.safetensors", "b.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in names.items() for n in ns}}))
    model = load_model(folder)   # the index's shards only
    np.testing.assert_array_equal(model.prefill([[1, 7, 9]], model.new_cache(1, 16), [0]), want)


def test_hf_folder_errors_name_the_file(tmp_path):
    w = random_weights(np.random.default_rng(13), 32, 48, 1, 4, 2, 50, False)
    for i, (extra, match) in enumerate((
            ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
            ({"bos_token_id": None}, "config.json: bos_id: expected an int token id >= 0, got None"),
            ({"rms_norm_eps": -1e-5}, "config.json: norm_eps: expected a positive finite number"),
            ({"num_attention_heads": 0}, "num_attention_heads: expected a positive int, got 0"),   # (was / 0)
            ({"num_attention_heads": "4"}, "num_attention_heads: expected a positive int, got '4'")),):
        folder = write_hf(tmp_path / f"a{i}", w, 16, False, 10000.0, np.float32, **extra)
        with pytest.raises(ValueError, match=match):
            load_model(folder)
    folder = write_hf(tmp_path / "b", w, 16, False, 10000.0, np.float32)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="config.json: missing hidden_size"):
        load_model(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a JSON file"):
        load_model(folder)
    folder = write_hf(tmp_path / "c", w, 16, False, 10000.0, np.float32)
    data = (folder / "a.safetensors").read_bytes()
    (folder / "a.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="a.safetensors: not a readable safetensors file"):
        load_model(folder)


def test_llama2c_cannot_store_other_rope(tmp_path):
    from vbw_cupy.models import LlamaConfig, save_llama2c
    from vbw_cupy.models.llama import random_weights as model_weights
    for extra in ({"rope_theta": 500000.0}, {"rope_scaling": ("linear", 2.0)}):
        cfg = LlamaConfig(dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=8,
                          **extra)
        with pytest.raises(ValueError, match="llama2.c files .*theta = 10000"):
            save_llama2c(tmp_path / "never-written.bin", cfg, model_weights(cfg))


@pytest.mark.parametrize("fmt", ["fp16", "nvfp4", "mxfp4"])
def test_stored_weights_match_run_c_on_the_same_values(tmp_path, fmt):
    rng = np.random.default_rng(4)
    w = random_weights(rng, 32, 64, 2, 4, 2, 97, True)
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 32, True), weights=fmt)
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):  # what the model multiplies by
        w[name] = np.stack([m.astype(np.float16).astype(np.float32) if fmt == "fp16"
                            else dequantize(quantize(m, fmt)) for m in w[name]])
    prompts = random_prompts(rng, (4, 9), 97)
    got = generate_ids(model, prompts, max_new_tokens=10)
    for p, seq in zip(prompts, got.sequences):
        assert seq.ids == run_c_greedy(w, p, 10, 32)[0]


@pytest.mark.parametrize("fmt", ["fp32", "nvfp4"])
def test_prefill_then_decode_equals_full_recompute(tmp_path, fmt):
    rng = np.random.default_rng(5)
    w = random_weights(rng, 48, 80, 2, 6, 2, 113, False)
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 64, False), weights=fmt)
    prompts = random_prompts(rng, (7, 2, 13), 113)
    forced = [[int(t) for t in rng.integers(3, 113, 6)] for _ in prompts]   # teacher forcing
    slots = [0, 1, 2]
    cache = model.new_cache(3, 64)
    steps = [model.prefill(prompts, cache, slots)]
    for i in range(6):
        steps.append(model.decode([f[i] for f in forced], cache, slots))
    for b, (p, f) in enumerate(zip(prompts, forced)):
        full = model.prefill([p + f], model.new_cache(1, 64), [0], all_logits=True)
        incremental = np.stack([s[b] for s in steps])
        np.testing.assert_allclose(incremental, full[len(p) - 1:], rtol=1e-4, atol=1e-4)
        if fmt == "fp32":  # and both are run.c's logits
            np.testing.assert_allclose(full, run_c_greedy(w, p + f, 0, len(p + f))[1], rtol=1e-4, atol=1e-4)


def test_prefill_checks_before_writing_and_overwrites_a_used_slot(tmp_path):
    rng = np.random.default_rng(8)
    w = random_weights(rng, 32, 48, 2, 4, 2, 97, False)
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 64, False))
    cache = model.new_cache(2, 16)
    short, long_ = random_prompts(rng, (3, 20), 97)
    for bad, match in (([[short, long_], cache, [0, 1]], "prompts: 20 tokens, more than the cache's 16"),
                       ([[short, short], cache, [0, 0]], "slots: expected 2 distinct slots"),
                       ([[short], cache, [2]], r"slots: .* in \[0, 2\), got \[2\]"),
                       ([[short, [1, 97]], cache, [0, 1]], "token ids: expected values in \\[0, 97\\)")):
        with pytest.raises(ValueError, match=match):
            model.prefill(*bad)
        assert [layer.lengths().tolist() for layer in cache.layers] == [[0, 0], [0, 0]]   # nothing written
    # a slot that held a sequence starts again at position 0, as on the GPU (it used to append)
    model.prefill([long_[:9]], cache, [0])
    model.decode([5], cache, [0])
    again = model.prefill([short], cache, [0])
    assert cache.lengths([0]).tolist() == [3]
    fresh_cache = model.new_cache(2, 16)
    np.testing.assert_array_equal(again, model.prefill([short], fresh_cache, [0]))
    np.testing.assert_array_equal(model.decode([7], cache, [0]), model.decode([7], fresh_cache, [0]))


def test_generation_is_limited_by_seq_len(tmp_path):
    rng = np.random.default_rng(6)
    w = random_weights(rng, 32, 48, 1, 4, 4, 97, True)
    w["token_embedding"][:3] = 0.0   # BOS / EOS never win the argmax: generation runs to its limits
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 12, True))
    out = generate_ids(model, random_prompts(rng, (12, 10), 97), max_new_tokens=100)
    assert [len(s.ids) for s in out.sequences] == [1, 3]     # run.c: the last sampled token is never fed
    assert all(s.finish_reason == "length" for s in out.sequences)


# ---------------------------------------------------------------------------------------------- tokenizer

def write_tokenizer_bin(path, extra):
    """<unk>, <s>, </s>, the 256 byte pieces, then `extra` pieces: (bytes, score), written here as run.c reads
    them (independent of Llama2cTokenizer.save, which test_tokenizer_save_round_trip checks against this)."""
    pieces = [(b"<unk>", 0.0), (b"\n<s>\n", 0.0), (b"\n</s>\n", 0.0)]
    pieces += [(b"<0x%02X>" % i, 0.0) for i in range(256)] + extra
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for p, _ in pieces)))
        for p, score in pieces:
            f.write(struct.pack("<fi", score, len(p)) + p)
    return path


def test_readme_tiny_model_runs(tmp_path, capsys, monkeypatch):
    """README's "Run a model" snippet, as written there: the tiny model and byte-level tokenizer it writes run
    through `vbw-cupy generate --device cpu --print-ids` (the prompt's ids first, BOS and the dummy prefix)."""
    import pathlib
    import re
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"### Run a model.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    ids = cli_ids(capsys, ["generate", "tiny.bin", "--prompt", "hi", "--device", "cpu", "--print-ids",
                           "--max-new-tokens", "5"])
    assert ids[:4] == [1, ord(" ") + 3, ord("h") + 3, ord("i") + 3] and len(ids) <= 9


def test_tokenizer_save_round_trip(tmp_path, tok_bin):
    """Llama2cTokenizer.byte_level(extra).save writes the bytes of run.c's layout (this file's writer), and
    from_file reads back the same pieces and scores."""
    saved = Llama2cTokenizer.byte_level(EXTRA).save(tmp_path / "saved.bin")
    assert saved.read_bytes() == tok_bin.read_bytes()
    back = Llama2cTokenizer.from_file(saved)
    assert back.pieces == Llama2cTokenizer.from_file(tok_bin).pieces and back.vocab_size == TOK_VOCAB
    assert back.encode("abc hi") == load_tokenizer(tok_bin).encode("abc hi")


EXTRA = [(b" ", -1.0), (b"a", -1.0), (b"b", -1.0), (b"c", -1.0), (b"ab", -2.0), (b"bc", -5.0), (b"abc", -3.0),
         (b" a", -9.0), ("é".encode(), -1.0), (b"h", -1.0), (b"i", -1.0), (b"hi", -0.5)]
TOK_VOCAB = 259 + len(EXTRA)


@pytest.fixture
def tok_bin(tmp_path):
    return write_tokenizer_bin(tmp_path / "tokenizer.bin", EXTRA)


def test_tokenizer_merges_by_best_score(tok_bin):
    tok = load_tokenizer(tok_bin)
    piece = {p: i for i, p in enumerate(tok.pieces)}
    # " abc": "ab" (-2) beats "bc" (-5) and " a" (-9); then "abc" (-3) is the only merge left
    assert tok.encode("abc") == [1, piece[b" "], piece[b"abc"]]
    assert tok.encode("abc", bos=False, eos=True) == [piece[b" "], piece[b"abc"], 2]
    assert tok.encode("") == [1]
    assert tok.decode(tok.encode("abc")) == "abc"                       # the space after BOS is dropped
    assert tok.decode([piece[b"hi"], piece[b" "], piece[b"abc"]]) == "hi abc"


def test_byte_level_extra_pieces_as_bytes_or_pairs():
    tok = Llama2cTokenizer.byte_level([b"a", (b"b", 1.0), b"ab"])   # (bare bytes raised "too many values")
    assert tok.pieces[259:] == [b"a", b"b", b"ab"] and list(tok.scores[259:]) == [0.0, 1.0, 0.0]
    assert tok.encode("ab", bos=False)[-1] == 261
    with pytest.raises(TypeError, match="extra\\[0\\]: expected bytes or a \\(bytes, score\\) pair"):
        Llama2cTokenizer.byte_level(["a"])


def test_tokenizer_refuses_ids_past_its_pieces():
    tok = Llama2cTokenizer.byte_level()
    assert tok.decode([1, 3 + ord("h")]) == "h"
    with pytest.raises(ValueError, match="token 300: outside this tokenizer's 259 pieces"):
        tok.decode([1, 300])


@pytest.mark.parametrize("text", ["hi abc", "é and 日本 \U0001F600!", "a\nb\tc", "ça"])
def test_tokenizer_round_trip_with_byte_fallback(tok_bin, text):
    tok = load_tokenizer(tok_bin)
    ids = tok.encode(text)
    for ch in set(text) - {"a", "b", "c", "h", "i", " ", "é"}:   # not pieces: their UTF-8 bytes, id = byte + 3
        fallback = [b + 3 for b in ch.encode()]
        assert any(ids[i:i + len(fallback)] == fallback for i in range(len(ids)))
    assert tok.decode(ids) == text
    stream = tok.stream()
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)                     # no half characters on the way


def test_tokenizer_bin_truncated(tmp_path, tok_bin):
    cut = tmp_path / "cut.bin"
    cut.write_bytes(tok_bin.read_bytes()[:-3])
    with pytest.raises(ValueError, match="cut.bin: truncated tokenizer"):
        Llama2cTokenizer.from_file(cut)
    # a whole file of another size than the model's vocabulary: a tokenizer of another model, both ways
    with pytest.raises(ValueError, match=f"{TOK_VOCAB} tokens, the model's vocab_size is {TOK_VOCAB + 1}: a "
                                         "tokenizer of another model"):
        Llama2cTokenizer.from_file(tok_bin, vocab_size=TOK_VOCAB + 1)
    with pytest.raises(ValueError, match=f"more than the model's vocab_size = {TOK_VOCAB - 9} tokens"):
        Llama2cTokenizer.from_file(tok_bin, vocab_size=TOK_VOCAB - 9)
    assert Llama2cTokenizer.from_file(tok_bin, vocab_size=TOK_VOCAB).vocab_size == TOK_VOCAB


def write_hf_tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": i + 3 for i in range(256)}}
    for piece in ("h", "i", "hi", " ", "é"):
        vocab[piece] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("h", "i")], unk_token="<unk>", byte_fallback=True))
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("text", ["hi hi", "é日\U0001F600 hi"])
def test_hf_tokenizer_round_trip(tmp_path, text):
    tok = load_tokenizer(write_hf_tokenizer(tmp_path / "tokenizer.json"))
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids[1:]) == text
    stream = tok.stream(ids[0])
    pieces = [stream.push(t) for t in ids[1:]] + [stream.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


# ----------------------------------------------------------------------------------------------- sampling

def test_sampling_is_deterministic_for_a_seed():
    logits = np.random.default_rng(7).standard_normal(50)

    def draw(seed):
        sampler = Sampler(0.9, top_k=20, top_p=0.95, seed=seed)
        return [sampler(logits) for _ in range(30)]

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)
    assert Sampler(0.0)(logits) == int(np.argmax(logits))


def test_top_k_and_top_p_restrict_the_support():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    order = [1, 3, 4, 2, 0]                                          # most likely first
    assert set(np.flatnonzero(sampling_probs(logits, 1.0, top_k=2))) == set(order[:2])
    assert set(np.flatnonzero(sampling_probs(logits, 1.0, top_p=0.65))) == set(order[:2])   # 0.4 + 0.3 >= 0.65
    assert set(np.flatnonzero(sampling_probs(logits, 1.0, top_p=0.7001))) == set(order[:3])
    assert set(np.flatnonzero(sampling_probs(logits, 1.0, top_k=4, top_p=0.99))) == set(order[:4])
    np.testing.assert_allclose(sampling_probs(logits, 1.0), np.exp(logits))
    sampler = Sampler(1.0, top_k=3, seed=0)
    assert {sampler(logits) for _ in range(300)} == set(order[:3])


def test_top_p_after_top_k_and_tiny_temperatures():
    # top_p applies to the top_k tokens renormalized (Hugging Face's and vLLM's order): 10 equal tokens, half
    assert np.count_nonzero(sampling_probs(np.zeros(100), 1.0, top_k=10, top_p=0.5)) == 5
    assert set(np.flatnonzero(sampling_probs(np.log([.3, .3, .2, .2]), 1.0, top_k=2, top_p=0.5))) == {0}
    # logits / 1e-310 overflowed to NaN probabilities, and the draw always gave token 0
    assert Sampler(temperature=1e-310, seed=0)(np.array([1.0, 3.0, 2.0])) == 1
    np.testing.assert_array_equal(sampling_probs(np.array([1.0, 3.0, 2.0]), 1e-310), [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(sampling_probs(np.array([1.0, 3.0, 3.0]), 0.0), [0.0, 1.0, 0.0])   # (was NaN)
    with pytest.raises(ValueError, match="temperature: expected a value >= 0"):
        sampling_probs(np.array([1.0, 3.0]), -1.0)


def test_sampler_and_generate_argument_errors():
    for kw, match in (({"temperature": "hot"}, "temperature: expected a finite number"),
                      ({"temperature": float("inf")}, "temperature: expected a finite number"),
                      ({"top_k": 1.5}, "top_k: expected an int"), ({"top_k": True}, "top_k: expected an int"),
                      ({"top_p": "0.5"}, "top_p: expected a number"), ({"seed": -1}, "seed: expected None or an int")):
        with pytest.raises(ValueError, match=match):
            Sampler(**kw)
    model = OneTokenModel()
    with pytest.raises(TypeError, match="prompts: expected a list of lists"):
        generate_ids(model, "123", max_new_tokens=2)
    with pytest.raises(TypeError, match="prompt 1: expected a list of int token ids"):
        generate_ids(model, [[1, 2], [1, 2.7]], max_new_tokens=2)
    with pytest.raises(TypeError, match="stop_ids: expected None or a collection"):
        generate_ids(model, [[1, 2]], max_new_tokens=2, stop_ids=5)
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 0, got 2.5"):
        generate_ids(model, [[1, 2]], max_new_tokens=2.5)
    # iterables are taken as lists before they are checked (the checks used an iterator up)
    got = generate_ids(model, (iter([1, 2]),), max_new_tokens=3, stop_ids=(t for t in [5]))
    assert got.sequences[0].prompt_ids == [1, 2] and got.sequences[0].finish_reason == "stop"


class OneTokenModel:
    """A stand-in model with decode_steps (as a GPU model has) whose every next token is 5: records the seeds."""

    def __init__(self):
        from vbw_cupy.models import LlamaConfig
        from vbw_cupy.models.llama import numpy_ops
        self.config = LlamaConfig(dim=8, hidden_dim=8, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=9,
                                  seq_len=32)
        self.ops, self.seeds = numpy_ops(), []

    def new_cache(self, B, T):
        return type("Cache", (), {"free": lambda self, b: None})()

    def prefill(self, prompts, cache, slots):
        return np.tile(1e3 * np.eye(9)[5], (len(prompts), 1))   # (5 whatever the host sampler draws)

    def decode_steps(self, last, cache, slots, n, temperature, seed):
        self.seeds.append(seed)
        return np.full((n, len(slots)), 5)


def test_unseeded_device_sampling_on_a_multiprocess_rank_keeps_seed_0():
    # a rank of a tensor-parallel group in its own process (a model with a communicator) must sample the ids
    # the other ranks sample: an unseeded sampler there keeps seed 0 instead of a fresh one per process
    model = OneTokenModel()
    model.comm = object()
    generate_ids(model, [[1, 2]], max_new_tokens=4, sampler=Sampler(0.8))
    assert set(model.seeds) == {0}


def test_unseeded_device_sampling_draws_a_new_seed():
    # a GPU model samples plain temperature draws on the device: seed=None used to mean seed 0 there (every run
    # the same tokens, unlike the host sampler); a given seed is passed as it is
    seeds = []
    for seed in (None, None, 7, 7):
        model = OneTokenModel()
        generate_ids(model, [[1, 2]], max_new_tokens=4, sampler=Sampler(0.8, seed=seed))
        assert model.seeds and len(set(model.seeds)) == 1
        seeds.append(model.seeds[0])
    assert seeds[0] != seeds[1] and seeds[2:] == [7, 7]


# ------------------------------------------------------------------------------------------------- errors

def test_truncated_and_oversized_checkpoints_name_sizes(tmp_path):
    w = random_weights(np.random.default_rng(8), 32, 48, 1, 4, 4, 97, True)
    good = write_llama2c(tmp_path / "m.bin", w, 16, True).read_bytes()
    for name, data in (("short.bin", good[:-10]), ("long.bin", good + b"\0" * 8)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError) as e:
            load_model(tmp_path / name)
        msg = str(e.value)
        assert name in msg and f"expected {len(good)} bytes" in msg and f"got {len(data)} bytes" in msg
    (tmp_path / "v2.bin").write_bytes(struct.pack("<2i", 0x616B3432, 2) + good[8:])
    with pytest.raises(ValueError, match="versioned llama2.c export.*version 2"):
        load_model(tmp_path / "v2.bin")


def test_hf_missing_tensor_and_shape_mismatch(tmp_path):
    pytest.importorskip("safetensors")
    w = random_weights(np.random.default_rng(9), 32, 48, 1, 4, 2, 97, False)
    folder = write_hf(tmp_path / "hf", w, 16, False, 10000.0, np.float32)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(KeyError, match="model.layers.1.input_layernorm.weight"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match=r"layers\[0\].wk: expected shape \(32, 32\), got \(16, 32\)"):
        load_model(folder)


def test_prompt_longer_than_seq_len(tmp_path, tok_bin):
    w = random_weights(np.random.default_rng(10), 32, 48, 1, 4, 4, TOK_VOCAB, True)
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 8, True))
    tok = load_tokenizer(tok_bin)
    n = len(tok.encode("日本 hi"))
    assert n > 8
    with pytest.raises(ValueError, match=f"prompt 0: {n} tokens, longer than the model's seq_len = 8"):
        generate(model, tok, "日本 hi")


def test_prompt_token_ids_outside_the_vocabulary(tmp_path, tok_bin):
    """A token id outside [0, vocab) is a ValueError naming the prompt and the position (NumPy indexing would
    have read a negative id as a row from the end), in generate_ids and in the model's own prefill; an empty
    batch of prompts is refused by name too."""
    w = random_weights(np.random.default_rng(11), 32, 48, 1, 4, 4, TOK_VOCAB, True)
    model = load_model(write_llama2c(tmp_path / "m.bin", w, 8, True))
    for bad in (-3, TOK_VOCAB, 10**9):
        with pytest.raises(ValueError, match=rf"prompt 1: token 2 is {bad}, outside the vocabulary \[0, {TOK_VOCAB}\)"):
            generate_ids(model, [[1, 5], [1, 5, bad]], max_new_tokens=2)
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match=rf"token ids: expected values in \[0, {TOK_VOCAB}\), got -1 at position 1"):
        model.prefill([[1, -1]], cache, [0])
    with pytest.raises(ValueError, match="prompts: expected at least one prompt"):
        generate_ids(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts: expected a string or a non-empty list"):
        generate(model, load_tokenizer(tok_bin), [], max_new_tokens=2)


def test_model_checks_weights_against_the_config(tmp_path):
    from vbw_cupy.models import Llama, LlamaConfig
    from vbw_cupy.models.llama import random_weights as model_weights
    sizes = dict(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=8)
    cfg = LlamaConfig(vocab_size=40, **sizes)
    with pytest.raises(ValueError, match=r"weights: token_embedding: expected shape \(40, 32\), got \(50, 32\)"):
        Llama(cfg, model_weights(LlamaConfig(vocab_size=50, **sizes)))
    with pytest.raises(ValueError, match="weights: expected 2 layers, got 3"):
        Llama(cfg, model_weights(LlamaConfig(vocab_size=40, **dict(sizes, n_layers=3))))
    with pytest.raises(TypeError, match="weights: expected LlamaWeights, got NoneType"):
        Llama(cfg, None)
    with pytest.raises(TypeError, match="config: expected a LlamaConfig, got dict"):
        Llama(sizes, model_weights(cfg))
    with pytest.raises(ValueError, match="weight_format: expected one of"):
        Llama(cfg, model_weights(cfg), weight_format="int4")
    w = random_weights(np.random.default_rng(1), 32, 48, 1, 4, 2, 50, True)
    path = write_llama2c(tmp_path / "m.bin", w, 8, True)
    with pytest.raises(ValueError, match=r"weights: expected one of .* on device 'cpu', got 'int4'"):
        load_model(path, weights="int4")


def test_config_refuses_head_dims_past_256():
    from vbw_cupy.models import LlamaConfig
    with pytest.raises(ValueError, match=r"n_heads: expected head size dim / n_heads <= 256.*1024 / 2 = 512"):
        LlamaConfig(dim=1024, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=50, seq_len=8)
    assert LlamaConfig(dim=512, hidden_dim=64, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=50,
                       seq_len=8).head_dim == 256


# ----------------------------------------------------------------------------------------------------- CLI

def cli_ids(capsys, argv):
    assert cli_main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ids: ")]
    assert len(lines) == 1
    return [int(t) for t in lines[0][5:].split()]


@pytest.mark.parametrize("fmt", ["bin", "hf"])
def test_cli_generate_print_ids(tmp_path, capsys, tok_bin, fmt):
    rng = np.random.default_rng(11)
    w = random_weights(rng, 32, 48, 2, 4, 2, TOK_VOCAB, fmt == "bin")
    if fmt == "bin":
        ckpt, tok = write_llama2c(tmp_path / "m.bin", w, 24, True), tok_bin
    else:
        pytest.importorskip("safetensors")
        ckpt = write_hf(tmp_path / "hf", w, 24, False, 10000.0, np.float32)
        tok = write_hf_tokenizer(ckpt / "tokenizer.json")
    prompt = "hi é日"
    ids = cli_ids(capsys, ["generate", str(ckpt), "--tokenizer", str(tok), "--prompt", prompt, "--device", "cpu",
                           "--print-ids", "--max-new-tokens", "9"])
    prompt_ids = load_tokenizer(tok).encode(prompt)
    assert ids[:len(prompt_ids)] == prompt_ids
    assert ids[len(prompt_ids):] == run_c_greedy(w, prompt_ids, 9, 24)[0]
    # seeded sampling is reproducible through the command line too
    argv = ["generate", str(ckpt), "--tokenizer", str(tok), "--prompt", prompt, "--device", "cpu", "--print-ids",
            "--temperature", "1.0", "--top-p", "0.9", "--top-k", "40", "--seed", "5", "--weights", "mxfp4"]
    assert cli_ids(capsys, argv) == cli_ids(capsys, argv)


def test_cli_generate_with_no_eos_id(tmp_path, capsys):
    # a config.json whose eos_token_id is an empty list: only BOS stops generation (the CLI read eos_ids[0])
    pytest.importorskip("tokenizers")
    w = random_weights(np.random.default_rng(14), 32, 48, 1, 4, 2, TOK_VOCAB, False)
    ckpt = write_hf(tmp_path / "hf", w, 24, False, 10000.0, np.float32, eos_token_id=[])
    tok = write_hf_tokenizer(ckpt / "tokenizer.json")
    assert load_model(ckpt).config.eos_ids == ()
    ids = cli_ids(capsys, ["generate", str(ckpt), "--tokenizer", str(tok), "--prompt", "hi", "--device", "cpu",
                           "--print-ids", "--max-new-tokens", "3"])
    assert len(ids) >= 2


def test_cli_errors(tmp_path, capsys, tok_bin):
    w = random_weights(np.random.default_rng(12), 32, 48, 1, 4, 4, TOK_VOCAB, True)
    (tmp_path / "ckpt").mkdir()
    ckpt = write_llama2c(tmp_path / "ckpt" / "m.bin", w, 8, True)
    base = ["generate", str(ckpt), "--device", "cpu"]
    assert cli_main(base + ["--prompt", "hi"]) == 2                        # no tokenizer.bin beside the file
    assert f"tokenizer: {tmp_path / 'ckpt' / 'tokenizer.bin'} does not exist" in capsys.readouterr().err
    assert cli_main(base + ["--tokenizer", str(tok_bin), "--prompt", "日本 hi"]) == 2
    got = capsys.readouterr()
    assert "longer than the model's seq_len = 8" in got.err and got.out == ""   # the prompt is not echoed first
    assert cli_main(["generate", str(tmp_path / "none.bin"), "--device", "cpu"]) == 2
    assert "none.bin does not exist" in capsys.readouterr().err
    assert cli_main(["generate", str(tok_bin), "--device", "cpu"]) == 2   # a tokenizer given as the checkpoint
    assert f"{tok_bin}: not a llama2.c checkpoint" in capsys.readouterr().err
    for flags, match in ((["--max-new-tokens", "-1"], "--max-new-tokens: expected a value >= 0"),
                         (["--temperature", "-1"], "temperature: expected a finite number >= 0"),
                         (["--top-p", "2"], "top_p: expected a number in (0, 1]")):   # (the prompt was echoed first)
        assert cli_main(base + ["--tokenizer", str(tok_bin), "--prompt", "hi"] + flags) == 2
        got = capsys.readouterr()
        assert match in got.err and got.out == "", (flags, got)


def test_cli_says_why_generation_stopped(tmp_path, capsys, tok_bin, monkeypatch):
    """A generation that ends at a stop id says so on stderr (a random model often samples EOS at once, which would
    otherwise print nothing and no reason)."""
    import vbw_cupy.models as models
    from vbw_cupy.models.generate import Generation, Sequence
    w = random_weights(np.random.default_rng(12), 32, 48, 1, 4, 4, TOK_VOCAB, True)
    ckpt = write_llama2c(tmp_path / "m.bin", w, 16, True)
    monkeypatch.setattr(models, "generate_ids", lambda model, prompts, **kw: Generation(
        [Sequence(prompts[0], [], finish_reason="stop")], prefill_tokens=len(prompts[0])))
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok_bin), "--device", "cpu", "--prompt", "hi"]) == 0
    assert "stopped after 0 new tokens: the model sampled a stop id (BOS / EOS: [1, 2])" in capsys.readouterr().err


def test_gpu_model_host_checks_and_step_state_cache_identity(monkeypatch):
    """LlamaGPU's host-side checks run before any device work, and a decode state never outlives its cache
    storage's identity (new arrays reusing a dead storage's id() get fresh graphs; a cache that took a storage
    over gets its graphs). CPU only: no kernel is launched."""
    import types
    from vbw_cupy.models import LlamaConfig, gpu
    cfg = LlamaConfig(dim=64, hidden_dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=8)
    model = object.__new__(gpu.LlamaGPU)
    model.config, model._graphs, model._memo = cfg, {}, None

    class State:
        def __init__(self, B, vocab, inv_temp):
            self.B, self.seed = B, 0
            self.cache = lambda: None
            self.seed_buf = np.zeros(1, np.uint64)   # (the seed the graphs read: written when a call's differs)

    monkeypatch.setattr(gpu, "_StepState", State)

    class Storage:   # the device arrays' holder, which decode states key on
        pass

    class Cache:   # what _step / prefill read on the host
        def __init__(self, B, lens, capacity=64):
            self._lens, self.capacity, self.max_batch = np.array(lens, dtype=np.int64), capacity, B
            self.storage = Storage()

    c = Cache(2, [3, 8])
    with pytest.raises(ValueError, match="at least one slot"):
        model._step([], c, [], False, None, 0, 1)
    with pytest.raises(ValueError, match="one token per slot"):
        model._step([1, 2], c, [0], False, None, 0, 1)
    with pytest.raises(ValueError, match="seq_len"):   # slot 1 holds 8 = seq_len tokens: no RoPE row left
        model._step([1], c, [1], False, None, 0, 1)
    with pytest.raises(ValueError, match="distinct slots"):
        model.prefill([[1, 2], [3]], Cache(2, [0, 0]), [0, 0])
    with pytest.raises(ValueError, match="distinct slots"):
        model.prefill([[1, 2], [3]], Cache(2, [0, 0]), [0, 2])
    with pytest.raises(ValueError, match="distinct slots"):
        model.prefill([[1, 2]], Cache(2, [0, 0]), [0, 1])

    a = Cache(2, [1, 1])
    st = model._state(a, None, 0)
    assert model._state(a, None, 0) is st and st.cache() is a.storage
    # another seed: the same state (and graphs), the seed written to the word they read
    assert model._state(a, None, 5) is st and st.seed == 5 and st.seed_buf.tolist() == [5]
    stale = types.SimpleNamespace(cache=lambda: None)   # the state of a storage that died, under a reused id
    b = Cache(2, [1, 1])
    model._graphs = {gpu._state_key(b, None): stale}
    st_b = model._state(b, None, 0)
    assert st_b is not stale and st_b.cache() is b.storage and list(model._graphs.values()) == [st_b]
    c = Cache(2, [1, 1])
    c.storage = b.storage                                # a cache that took b's storage over replays its graphs
    assert model._state(c, None, 0) is st_b


def test_decode_memo_takes_the_fast_path_only_when_nothing_moved(monkeypatch):
    """LlamaGPU._replay_again (the decode loop's fast path) replays only a call that continues the last step: same
    cache, slots and options, the ids that step left. Anything else that moved the cache (a free or prefill, another
    model's step: the cache's version), other ids, a new context bucket without a graph, or a full step that raised
    sends the call through the full checks. CPU only: stub states, graphs and cache."""
    from vbw_cupy.models import LlamaConfig, gpu
    cfg = LlamaConfig(dim=64, hidden_dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=64)
    runs, fast = [], []

    class Dev:   # a device array: what the host uploaded last
        def set(self, v):
            self.values = np.array(v)

    class State:
        def __init__(self, B, vocab, inv_temp):
            self.tokens, self.held, self.graphs, self.cache = Dev(), None, {}, (lambda: None)
            self.seed, self.seed_buf = 0, np.zeros(1, np.uint64)

    class Graph:
        def __init__(self, bucket):
            self.bucket = bucket

        def replay(self, then=None):
            runs.append(("replay", self.bucket))
            if then is not None:
                then()

    def capture(step, state):
        step()
        return Graph(runs[-1][1])

    monkeypatch.setattr(gpu, "_StepState", State)
    monkeypatch.setattr(gpu, "_capture", capture)

    def model():
        m = object.__new__(gpu.LlamaGPU)
        m.config, m._graphs, m._memo = cfg, {}, None
        m._decode_step = lambda st, cache, bucket, n: runs.append(("step", bucket) if n == 1 else ("step", bucket, n))
        orig = m._replay_again

        def spy(*a):
            r = orig(*a)
            fast.append(r is not None)
            return r
        m._replay_again = spy
        return m

    class Storage:
        pass

    class Cache:
        def __init__(self):
            self._lens, self.capacity, self.max_batch = np.array([5, 5], dtype=np.int64), 64, 2
            self.storage, self._version = Storage(), 0
            self._active, self.active, self.seq_lens = np.zeros(2, dtype=np.int32), Dev(), Dev()

    def step(m, c, tok):
        st = m._step(np.array([tok]), c, [0], True, 0.0, 1, 1)
        st.held = np.array([tok + 1, 0], dtype=np.int32)   # what sampling would leave
        return tok + 1

    m, c = model(), Cache()
    t = step(m, c, 7)                      # full: 6 tokens, captures bucket 8
    t = step(m, c, t)
    t = step(m, c, t)
    assert fast == [False, True, True] and runs == [("step", 8), ("replay", 8), ("replay", 8)] and c._lens[0] == 8
    t = step(m, c, t)                      # 9 tokens: no graph for bucket 16 yet -> full, captures it
    assert fast[-1] is False and runs[-1] == ("step", 16)
    t = step(m, c, t)
    assert fast[-1] is True and runs[-1] == ("replay", 16)
    t = step(m, c, t + 5)                  # other ids than the step left
    assert fast[-1] is False and runs[-1] == ("replay", 16) and c._lens[0] == 11
    t = step(m, c, t)
    assert fast[-1] is True and c._lens[0] == 12
    c._version += 1                        # what a free or prefill of any slot does
    t = step(m, c, t)
    assert fast[-1] is False
    t = step(m, c, t)
    assert fast[-1] is True
    step(model(), c, 40)                   # another model steps the same cache
    t = step(m, c, t)
    assert fast[-1] is False and c._lens[0] == 16

    # a full step that fails after changing the device state: slots [0, 1], then [0] alone (the same id for
    # slot 0: nothing uploaded, but the active mask changes) whose replay raises, then [0, 1] again with the ids
    # the last good step left: the active mask must be set back, so no fast path
    m, c = model(), Cache()
    st = m._step(np.array([3, 4]), c, [0, 1], True, 0.0, 1, 1)
    st.held = np.array([9, 0], dtype=np.int32)
    m._step(np.array([9, 0]), c, [0, 1], True, 0.0, 1, 1)
    assert fast[-1] is True and c.active.values.tolist() == [1, 1]

    def boom(self, then=None):
        raise RuntimeError("replay failed")
    replay = Graph.replay
    Graph.replay = boom
    with pytest.raises(RuntimeError):
        m._step(np.array([9]), c, [0], True, 0.0, 1, 1)
    Graph.replay = replay
    assert c.active.values.tolist() == [1, 0]
    m._step(np.array([9, 0]), c, [0, 1], True, 0.0, 1, 1)
    assert fast[-1] is False and c.active.values.tolist() == [1, 1]

    # several steps a call (decode_steps): a graph per (bucket, steps), the lengths move by the steps
    m, c = model(), Cache()
    st = m._step(np.array([3]), c, [0], True, 0.0, 1, 4)       # 5 + 4 tokens: bucket 16, captured
    assert fast[-1] is False and runs[-1] == ("step", 16, 4) and c._lens[0] == 9
    st.held = np.array([8, 0], dtype=np.int32)
    m._step(np.array([8]), c, [0], True, 0.0, 1, 4)
    assert fast[-1] is True and runs[-1] == ("replay", 16) and c._lens[0] == 13
    st.held = np.array([6, 0], dtype=np.int32)
    m._step(np.array([6]), c, [0], True, 0.0, 1, 2)            # no graph of 2 steps yet: full, captured
    assert fast[-1] is False and runs[-1] == ("step", 16, 2) and c._lens[0] == 15
    m._step(np.array([6]), c, [0], True, 0.0, 1, 2)            # 17 tokens: bucket 32, a new graph
    assert fast[-1] is False and runs[-1] == ("step", 32, 2) and c._lens[0] == 17
    c._lens[0] = 50
    with pytest.raises(ValueError, match=r"a sequence \(50 tokens\) 16 steps on would pass the cache's capacity"):
        m._step(np.array([6]), c, [0], True, 0.0, 1, 16)
    assert c._lens[0] == 50


def test_generate_in_chunks_equals_one_step_a_call():
    """generate_ids with a model that has decode_steps (up to CHUNK steps a call) gives the ids, finish reasons
    and token counts of the one-step loop, never passing the cache's capacity or seq_len, whatever the prompts,
    budgets, seq_len and stop ids. CPU: a fake model whose next id is a function of the token and position."""
    import random
    from vbw_cupy.models import LlamaConfig
    from vbw_cupy.models.llama import numpy_ops
    V = 50

    def nxt(tok, pos):
        return (tok * 31 + pos * 7 + 3) % V

    class Cache:
        def __init__(self, B, cap):
            self.cap, self.lens = cap, np.zeros(B, dtype=np.int64)

        def free(self, b):
            self.lens[b] = 0

    class OneStep:
        def __init__(self, cfg):
            self.config, self.ops, self.calls = cfg, numpy_ops(), []

        def new_cache(self, B, T):
            return Cache(B, T)

        def prefill(self, prompts, c, slots):
            for p, b in zip(prompts, slots):
                c.lens[b] = len(p)
            return np.array([np.eye(V)[nxt(p[-1], len(p) - 1)] for p in prompts])

        def _one(self, toks, c, slots):
            ids = []
            for t, b in zip(toks, slots):
                pos = int(c.lens[b])
                c.lens[b] += 1
                assert 1 <= pos and c.lens[b] <= min(c.cap, self.config.seq_len), (c.lens[b], c.cap)
                ids.append(nxt(int(t), pos))
            return ids

        def decode(self, toks, c, slots):
            return np.array([np.eye(V)[i] for i in self._one(toks, c, slots)])

    class Chunked(OneStep):
        def decode_steps(self, toks, c, slots, n, temperature=0.0, seed=0):
            assert 1 <= n <= 8 and n & (n - 1) == 0
            self.calls.append(n)
            rows, t = [], list(toks)
            for _ in range(n):
                t = self._one(t, c, slots)
                rows.append(t)
            return np.array(rows)

    rng = random.Random(1)
    chunked_calls = 0
    for _ in range(400):
        seq_len = rng.randint(2, 40)
        prompts = [[rng.randrange(V) for _ in range(rng.randint(1, seq_len))] for _ in range(rng.randint(1, 4))]
        cfg = LlamaConfig(dim=8, hidden_dim=8, n_layers=1, n_heads=1, n_kv_heads=1, vocab_size=V, seq_len=seq_len)
        stop = set(rng.sample(range(V), rng.randint(0, 4)))
        budget = rng.randint(0, 45)
        m = Chunked(cfg)
        a = generate_ids(m, prompts, max_new_tokens=budget, stop_ids=stop)
        b = generate_ids(OneStep(cfg), prompts, max_new_tokens=budget, stop_ids=stop)
        assert [x.ids for x in a.sequences] == [x.ids for x in b.sequences]
        assert [x.finish_reason for x in a.sequences] == [x.finish_reason for x in b.sequences]
        assert a.decode_tokens == b.decode_tokens
        chunked_calls += sum(n > 1 for n in m.calls)
    assert chunked_calls > 100   # the chunks were really taken


@pytest.mark.parametrize("shared", [True, False])
def test_save_llama2c_round_trip(tmp_path, shared):
    """models.save_llama2c writes what load_llama2c reads back (and what this file's run.c writer writes)."""
    from vbw_cupy.models import LlamaConfig, load_llama2c, save_llama2c
    from vbw_cupy.models.llama import random_weights as lib_weights
    cfg = LlamaConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, seq_len=16,
                      shared_classifier=shared)
    w = lib_weights(cfg, seed=3)
    path = save_llama2c(tmp_path / "m.bin", cfg, w)
    cfg2, w2 = load_llama2c(path)
    assert cfg2 == cfg
    np.testing.assert_array_equal(w2.token_embedding, w.token_embedding)
    np.testing.assert_array_equal(w2.classifier, w.classifier)
    assert (w2.classifier is w2.token_embedding) == shared
    for a, b in zip(w2.layers, w.layers):
        for name in ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    # the same bytes as the run.c-order writer of this file
    rc = {"token_embedding": w.token_embedding, "rms_final": w.rms_final, "wcls": w.classifier,
          "sizes": dict(dim=32, hidden=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab=97)}
    for name in ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3"):
        rc[name] = np.stack([getattr(layer, name) for layer in w.layers])
    other = write_llama2c(tmp_path / "rc.bin", rc, 16, shared)
    assert path.read_bytes() == other.read_bytes()


def test_cli_says_when_seq_len_stops_generation(tmp_path, capsys, tok_bin):
    rng = np.random.default_rng(13)
    w = random_weights(rng, 32, 48, 1, 4, 4, TOK_VOCAB, True)
    w["token_embedding"][:3] = 0.0   # BOS / EOS never win the argmax: generation runs to its limit
    ckpt = write_llama2c(tmp_path / "m.bin", w, 12, True)
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok_bin), "--prompt", "ab", "--device", "cpu",
                     "--max-new-tokens", "500"]) == 0
    assert "the model's seq_len = 12" in capsys.readouterr().err
    # max-new-tokens 0 prefills nothing (the stats said 1 token at some huge rate); a prompt that is not UTF-8
    # (surrogates from the command line) becomes U+FFFD, as a decoder would make it
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok_bin), "--prompt", "ab", "--device", "cpu",
                     "--max-new-tokens", "0"]) == 0
    assert "prefill: 0 tokens" in capsys.readouterr().err
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok_bin), "--prompt", "a\udcffb", "--device", "cpu",
                     "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out.startswith("a\ufffdb")
