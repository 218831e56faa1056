"""The GPU Llama (vbw_cupy.models.gpu) against the float64 reference model, step by step (docs/accuracy.md: logits within
2e-2 relative error; with FP4 weights of the reference run on the dequantized weights)."""
import numpy as np
import pytest

from vbw_cupy import _errors
from vbw_cupy.models import LlamaConfig, Sampler, generate_ids
from vbw_cupy.models.llama import random_weights

pytestmark = pytest.mark.gpu

BOUND = 2e-2
CONFIGS = {  # head dims 32, 64 and 128; GQA and MHA; shared and separate classifier; both RoPE styles; Llama 3.1's
    # RoPE scaling (its table is built on the host: the GPU must read the same angles as the reference)
    "gqa-adjacent": LlamaConfig(dim=256, hidden_dim=768, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000,
                                seq_len=160),
    "mha-halves-separate": LlamaConfig(dim=256, hidden_dim=640, n_layers=3, n_heads=4, n_kv_heads=4,
                                       vocab_size=517, seq_len=200, rope_style="halves", rope_theta=500000.0,
                                       rope_scaling=("llama3", 8.0, 1.0, 4.0, 64.0), shared_classifier=False),
    "d128": LlamaConfig(dim=512, hidden_dim=1024, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=2048,
                        seq_len=300),
}


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")
    yield
    if _errors._buffers:
        _errors.pending()


def _model(name, fmt, seed=0):
    from vbw_cupy.models import LlamaGPU
    cfg = CONFIGS[name]
    return LlamaGPU(cfg, random_weights(cfg, seed=seed), fmt)


def _prompts(rng, lengths, vocab):
    return [[1] + rng.integers(3, vocab, n - 1).tolist() for n in lengths]


@pytest.mark.parametrize("fmt", ["fp16", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_every_step_within_bound(name, fmt):
    from vbw_cupy.models.gpu import reference_logits
    model = _model(name, fmt)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, (1, 37, 100, 17), model.config.vocab_size)   # one-token prompt, odd lengths
    got, ref, err = reference_logits(model, prompts, 12)
    assert np.isfinite(got).all()
    assert err.max() <= BOUND, f"relative error per step {err}"
    # greedy ids equal the reference's where its top-2 margin is wider than the error
    for i in range(got.shape[0]):
        for b in range(got.shape[1]):
            top2 = np.sort(ref[i, b])[-2:]
            if top2[1] - top2[0] > 2 * err[i] * np.abs(ref[i, b]).max():
                assert got[i, b].argmax() == ref[i, b].argmax()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("hidden", [768, 100])
def test_one_sequence_fp4_decode_within_bound(fmt, hidden):
    """Batch 1 with FP4 weights: the decode GEMVs for one token, and with hidden_dim % 8 == 0 the gate / up GEMV
    with SiLU in its epilogue (hidden 768), else gate / up stacked and silu_mul (hidden 100), against the
    reference on the dequantized weights, step by step."""
    from vbw_cupy.models import LlamaGPU
    from vbw_cupy.models.gpu import reference_logits
    cfg = LlamaConfig(dim=256, hidden_dim=hidden, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=1000, seq_len=64)
    model = LlamaGPU(cfg, random_weights(cfg, seed=3), fmt)
    assert model._inter == (hidden % 8 == 0)
    got, ref, err = reference_logits(model, _prompts(np.random.default_rng(2), (29,), cfg.vocab_size), 10)
    assert np.isfinite(got).all() and err.max() <= BOUND, f"relative error per step {err}"


def test_sampling_loop_replays_after_a_few_comparisons():
    """decode_sample fed its own output takes LlamaGPU._replay_again (the memo of the step before) instead of the
    full checks: the same ids as a model that runs the full checks every step; a prefill or free in between
    sends the next step through the full checks; the capacity error still comes when the cache is full."""
    models = [_model("gqa-adjacent", "nvfp4", seed=4) for _ in range(2)]
    rng = np.random.default_rng(4)
    p0, p1 = _prompts(rng, (13, 7), models[0].config.vocab_size)
    caches = [m.new_cache(2, 40) for m in models]   # 48 tokens a slot (3 blocks)
    fast = []
    orig = models[0]._replay_again
    models[0]._replay_again = lambda *a: fast.append(orig(*a)) or fast[-1]
    toks = []
    for m, c in zip(models, caches):
        toks.append(m.prefill([p0], c, [0]).argmax(axis=1).get())
    for i in range(30):
        models[1]._memo = None
        a, b = (m.decode_sample(t, c, [0], temperature=0.7, seed=3) for m, c, t in zip(models, caches, toks))
        np.testing.assert_array_equal(a, b)
        toks = [a, b]
        if i == 10:
            for m, c in zip(models, caches):
                m.prefill([p1], c, [1])
        if i == 20:
            for c in caches:
                c.free(1)
    # full checks: the first step, after the prefill and the free, and where a step enters a new context
    # bucket (its graph is captured there): 14 + i tokens pass 16 at i = 3 and 32 at i = 19
    assert [f is None for f in fast] == [i in (0, 3, 11, 19, 21) for i in range(30)]
    assert caches[0].lengths([0])[0] == 13 + 30
    with pytest.raises(ValueError, match="capacity"):
        for _ in range(10):
            toks[0] = models[0].decode_sample(toks[0], caches[0], [0], temperature=0.7, seed=3)
    assert caches[0].lengths([0])[0] == 48


def test_graph_replay_equals_eager():
    """Two models with the same weights, one replaying its decode graphs step after step (one cache, so the
    graphs of each context bucket are captured once and replayed), the other eager."""
    models = [_model("gqa-adjacent", "nvfp4", seed=2) for _ in range(2)]
    model = models[0]
    rng = np.random.default_rng(2)
    prompts = _prompts(rng, (9, 30, 3), model.config.vocab_size)
    caches = [m.new_cache(3, 100) for m in models]
    for m, c in zip(models, caches):
        m.prefill(prompts, c, [0, 1, 2])
    forced = rng.integers(3, model.config.vocab_size, (40, 3))  # the longest sequence crosses from bucket 32 to 64
    for i, toks in enumerate(forced):
        slots = [0, 1, 2] if i < 25 else [0, 2]   # slot 1 idles from step 25 on
        a = models[0].decode(toks[slots], caches[0], slots, graph=True).get()
        b = models[1].decode(toks[slots], caches[1], slots, graph=False).get()
        np.testing.assert_array_equal(a, b)
    st = next(iter(models[0]._graphs.values()))
    assert sorted(st.graphs) == [(32, 1), (64, 1)]   # one graph per context bucket (one step), replayed
    np.testing.assert_array_equal(caches[0].seq_lens.get(), caches[1].seq_lens.get())
    np.testing.assert_array_equal(caches[0].seq_lens.get(), [9 + 40, 30 + 25, 3 + 40])
    _errors.check_errors()  # idle slots flag nothing


def test_prefill_then_decode_equals_full_recompute():
    model = _model("mha-halves-separate", "fp16", seed=3)
    rng = np.random.default_rng(3)
    prompt = _prompts(rng, (21,), model.config.vocab_size)[0]
    forced = rng.integers(3, model.config.vocab_size, 15).tolist()
    cache = model.new_cache(1, 64)
    steps = [model.prefill([prompt], cache, [0]).get()[0]]
    for t in forced:
        steps.append(model.decode([t], cache, [0]).get()[0])
    full = model.prefill([prompt + forced], model.new_cache(1, 64), [0], all_logits=True).get()[len(prompt) - 1:]
    err = np.linalg.norm(np.stack(steps) - full) / np.linalg.norm(full)
    assert err < 5e-3, err


def test_gpu_sampling_greedy_matches_host_and_seeded_draws_repeat():
    model = _model("gqa-adjacent", "fp16", seed=4)
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, (5, 12), model.config.vocab_size)
    greedy_gpu = generate_ids(model, prompts, max_new_tokens=20, stop_ids=())
    host = Sampler(0.0, top_k=1)  # top_k keeps sampling on the host: the same greedy choice from copied logits
    greedy_host = generate_ids(model, prompts, max_new_tokens=20, sampler=host, stop_ids=())
    assert [s.ids for s in greedy_gpu.sequences] == [s.ids for s in greedy_host.sequences]
    # a high temperature: random weights give peaked logits, and the draws must differ between seeds
    draw = lambda seed: [s.ids for s in generate_ids(model, prompts, max_new_tokens=20, stop_ids=(),
                                                     sampler=Sampler(1e3, seed=seed)).sequences]
    assert draw(7) == draw(7) and draw(7) != draw(8)
    # one set of graphs serves every seed (the seed is a device word), and an unseeded sampler draws a new seed a
    # call (it was 0: every unseeded run gave the same tokens)
    from vbw_cupy.models import gpu
    captures = []
    real = gpu._capture
    gpu._capture = lambda step, state: captures.append(1) or real(step, state)
    try:
        unseeded = [draw(None) for _ in range(3)]
        assert draw(7) == draw(7)
    finally:
        gpu._capture = real
    assert captures == [] and unseeded[0] != unseeded[1] != unseeded[2]


def test_decode_steps_equal_single_steps():
    """decode_steps(n) samples what n decode_sample calls sample (two sequences, temperature draws, chunks of 1 to
    16 steps crossing context buckets 16 -> 32 -> 64, where paged attention runs one split either way), replayed
    from its graphs and eager; a call whose steps would pass the cache's capacity raises before any step runs."""
    models = [_model("gqa-adjacent", "nvfp4", seed=6) for _ in range(3)]
    rng = np.random.default_rng(6)
    prompts = _prompts(rng, (13, 6), models[0].config.vocab_size)
    caches = [m.new_cache(2, 60) for m in models]   # 64 tokens a slot
    first = [m.prefill(prompts, c, [0, 1]).argmax(axis=1).get() for m, c in zip(models, caches)]
    t, ref = first[0], []
    for _ in range(40):
        t = models[0].decode_sample(t, caches[0], [0, 1], temperature=0.7, seed=9)
        ref.append(t)
    for m, c, t, chunks, graph in ((models[1], caches[1], first[1], (1, 4, 8, 2, 16, 8, 1), True),
                                   (models[2], caches[2], first[2], (8, 16, 16), False)):
        rows = []
        for n in chunks:
            got = m.decode_steps(t, c, [0, 1], n, temperature=0.7, seed=9, graph=graph)
            assert got.shape == (n, 2) and got.dtype == np.int64
            rows += list(got)
            t = got[-1]
        np.testing.assert_array_equal(np.array(rows), np.array(ref))
        assert c.lengths([0, 1]).tolist() == [13 + 40, 6 + 40]
    with pytest.raises(ValueError, match="capacity"):
        models[1].decode_steps(t, caches[1], [0, 1], 12, temperature=0.7, seed=9)
    assert caches[1].lengths([0, 1]).tolist() == [53, 46]
    with pytest.raises(ValueError, match=r"steps: expected an int in \[1, 16\], got 17"):
        models[1].decode_steps(t, caches[1], [0, 1], 17)


def test_generate_in_chunks_stops_where_single_steps_stop():
    """generate_ids on the GPU runs up to CHUNK steps a call; a sequence whose stop id comes inside a chunk ends
    there (what it sampled after is dropped) as in the host-sampled loop of one step a call."""
    model = _model("gqa-adjacent", "fp16", seed=7)
    rng = np.random.default_rng(7)
    prompts = _prompts(rng, (5, 12, 8), model.config.vocab_size)
    free = generate_ids(model, prompts, max_new_tokens=30, stop_ids=())
    stop = {free.sequences[0].ids[5], free.sequences[2].ids[11]}
    gpu = generate_ids(model, prompts, max_new_tokens=30, stop_ids=stop)
    host = generate_ids(model, prompts, max_new_tokens=30, stop_ids=stop, sampler=Sampler(0.0, top_k=1))
    assert [s.ids for s in gpu.sequences] == [s.ids for s in host.sequences]
    assert [s.finish_reason for s in gpu.sequences] == [s.finish_reason for s in host.sequences]
    assert gpu.sequences[0].finish_reason == "stop" and len(gpu.sequences[0].ids) <= 5
    assert gpu.decode_tokens == host.decode_tokens


def test_gumbel_sampling_follows_the_distribution():
    """sample_rows at temperature 1 over fixed logits: token frequencies match softmax (chi-square, 4 dof)."""
    import cupy as cp
    from vbw_cupy import _runtime as rt
    from vbw_cupy.models import gpu
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.15, 0.25], dtype=np.float32))
    n = 20000
    rows = cp.asarray(np.tile(logits, (n, 1)))
    pos = cp.arange(n, dtype=cp.int32)   # each row its own key
    out = cp.zeros(n, dtype=cp.int32)
    seed = cp.full(1, 99, dtype=cp.uint64)   # (a device word: the decode graphs' seed buffer)
    rt.launch(gpu._kernel("sample_rows"), (n,), (256,), (rows, np.int32(5), np.float32(1.0), seed, pos, out))
    counts = np.bincount(out.get(), minlength=5)
    expected = n * np.exp(logits) / np.exp(logits).sum()
    assert ((counts - expected) ** 2 / expected).sum() < 20.0   # chi2(4) > 20 has p < 0.001


def test_bad_token_id_gives_nan_and_an_error():
    model = _model("gqa-adjacent", "fp16", seed=5)
    cache = model.new_cache(2, 32)
    logits = model.prefill([[1, 5, 9], [1, model.config.vocab_size + 7]], cache, [0, 1]).get()
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()
    with pytest.raises(ValueError, match="tokens.*row 4"):
        _errors.check_errors()
    # the process stays usable
    assert np.isfinite(model.decode([3, 4], cache, [0, 1], graph=False).get()[0]).all()


def test_wrong_format_and_slots_are_refused():
    from vbw_cupy.models import LlamaGPU
    cfg = CONFIGS["gqa-adjacent"]
    with pytest.raises(ValueError, match="weight_format: expected one of .* on the GPU, got 'fp32'"):
        LlamaGPU(cfg, random_weights(cfg), "fp32")
    model = _model("gqa-adjacent", "fp16")
    cache = model.new_cache(2, 16)
    with pytest.raises(ValueError, match="prefilled"):
        model.decode([1], cache, [0])
    model.prefill([[1] * 16], cache, [0])
    with pytest.raises(ValueError, match="capacity"):
        model.decode([1], cache, [0])


def test_cli_generate_on_the_gpu(tmp_path, capsys):
    """`vbw-cupy generate --device gpu` end to end on a llama2.c file and tokenizer.bin written here: the prompt's
    ids first, repeatable output, and the first token equal to the CPU reference's where its margin is clear."""
    from test_model import EXTRA, TOK_VOCAB, cli_ids, random_weights as rc_weights, write_llama2c, \
        write_tokenizer_bin
    from vbw_cupy.models import load_model, load_tokenizer
    rng = np.random.default_rng(12)
    w = rc_weights(rng, 64, 96, 2, 4, 2, TOK_VOCAB, True)
    ckpt, tok = write_llama2c(tmp_path / "m.bin", w, 48, True), write_tokenizer_bin(tmp_path / "t.bin", EXTRA)
    argv = ["generate", str(ckpt), "--tokenizer", str(tok), "--prompt", "abc ab", "--device", "gpu", "--print-ids",
            "--max-new-tokens", "12", "--weights", "fp16"]
    ids = cli_ids(capsys, argv)
    assert ids == cli_ids(capsys, argv)
    prompt = load_tokenizer(tok).encode("abc ab")
    assert ids[:len(prompt)] == prompt and len(prompt) < len(ids) <= len(prompt) + 12
    cpu = load_model(ckpt, weights="fp16", device="cpu")
    logits = cpu.prefill([prompt], cpu.new_cache(1, 48), [0])[0]
    top2 = np.sort(logits)[-2:]
    if top2[1] - top2[0] > 0.05 * np.abs(logits).max():
        assert ids[len(prompt)] == int(np.argmax(logits))


def test_generate_calls_reuse_the_cache_storage_and_its_graphs(monkeypatch):
    """A second generate of the same size takes over the first call's cache arrays (the first cache is gone)
    and replays its decode graphs instead of capturing them again; the ids equal a fresh model's, and a cache
    that is still held is never taken over. release_cache() lets the arrays and graphs go."""
    from vbw_cupy.models import gpu
    captures = []
    real = gpu._capture
    monkeypatch.setattr(gpu, "_capture", lambda step, state: captures.append(1) or real(step, state))
    model = _model("gqa-adjacent", "nvfp4")
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, (20, 9), model.config.vocab_size)
    first = generate_ids(model, prompts, max_new_tokens=30, stop_ids=())
    n = len(captures)
    assert n >= 2                                              # buckets 32 and 64
    again = generate_ids(model, prompts, max_new_tokens=30, stop_ids=())
    assert len(captures) == n                                  # replayed, not captured again
    fresh = generate_ids(_model("gqa-adjacent", "nvfp4"), prompts, max_new_tokens=30, stop_ids=())
    assert [s.ids for s in again.sequences] == [s.ids for s in first.sequences] == [s.ids for s in fresh.sequences]
    held = model.new_cache(2, 64)
    other = model.new_cache(2, 64)
    assert other.storage is not held.storage                   # held: never taken over
    arrays = other.storage
    model.recycle(other)                                       # ... unless handed over (generate_ids does this)
    taken = model.new_cache(2, 64)
    assert taken.storage is arrays and other.storage is None
    with pytest.raises(ValueError, match="recycled"):
        model.decode_sample([1, 2], other, [0, 1])
    model.release_cache()
    assert model._graphs == {} and model._spare[0] is None
