"""vbw_cupy.dist on NumPy: simulated ranks (SimComm) run the tensor-parallel Llama and ring attention, which must
equal the unsplit model and the unsplit reference attention. tests/test_dist_gpu.py runs the same on NCCL."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from test_model import EXTRA, TOK_VOCAB, write_llama2c, write_tokenizer_bin
from test_model import random_weights as checkpoint_weights
from vbw_cupy import reference
from vbw_cupy.cli import main as cli_main
from vbw_cupy.dist import (SimGroup, TPGroup, TPLlama, ring_attention, shard_weights, zigzag_merge, zigzag_positions,
                           zigzag_split)
from vbw_cupy.models import Llama, LlamaConfig, generate_ids
from vbw_cupy.models.llama import random_weights


# ---------------------------------------------------------------------------------------------- SimComm

def test_all_reduce_is_the_rank_order_sum_in_place():
    xs = [np.random.default_rng(r).standard_normal(7).astype(np.float32) for r in range(4)]
    want = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    arrays = [x.copy() for x in xs]
    got = SimGroup(4).run(lambda comm: comm.all_reduce(arrays[comm.rank]))
    for r in range(4):
        assert got[r] is arrays[r]
        np.testing.assert_array_equal(got[r], want)


def test_sendrecv_ring():
    def step(comm):
        p = comm.sendrecv(np.full(3, comm.rank), comm.next, np.empty(3, np.int64), comm.prev)
        return p.wait()
    got = SimGroup(3).run(step)
    assert [int(g[0]) for g in got] == [2, 0, 1]


def test_a_failing_rank_does_not_hang_the_others():
    def body(comm):
        if comm.rank == 1:
            raise KeyError("rank 1 broke")
        comm.all_reduce(np.zeros(2))
    with pytest.raises(KeyError, match="rank 1 broke"):
        SimGroup(3, timeout=30).run(body)

    def ring(comm):   # rank 0 waits for a message rank 2 never sends
        if comm.rank == 2:
            raise KeyError("rank 2 broke")
        comm.sendrecv(np.zeros(1), comm.next, np.empty(1), comm.prev).wait()
    t0 = time.perf_counter()
    with pytest.raises(KeyError, match="rank 2 broke"):
        SimGroup(3, timeout=30).run(ring)
    assert time.perf_counter() - t0 < 5
    assert threading.active_count() < 10


def test_a_simulated_group_stays_usable_after_a_rank_error():
    # its barrier stayed aborted: every later collective raised BrokenBarrierError
    group = SimGroup(3, timeout=30)

    def body(comm):
        if comm.rank == 1:
            raise KeyError("rank 1 broke")
        comm.sendrecv(np.full(1, comm.rank), comm.next, np.empty(1), comm.prev)   # (left unread in a mailbox)
        comm.all_reduce(np.zeros(2))
    with pytest.raises(KeyError, match="rank 1 broke"):
        group.run(body)
    got = group.run(lambda comm: comm.all_reduce(np.full(3, comm.rank + 1.0)))
    assert all((g == 6).all() for g in got)
    got = group.run(lambda comm: comm.sendrecv(np.full(1, 10.0 + comm.rank), comm.next, np.empty(1),
                                               comm.prev).wait())
    assert [float(g[0]) for g in got] == [12.0, 10.0, 11.0]   # this call's messages, none left from the failure
    cfg = CONFIGS["gqa"]
    tp = TPGroup.simulated(cfg, random_weights(cfg), 2)
    with pytest.raises(ValueError, match="token ids"):
        tp.prefill([[1, cfg.vocab_size + 5]], tp.new_cache(1, 16), [0])
    tp.prefill([[1, 2]], tp.new_cache(1, 16), [0])


# ---------------------------------------------------------------------------------------------- tensor parallel

CONFIGS = {
    "gqa": LlamaConfig(dim=64, hidden_dim=96, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=61, seq_len=48),
    "mha-uneven-ffn": LlamaConfig(dim=48, hidden_dim=70, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=53,
                                  seq_len=48, rope_style="halves", shared_classifier=False),
}


def rel(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_shard_weights_shapes_and_cover():
    cfg = CONFIGS["gqa"]
    w = random_weights(cfg)
    shards = [shard_weights(cfg, w, r, 4) for r in range(4)]
    lw = [s.layers[0] for s in shards]
    assert [x.wq.shape for x in lw] == [(16, 64)] * 4 and [x.wk.shape for x in lw] == [(8, 64)] * 4
    assert [x.wo.shape for x in lw] == [(64, 16)] * 4 and [x.w2.shape for x in lw] == [(64, 24)] * 4
    np.testing.assert_array_equal(np.concatenate([x.wv for x in lw]), w.layers[0].wv)
    np.testing.assert_array_equal(np.concatenate([x.wo for x in lw], axis=1), w.layers[0].wo)
    np.testing.assert_array_equal(np.concatenate([x.w3 for x in lw]), w.layers[0].w3)
    assert shards[1].classifier is w.classifier and shards[1].rms_final is w.rms_final
    with pytest.raises(ValueError, match="tp: expected a divisor of n_kv_heads = 4"):
        shard_weights(cfg, w, 0, 3)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < 2"):
        shard_weights(cfg, w, 2, 2)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_tp_prefill_and_decode_equal_the_unsplit_model(name, size):
    cfg = CONFIGS[name]
    if cfg.n_kv_heads % size:
        pytest.skip("n_kv_heads does not split")
    w = random_weights(cfg, seed=3)
    prompts = [[1, 5, 9, 11, 20, 7, 3], [1, 30], [1, 4, 4, 4, 40]]
    one = Llama(cfg, w)
    group = TPGroup.simulated(cfg, w, size)
    c1, cn = one.new_cache(3, 12), group.new_cache(3, 12)
    assert cn.ranks[0].layers[0].k_cache.shape[2] == cfg.n_kv_heads // size
    assert rel(group.prefill(prompts, cn, [0, 1, 2], all_logits=True),
               one.prefill(prompts, c1, [0, 1, 2], all_logits=True)) < 1e-5
    for tokens in ([6, 7, 8], [9, 10, 11]):
        want, got = one.decode(tokens, c1, [0, 1, 2]), group.decode(tokens, cn, [0, 1, 2])
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("size", [1, 2, 4])
def test_tp_greedy_generation_equals_the_unsplit_model(size):
    cfg = CONFIGS["gqa"]
    w = random_weights(cfg, seed=4)
    prompts = [[1, 9, 8, 7], [1, 2], [1, 33, 34, 35, 36, 37, 38, 39, 40]]
    want = generate_ids(Llama(cfg, w), prompts, max_new_tokens=12)
    got = generate_ids(TPGroup.simulated(cfg, w, size), prompts, max_new_tokens=12)
    assert [s.ids for s in got.sequences] == [s.ids for s in want.sequences]


def test_tp_ranks_agree_bit_for_bit():
    cfg = CONFIGS["gqa"]
    w = random_weights(cfg, seed=5)

    def rank(comm):
        model = TPLlama(cfg, w, comm)
        return model.prefill([[1, 2, 3, 4]], model.new_cache(1, 8), [0])
    logits = SimGroup(4).run(rank)
    for other in logits[1:]:
        np.testing.assert_array_equal(other, logits[0])


def test_tp_nvfp4_stays_close_to_the_unsplit_model():
    """FP4 shards quantize their own slices (w2 and wo along the split `in` axis, NVFP4's global scale per shard):
    not bit-equal to the unsplit quantization, but within the formats' error."""
    cfg = LlamaConfig(dim=64, hidden_dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=40, seq_len=16)
    w = random_weights(cfg, seed=6)
    prompts = [[1, 5, 6, 7, 8]]
    one, group = Llama(cfg, w, weight_format="nvfp4"), TPGroup.simulated(cfg, w, 2, "nvfp4")
    exact = Llama(cfg, w).prefill(prompts, Llama(cfg, w).new_cache(1, 8), [0])
    got = group.prefill(prompts, group.new_cache(1, 8), [0])
    want = one.prefill(prompts, one.new_cache(1, 8), [0])
    assert rel(got, want) < 2 * rel(want, exact) + 1e-3


def test_cli_generate_tp_on_simulated_ranks(tmp_path, capsys):
    tok = write_tokenizer_bin(tmp_path / "tokenizer.bin", EXTRA)
    w = checkpoint_weights(np.random.default_rng(11), 32, 48, 2, 4, 2, TOK_VOCAB, True)
    ckpt = write_llama2c(tmp_path / "m.bin", w, 24, True)

    def ids(*extra):
        argv = ["generate", str(ckpt), "--tokenizer", str(tok), "--prompt", "hi", "--device", "cpu", "--print-ids",
                "--max-new-tokens", "8", *extra]
        assert cli_main(argv) == 0
        out = capsys.readouterr()
        return [ln for ln in out.out.splitlines() if ln.startswith("ids: ")], out.err
    single, _ = ids()
    split, err = ids("--tp", "2")
    assert split == single
    assert "tp 2 on simulated ranks" in err and "needs 2 visible GPUs and NCCL" in err
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok), "--device", "cpu", "--tp", "3"]) == 2
    assert "tp: expected a divisor of n_kv_heads = 2" in capsys.readouterr().err


def test_cli_generate_tp_on_gpu_explains_what_it_needs(tmp_path, capsys):
    from vbw_cupy import _runtime as rt
    if rt.gpu_available():
        pytest.skip("a GPU is visible: the message is for machines with fewer GPUs than --tp")
    tok = write_tokenizer_bin(tmp_path / "tokenizer.bin", EXTRA)
    ckpt = write_llama2c(tmp_path / "m.bin", checkpoint_weights(np.random.default_rng(1), 32, 48, 1, 4, 2, TOK_VOCAB,
                                                                True), 24, True)
    assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok), "--device", "gpu", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert ("--tp 2 on the GPU needs 2 visible GPUs (one rank each) and NCCL" in err or
            "--tp 2 on the GPU needs CuPy with NCCL" in err) and "--device cpu" in err   # (with / without CuPy)
    for tp in ("0", "-1"):   # (it said NCCL was missing)
        assert cli_main(["generate", str(ckpt), "--tokenizer", str(tok), "--device", "gpu", "--tp", tp]) == 2
        assert f"tp: expected a positive int, got {tp}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- ring attention

def test_zigzag_layout():
    assert list(zigzag_positions(8, 0, 2)) == [0, 1, 6, 7]
    assert list(zigzag_positions(8, 1, 2)) == [2, 3, 4, 5]
    assert list(zigzag_positions(7, 0, 2)) == [0, 1, 6]        # chunks of 2, 2, 2, 1
    x = np.arange(2 * 13 * 3).reshape(2, 13, 3)
    for size in (1, 2, 3, 4):
        np.testing.assert_array_equal(zigzag_merge(zigzag_split(x, size)), x)


def run_ring(size, q, k, v, causal, dtype=np.float32, **kw):
    S = q.shape[1]
    qs, ks, vs = (zigzag_split(a.astype(dtype), size) for a in (q, k, v))
    res = SimGroup(size).run(lambda c: ring_attention(qs[c.rank], ks[c.rank], vs[c.rank], c, seq_len=S,
                                                      causal=causal, return_lse=True, **kw))
    return zigzag_merge([o for o, _ in res]), zigzag_merge([lse for _, lse in res], axis=2)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("S, Hq, Hkv, D", [(64, 4, 4, 16), (113, 6, 2, 24), (7, 4, 1, 8)])
def test_ring_attention_equals_the_unsplit_reference(size, causal, S, Hq, Hkv, D):
    rng = np.random.default_rng(S + size)
    q = rng.standard_normal((2, S, Hq, D)).astype(np.float32)
    k = rng.standard_normal((2, S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((2, S, Hkv, D)).astype(np.float32)
    want, want_lse = reference.flash_attention(q, k, v, causal=causal, return_lse=True)
    got, got_lse = run_ring(size, q, k, v, causal)
    assert got.dtype == np.float32 and got.shape == want.shape and got_lse.shape == want_lse.shape
    assert rel(got, want) < 1e-6
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("S", [7, 9, 10, 64])
def test_ring_attention_without_seq_len_on_uneven_splits(S):
    # seq_len's default was L * size on each rank: on a split 2 size does not divide, ranks took different
    # lengths and their messages disagreed (a ValueError here, bytes of the wrong size over NCCL)
    rng = np.random.default_rng(S)
    q, k, v = (rng.standard_normal((1, S, 2, 8)).astype(np.float32) for _ in range(3))
    qs, ks, vs = (zigzag_split(a, 2) for a in (q, k, v))
    res = SimGroup(2).run(lambda c: ring_attention(qs[c.rank], ks[c.rank], vs[c.rank], c, causal=True))
    assert rel(zigzag_merge(res), reference.flash_attention(q, k, v, causal=True)) < 1e-6


def test_ring_attention_bfloat16_and_softmax_scale():
    import ml_dtypes
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 50, 4, 32)).astype(np.float32) for _ in range(3))
    bf16 = ml_dtypes.bfloat16
    want = reference.flash_attention(q.astype(bf16), k.astype(bf16), v.astype(bf16), causal=True, softmax_scale=0.3)
    got, _ = run_ring(3, q, k, v, True, dtype=bf16, softmax_scale=0.3)
    assert got.dtype == bf16
    # each rank rounds its partial outputs to bfloat16 before the merge: a few bfloat16 ulps
    assert rel(got.astype(np.float32), want.astype(np.float32)) < 3 * 2.0 ** -8


def test_ring_attention_names_a_wrong_part():
    q = np.zeros((1, 5, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"q: expected \[B, 4, H, D\] \(rank 0's 4 of 8 positions over 2 ranks\)"):
        SimGroup(2).run(lambda c: ring_attention(q, q, q, c, seq_len=8))


# ---------------------------------------------------------------------------------------------- RankThreads
class _Rank:
    def __init__(self, rank):
        self.rank, self.activated = rank, 0

    def activate(self):
        self.activated += 1


def test_rank_threads_run_each_rank_on_its_own_long_lived_thread():
    from vbw_cupy.dist import RankThreads
    comms = [_Rank(r) for r in range(3)]
    run = RankThreads(comms)
    first = run(lambda c: (c.rank, threading.get_ident()))
    second = run(lambda c: (c.rank * 10, threading.get_ident()))
    assert [r for r, _ in first] == [0, 1, 2] and [r for r, _ in second] == [0, 10, 20]
    assert [t for _, t in first] == [t for _, t in second]            # the same threads every call
    assert len({t for _, t in first} | {threading.get_ident()}) == 4   # one a rank, none the caller's
    assert [c.activated for c in comms] == [1, 1, 1]                  # the device made current once
    run.close()


def test_rank_threads_raise_a_rank_error_and_stay_usable():
    from vbw_cupy.dist import RankThreads

    def body(c):
        if c.rank == 1:
            raise ValueError("rank 1 failed")
        return c.rank
    run = RankThreads([_Rank(r) for r in range(2)])
    with pytest.raises(ValueError, match="rank 1 failed"):
        run(body)
    assert run(lambda c: c.rank + 1) == [1, 2]
    run.close()


class _AbortableRank(_Rank):
    """A comm with abort() (as NcclComm): a rank waiting in its 'collective' is released by the abort."""

    def __init__(self, rank, released):
        super().__init__(rank)
        self.released, self.aborted = released, 0

    def abort(self):
        self.aborted += 1
        self.released.set()


def _fail_while_the_other_waits(c):
    if c.rank == 0:
        raise ValueError("rank 0 failed before the collective")
    if not c.released.wait(timeout=5):     # rank 1 blocked on its peer, as in an NCCL all-reduce
        raise TimeoutError("rank 1 was never released")
    raise RuntimeError("rank 1: the collective was aborted")


def test_run_ranks_aborts_abortable_comms_so_no_rank_hangs():
    """run_ranks without on_error: comms that can abort (NcclComm) are aborted at the first rank error, so a rank
    blocked on the failed peer returns; the first rank's error is raised, every comm aborted once."""
    from vbw_cupy.dist.comm import run_ranks
    released = threading.Event()
    comms = [_AbortableRank(r, released) for r in range(2)]
    with pytest.raises(ValueError, match="rank 0 failed"):
        run_ranks(_fail_while_the_other_waits, comms)
    assert [c.aborted for c in comms] == [1, 1]
    calls = []                                  # an explicit on_error replaces the default, and runs once
    with pytest.raises(ValueError, match="failed"):   # though every rank fails

        def fail(c):
            raise ValueError(f"rank {c.rank} failed")
        run_ranks(fail, [_AbortableRank(r, threading.Event()) for r in range(4)], on_error=lambda: calls.append(1))
    assert calls == [1]


def test_run_ranks_default_abort_reaches_every_comm_when_one_abort_fails():
    from vbw_cupy.dist.comm import run_ranks
    released = threading.Event()

    class _Stubborn(_AbortableRank):
        def abort(self):
            self.aborted += 1
            raise RuntimeError("ncclCommAbort failed")
    comms = [_Stubborn(0, released), _AbortableRank(1, released)]
    with pytest.raises(ValueError, match="rank 0 failed"):
        run_ranks(_fail_while_the_other_waits, comms)
    assert [c.aborted for c in comms] == [1, 1]   # rank 1's comm aborted (so it returned) though rank 0's raised


def test_rank_threads_abort_abortable_comms_and_break():
    from vbw_cupy.dist import RankThreads
    released = threading.Event()
    comms = [_AbortableRank(r, released) for r in range(2)]
    run = RankThreads(comms)
    with pytest.raises(ValueError, match="rank 0 failed"):
        run(_fail_while_the_other_waits)
    assert [c.aborted for c in comms] == [1, 1]
    with pytest.raises(RuntimeError, match="earlier rank error"):   # aborted comms: no more calls
        run(lambda c: c.rank)
    run.close()


def test_simulated_group_has_no_gpu_sampling():
    """generate_ids samples on the GPU only where the ranks can (LlamaGPU): a NumPy group has no decode_sample."""
    cfg = LlamaConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=32)
    group = TPGroup.simulated(cfg, random_weights(cfg, seed=1), 2)
    assert not hasattr(group, "decode_sample")
    with pytest.raises(AttributeError):
        group.no_such_thing


def test_rank_threads_with_on_error_break_once_and_refuse_later_calls():
    from vbw_cupy.dist import RankThreads
    calls = []
    run = RankThreads([_Rank(r) for r in range(3)], on_error=lambda: calls.append(1))

    def body(c):
        if c.rank:
            raise ValueError(f"rank {c.rank} failed")
        return c.rank
    with pytest.raises(ValueError, match="failed"):
        run(body)
    assert calls == [1]                       # once, though two ranks failed
    with pytest.raises(RuntimeError, match="earlier rank error"):
        run(lambda c: c.rank)
    run.close()


def test_rank_threads_drop_stale_results_and_refuse_calls_from_a_rank():
    import gc
    import weakref
    from vbw_cupy.dist import RankThreads
    run = RankThreads([_Rank(r) for r in range(2)])
    run._done.put((0, 0, None, "stale"))      # what a call interrupted on the host leaves behind
    assert run(lambda c: c.rank) == [0, 1]
    with pytest.raises(RuntimeError, match="cannot call its own group"):
        run(lambda c: run(lambda d: d.rank))

    class Held:
        pass

    def make():
        held = Held()
        return weakref.ref(held), (lambda c: held is not None)
    ref, fn = make()
    assert run(fn) == [True, True]
    del fn
    gc.collect()
    assert ref() is None                      # an idle rank thread keeps no closure alive
    run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run(lambda c: c.rank)


# ---------------------------------------------------------------------------------------------- launcher
_RANK_SCRIPT = """
import os, sys, time
from vbw_cupy.dist.launch import env_rank, rendezvous
rank, size, folder = env_rank()
got = rendezvous(folder, rank, lambda: b"id of rank 0: " + str(os.getpid()).encode())
with open(os.path.join(sys.argv[1], f"rank{rank}"), "wb") as f:
    f.write(f"{rank} {size} ".encode() + got)
if len(sys.argv) > 2 and rank == int(sys.argv[2]):
    sys.exit(3)
if len(sys.argv) > 2:
    time.sleep(60)
"""


def _script(tmp_path):
    path = tmp_path / "rank_script.py"
    path.write_text(_RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    return str(path), out


def test_launch_runs_every_rank_with_one_rendezvous(tmp_path):
    from vbw_cupy.dist.launch import launch
    script, out = _script(tmp_path)
    assert launch([script, str(out)], nproc=3) == 0
    lines = [(out / f"rank{r}").read_bytes().split(b" ", 2) for r in range(3)]
    assert [(int(r), int(s)) for r, s, _ in lines] == [(0, 3), (1, 3), (2, 3)]
    ids = {i for _, _, i in lines}
    assert len(ids) == 1 and ids.pop().startswith(b"id of rank 0: ")   # every rank got rank 0's id


def test_launch_stops_the_others_when_a_rank_fails(tmp_path):
    from vbw_cupy.dist.launch import launch
    script, out = _script(tmp_path)
    t0 = time.perf_counter()
    assert launch([script, str(out), "1"], nproc=3, grace=2.0) == 3    # rank 1's status; ranks 0 and 2 sleep 60 s
    assert time.perf_counter() - t0 < 30


def test_launch_arguments_and_environment_errors(monkeypatch, tmp_path):
    from vbw_cupy.dist import launch as L
    with pytest.raises(ValueError, match="nproc"):
        L.launch(["x.py"], nproc=0)
    with pytest.raises(ValueError, match="script"):
        L.launch([], nproc=2)
    with pytest.raises(SystemExit):
        L.main(["--nproc", "0", "x.py"])
    for k in (L.ENV_RANK, L.ENV_SIZE, L.ENV_RDZV):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="not started by the launcher"):
        L.env_rank()
    with pytest.raises(TimeoutError, match="rank 0 wrote no NCCL id"):
        L.rendezvous(tmp_path, 1, lambda: b"", timeout=0.1)


def test_nccl_from_env_passes_rank_0s_unique_id(monkeypatch, tmp_path):
    """The id NCCL gives rank 0 (128 signed chars) reaches NcclComm.from_unique_id unchanged."""
    from vbw_cupy.dist import comm as C
    from vbw_cupy.dist import launch as L
    uid = tuple(int(x) for x in np.random.default_rng(0).integers(-128, 128, 128))

    class FakeNccl:
        @staticmethod
        def get_unique_id():
            return uid
    got = {}
    monkeypatch.setattr(C, "_nccl", lambda: FakeNccl)
    monkeypatch.setattr(C, "_visible_gpus", lambda: 2)
    class Made:
        def activate(self):
            got["active"] = True
    monkeypatch.setattr(C.NcclComm, "from_unique_id",
                        classmethod(lambda cls, u, r, s: got.update(u=u, r=r, s=s) or Made()))
    monkeypatch.setenv(L.ENV_RANK, "0")
    monkeypatch.setenv(L.ENV_SIZE, "2")
    monkeypatch.setenv(L.ENV_RDZV, str(tmp_path))
    C.NcclComm.from_env()
    assert got == {"u": uid, "r": 0, "s": 2, "active": True}
    monkeypatch.setenv(L.ENV_RANK, "1")   # rank 1 (another process: its own count of exchanges) reads it
    monkeypatch.setattr(L, "_used", {})
    C.NcclComm.from_env(timeout=1.0)
    assert got == {"u": uid, "r": 1, "s": 2, "active": True}
    monkeypatch.setenv(L.ENV_SIZE, "3")
    with pytest.raises(RuntimeError, match="3 ranks on 2 visible GPUs"):
        C.NcclComm.from_env()


def _wait_gone(pid, what, timeout=10.0):
    """Until process `pid` has ended (or is a zombie, which init reaps once its parent has exited)."""
    import os
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0]
        except (ProcessLookupError, OSError):
            return
        if state == "Z":
            return
        assert time.monotonic() < deadline, f"{what} pid {pid} still runs"
        time.sleep(0.05)


def test_launcher_stopped_by_sigterm_stops_its_ranks(tmp_path):
    import signal
    import subprocess
    import sys
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], 'pid%s' % os.environ['VBW_RANK']), 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "vbw_cupy.dist.launch", "--nproc", "2", "--grace", "1",
                                 str(script), str(tmp_path)])
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        _wait_gone(pid, "rank")


def test_launcher_stops_what_a_failed_rank_left_in_its_group(tmp_path):
    # a rank that exits leaves a helper in its process group ignoring SIGTERM: that group got no signal at all
    # (only ranks still running were stopped), and the helper ran on under init
    from vbw_cupy.dist.launch import launch
    script = tmp_path / "leaver.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "if os.environ['VBW_RANK'] == '1':\n"
        "    h = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "    open(os.path.join(sys.argv[1], 'helper'), 'w').write(str(h.pid))\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(5)\n"
        "time.sleep(60)\n")
    assert launch([str(script), str(tmp_path)], nproc=2, grace=1.0) == 5
    _wait_gone(int((tmp_path / "helper").read_text()), "the failed rank's helper")


def test_each_rendezvous_of_a_run_has_its_own_id(tmp_path, monkeypatch):
    """The n-th exchange of a process reads the n-th id rank 0 wrote (a second communicator never picks up the
    first one's id)."""
    from vbw_cupy.dist import launch as L
    monkeypatch.setattr(L, "_used", {})
    assert [L.rendezvous(tmp_path, 0, lambda: b"first"), L.rendezvous(tmp_path, 0, lambda: b"second")] == \
        [b"first", b"second"]
    monkeypatch.setattr(L, "_used", {})   # rank 1, another process
    assert [L.rendezvous(tmp_path, 1, None, timeout=1), L.rendezvous(tmp_path, 1, None, timeout=1)] == \
        [b"first", b"second"]
