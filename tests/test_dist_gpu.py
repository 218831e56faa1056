"""vbw_cupy.dist on GPUs over NCCL: the equalities of tests/test_dist.py with real ranks (one thread a GPU, NCCL
communicators from `NcclComm.init_all`). Tests that need N GPUs skip with the reason where fewer are visible; a
one-GPU machine runs the N = 1 path (NCCL with a single rank). Bounds: SPEC section 7 (attention in float16
within 2e-3 relative of the float64 reference; model logits within 2e-2).

    python -m pytest -q tests/test_dist_gpu.py            # on a machine with 2 (or more) GPUs
"""
from __future__ import annotations

import numpy as np
import pytest

from vbw_cupy import _runtime as rt
from vbw_cupy import flash_attention, reference
from vbw_cupy.dist import NcclComm, TPGroup, ring_attention, run_ranks, zigzag_merge, zigzag_split
from vbw_cupy.models import Llama, LlamaConfig, LlamaGPU, generate_ids
from vbw_cupy.models.llama import random_weights

pytestmark = pytest.mark.gpu

ATTN_BOUND, MODEL_BOUND = 2e-3, 2e-2


def _gpus() -> int:
    if not rt.gpu_available():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def need(n: int):
    """Skip unless n GPUs and NCCL are here."""
    have = _gpus()
    if have < n:
        pytest.skip(f"needs {n} GPUs (one rank each), {have} visible: run on a {n}-GPU machine "
                    "(notes/multi-gpu.md has the commands)")
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            raise ImportError
    except ImportError:
        pytest.skip("cupy.cuda.nccl is not available: pip install nvidia-nccl-cu12 (or -cu13) next to CuPy")


SIZES = [1, 2, 4]


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("size", SIZES)
def test_nccl_all_reduce_and_ring_exchange(size):
    need(size)
    import cupy as cp
    comms = NcclComm.init_all(range(size))

    def body(comm):
        x = cp.full(1000, comm.rank + 1, dtype=cp.float32)
        comm.all_reduce(x)
        got = comm.sendrecv(cp.full(5, comm.rank, dtype=cp.int64), comm.next, cp.empty(5, cp.int64), comm.prev).wait()
        return float(x[0].get()), int(got[0].get())
    res = run_ranks(body, comms)
    assert [r[0] for r in res] == [size * (size + 1) / 2] * size
    assert [r[1] for r in res] == [(r - 1) % size for r in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("S, Hq, Hkv, D", [(4096, 8, 2, 128), (1023, 4, 4, 64), (203, 6, 1, 96)])
def test_ring_attention_equals_one_gpu(size, causal, S, Hq, Hkv, D):
    need(size)
    import cupy as cp
    rng = np.random.default_rng(S)
    q, k, v = (rng.standard_normal((1, S, h, D)).astype(np.float16) for h in (Hq, Hkv, Hkv))
    want = reference.flash_attention(q, k, v, causal=causal)
    with cp.cuda.Device(0):
        one = cp.asnumpy(flash_attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal))
    parts = [zigzag_split(a, size) for a in (q, k, v)]
    comms = NcclComm.init_all(range(size))
    res = run_ranks(lambda c: cp.asnumpy(ring_attention(*(cp.asarray(p[c.rank]) for p in parts), c, seq_len=S,
                                                        causal=causal)), comms)
    got = zigzag_merge(res)
    assert rel(got, want) <= ATTN_BOUND
    assert rel(got, one) <= ATTN_BOUND


CFG = LlamaConfig(dim=512, hidden_dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1000, seq_len=256)


def _teacher_forced(model, prompts, fed):
    """float64 logits of `model` (a NumPy Llama) at every prompt's last token, then after each fed token."""
    seqs = [list(p) + [f[b] for f in fed] for b, p in enumerate(prompts)]
    full = model.prefill(seqs, model.new_cache(len(seqs), max(map(len, seqs))), list(range(len(seqs))),
                         all_logits=True)
    offs = np.concatenate([[0], np.cumsum([len(x) for x in seqs])])
    return [np.stack([full[offs[b] + len(p) - 1 + i] for b, p in enumerate(prompts)]) for i in range(len(fed) + 1)]


@pytest.mark.parametrize("fmt", ["fp16", "nvfp4"])
@pytest.mark.parametrize("size", SIZES)
def test_tp_model_equals_float64_model(size, fmt):
    """Prefill logits (last token of each prompt) and three decode steps replayed from each rank's CUDA graph
    (all-reduces inside) within the model bound of the float64 model on the weights the ranks compute with
    (NVFP4 shards dequantized and put back together: each shard has its own tensor scale, so an nvfp4 group is
    not one GPU's nvfp4 model); fp16 also within the bound of the one-GPU LlamaGPU."""
    need(size)
    import cupy as cp
    w = random_weights(CFG, seed=2)
    prompts = [[1] + list(range(5, 90)), [1, 7, 8], [1] + list(range(100, 140))]
    fed = [[11 + t, 12, 13] for t in range(3)]
    group = TPGroup.on_gpus(CFG, w, size, fmt)
    cache = group.new_cache(3, 120)
    got = [cp.asnumpy(group.prefill(prompts, cache, [0, 1, 2]))]
    for toks in fed:
        got.append(cp.asnumpy(group.decode(toks, cache, [0, 1, 2])))
    want = _teacher_forced(Llama(CFG, group.host_weights()), prompts, fed)
    for g, r in zip(got, want):
        assert np.isfinite(g).all()
        assert rel(g, r) <= MODEL_BOUND
    if fmt == "fp16":
        with cp.cuda.Device(0):
            one = LlamaGPU(CFG, w, fmt)
            assert rel(got[0], cp.asnumpy(one.prefill(prompts, one.new_cache(3, 120), [0, 1, 2]))) <= MODEL_BOUND
    group.close()


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_tp_decode_graph_equals_eager(size):
    """The decode step captured with its all-reduces, replayed across steps and a context bucket boundary
    (30 -> 36 tokens crosses 32), gives the bits the same steps give run eagerly; every rank's logits are the
    same bits. (All eager steps first, then all graph steps: a model keeps one cache's graphs at a time.)"""
    need(size)
    import cupy as cp
    w = random_weights(CFG, seed=5)
    prompts = [[1] + list(range(20, 49)), [1, 2, 3]]
    group = TPGroup.on_gpus(CFG, w, size, "nvfp4")
    runs = {}
    for graph in (False, True):
        cache = group.new_cache(2, 64)
        group.prefill(prompts, cache, [0, 1])
        runs[graph] = [group._run(lambda comm: cp.asnumpy(group.models[comm.rank].decode(
            [40 + step, 50 + step], cache.ranks[comm.rank], [0, 1], graph=graph))) for step in range(6)]
    captured = group.models[0]._graphs
    assert len(captured) == 1 and sorted(next(iter(captured.values())).graphs) == [(32, 1), (64, 1)]
    for eager, graph in zip(runs[False], runs[True]):
        for r in range(size):
            np.testing.assert_array_equal(graph[r], eager[r])
            np.testing.assert_array_equal(graph[r], graph[0])
    group.close()


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_tp_greedy_generation_equals_one_gpu(size):
    """generate_ids on the group samples on the GPU (TPGroup.decode_sample): the ids match one GPU's."""
    need(size)
    import cupy as cp
    w = random_weights(CFG, seed=3)
    prompts = [[1, 20, 21, 22], [1] + list(range(300, 350))]
    with cp.cuda.Device(0):
        want = generate_ids(LlamaGPU(CFG, w, "fp16"), prompts, max_new_tokens=24)
    group = TPGroup.on_gpus(CFG, w, size, "fp16")
    assert hasattr(group, "decode_sample")
    got = generate_ids(group, prompts, max_new_tokens=24)
    # float16 with another summation order: a near tie of the top two logits may flip one pick and the rest
    # follows it, so ask for a long common prefix rather than all 24
    for s, t in zip(got.sequences, want.sequences):
        common = next((i for i, (a, b) in enumerate(zip(s.ids, t.ids)) if a != b), min(len(s.ids), len(t.ids)))
        assert common >= min(8, len(t.ids)), (s.ids, t.ids)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lse_merge_kernel_equals_one_call(dtype):
    """ring.py's merge kernel (one GPU, no NCCL): flash_attention over key blocks merged by log-sum-exp equals
    the float64 attention over all keys; rows a block does not reach (lse_b = -inf, o_b NaN) are left as they
    were, and rows outside [row0, row0 + n) are never touched."""
    if not rt.gpu_available():
        pytest.skip("no CUDA device")
    import cupy as cp
    import ml_dtypes
    from vbw_cupy.dist.ring import _merge
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, n, h, 64)).astype(dt) for n, h in ((300, 4), (700, 2), (700, 2)))
    want = reference.flash_attention(q, k, v)
    dq, dk, dv = (cp.asarray(a) for a in (q, k, v))
    out = cp.full((2, 400, 4, 64), 7.0, cp.float32)        # rows 100..399 hold the result, the rest stays 7
    lse = cp.full((2, 4, 400), 7.0, cp.float32)
    out[:, 100:], lse[:, :, 100:] = 0.0, -np.inf
    for a, b in ((0, 250), (250, 600), (600, 700)):
        o_b, lse_b = flash_attention(dq, dk[:, a:b], dv[:, a:b], return_lse=True)
        _merge(cp, out, lse, 100, o_b, lse_b)
    o_nan, lse_none = cp.full((2, 300, 4, 64), np.nan, dt), cp.full((2, 4, 300), -np.inf, cp.float32)
    _merge(cp, out, lse, 100, o_nan, lse_none)              # a block no row saw: nothing read, nothing changed
    got = out.get()
    assert (got[:, :100] == 7.0).all() and (lse.get()[:, :, :100] == 7.0).all()
    assert rel(got[:, 100:], want) <= (ATTN_BOUND if dtype == "float16" else 1e-2)   # docs/accuracy.md


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_tp_long_prefill_equals_one_gpu_and_close(size):
    """A prefill of 1500 tokens (GEMMs and all-reduces of many rows): every token's logits match one GPU's, the
    cache it filled decodes like one GPU's; a closed group refuses further calls."""
    need(size)
    import dataclasses
    import cupy as cp
    cfg = dataclasses.replace(CFG, seq_len=2048)
    w = random_weights(cfg, seed=8)
    rng = np.random.default_rng(8)
    prompts = [[1] + rng.integers(3, cfg.vocab_size, n).tolist() for n in (1100, 399)]
    with cp.cuda.Device(0):
        one = LlamaGPU(cfg, w, "fp16")
        one_cache = one.new_cache(2, 1200)
        want = cp.asnumpy(one.prefill(prompts, one_cache, [0, 1], all_logits=True))
        want_next = cp.asnumpy(one.decode([5, 6], one_cache, [0, 1]))
    group = TPGroup.on_gpus(cfg, w, size, "fp16")
    cache = group.new_cache(2, 1200)
    got = cp.asnumpy(group.prefill(prompts, cache, [0, 1], all_logits=True))
    got_next = cp.asnumpy(group.decode([5, 6], cache, [0, 1]))
    assert np.isfinite(got).all()
    assert rel(got, want) <= MODEL_BOUND and rel(got_next, want_next) <= MODEL_BOUND
    group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.decode([5, 6], cache, [0, 1])


_SPMD_SCRIPT = """
import json, sys
import cupy as cp
from vbw_cupy.dist import NcclComm, TPLlamaGPU
from vbw_cupy.models import LlamaConfig, generate_ids
from vbw_cupy.models.llama import random_weights
comm = NcclComm.from_env()
x = cp.full(8, comm.rank + 1.0, dtype=cp.float32)
comm.all_reduce(x)
cfg = LlamaConfig(dim=512, hidden_dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1000, seq_len=256)
model = TPLlamaGPU(cfg, random_weights(cfg, seed=3), comm, "fp16")
out = generate_ids(model, [[1, 20, 21, 22], [1] + list(range(300, 350))], max_new_tokens=24)
with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as f:
    json.dump({"device": cp.cuda.Device().id, "sum": float(x[0].get()), "ids": [s.ids for s in out.sequences]}, f)
"""


@pytest.mark.parametrize("size", [s for s in SIZES if s > 1])
def test_launcher_runs_a_tp_model_one_process_a_gpu(size, tmp_path):
    """python -m vbw_cupy.dist.launch: one process a GPU, NcclComm.from_env, a TPLlamaGPU a process (SPMD):
    the all-reduce sums over the processes, every rank generates the same ids, and they match one GPU's."""
    need(size)
    import json
    import cupy as cp
    from vbw_cupy.dist.launch import launch
    script = tmp_path / "spmd.py"
    script.write_text(_SPMD_SCRIPT)
    assert launch([str(script), str(tmp_path)], nproc=size) == 0
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    assert [r["device"] for r in res] == list(range(size))
    assert all(r["sum"] == size * (size + 1) / 2 for r in res)
    assert all(r["ids"] == res[0]["ids"] for r in res)
    with cp.cuda.Device(0):
        want = generate_ids(LlamaGPU(CFG, random_weights(CFG, seed=3), "fp16"),
                            [[1, 20, 21, 22], [1] + list(range(300, 350))], max_new_tokens=24)
    for got, t in zip(res[0]["ids"], want.sequences):
        common = next((i for i, (a, b) in enumerate(zip(got, t.ids)) if a != b), min(len(got), len(t.ids)))
        assert common >= min(8, len(t.ids)), (got, t.ids)


def test_lse_merge_kernel_grid_stride_and_unseen_accumulator_rows():
    """More rows than one launch's warps (65535 CTAs x 8: the grid-stride loop) merged against a NumPy
    float64 merge; accumulator rows that have seen nothing (lse -inf) are overwritten without being read, so a
    NaN left there does not leak."""
    if not rt.gpu_available():
        pytest.skip("no CUDA device")
    import cupy as cp
    from vbw_cupy.dist.ring import _merge
    rng = np.random.default_rng(12)
    B, L, H, D = 1, 70_000, 8, 8                       # 560,000 rows > 524,280
    out0 = rng.standard_normal((B, L, H, D)).astype(np.float32)
    lse0 = rng.standard_normal((B, H, L)).astype(np.float32)
    lse0[:, :, ::7] = -np.inf                          # unseen rows: their out holds NaN
    out0[:, ::7] = np.nan
    ob = rng.standard_normal((B, L, H, D)).astype(np.float16)
    lseb = rng.standard_normal((B, H, L)).astype(np.float32)
    out, lse = cp.asarray(out0), cp.asarray(lse0)
    _merge(cp, out, lse, 0, cp.asarray(ob), cp.asarray(lseb))
    want_o, want_l = out0.astype(np.float64), lse0.astype(np.float64)
    want_o[:, ::7] = 0.0
    _merge(np, want_o, want_l, 0, ob.astype(np.float64), lseb.astype(np.float64))
    got = out.get()
    assert np.isfinite(got).all()
    assert rel(got, want_o) <= 1e-6 and rel(lse.get(), want_l) <= 1e-6
