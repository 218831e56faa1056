"""Issue 19's bars on 2 GPUs of one host, each against the same code on 1 GPU (random weights and inputs):

- tensor-parallel Llama, 7B shape, nvfp4 weights: decode tokens/s at batch 16 (>= 1.6x), prefill of one
  8192-token prompt (>= 1.7x); `TPGroup.on_gpus(size=2)` (a `TPLlamaGPU` a rank, each decode step one CUDA
  graph per rank with its all-reduces) against `LlamaGPU` on one GPU. Decode is the user's loop of
  `decode_sample` (greedy ids back on the host every step) after a warm-up of the same steps (graphs
  captured); prefill is `prefill` after the same call once.
- ring attention, causal, S = 256k total, D = 128 (32 query heads, 8 KV heads), float16: >= 1.8x the one-GPU
  `flash_attention` at the same S, or, where one GPU cannot hold S, >= 0.85 x 2 x the one-GPU TFLOP/s at the
  largest S it holds.

Ranks are threads of this process, one GPU each, joined by NCCL (`NcclComm.init_all`). Every timed call starts
after an all-reduce and a synchronize of every rank and ends with a synchronize of every rank; compile and
autotune runs are warm-ups outside the timings.

    python bench/bench_dist.py [--quick] [--json PATH] [--only model|ring|allreduce] [--spmd]

A script, not a pytest-benchmark file: its timings span several GPUs and threads, which pytest-benchmark's
host timer over one callable does not describe.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy.dist import (NcclComm, RankThreads, TPGroup, TPLlamaGPU, ring_attention, run_ranks,  # noqa: E402
                           zigzag_bounds)
from vbw_cupy.models import LlamaConfig, LlamaGPU  # noqa: E402
from vbw_cupy.models.llama import random_weights  # noqa: E402

SHAPE_7B = LlamaConfig(dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                       seq_len=8192 + 256)
BARS = {"decode": 1.6, "prefill": 1.7, "ring": 1.8, "ring_tflops_share": 0.85}
QUICK_CFG = LlamaConfig(dim=1024, hidden_dim=2816, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=32000,
                        seq_len=2048 + 64)
# (config, batch, prompt, steps, prefill tokens) of the model runs; a decode run's contexts stay in one bucket:
# quick timed 73..88 then + 30 graph replays <= 128, full timed 169..216 then + 30 <= 256
_MODEL_RUNS = {True: (QUICK_CFG, 16, 56, 16, 2048), False: (SHAPE_7B, 16, 120, 48, 8192)}


# ------------------------------------------------------------------------------------------------ model
def _sync(model) -> None:
    """Wait for every GPU the model runs on (a TPGroup's ranks return once their work is queued); one rank of a
    group of processes (a TPLlamaGPU with its comm) also meets the others, so they start timing together."""
    import cupy as cp
    if isinstance(model, TPGroup):
        model._run(lambda comm: cp.cuda.Device().synchronize())
    elif getattr(model, "comm", None) is not None:
        cp.cuda.Device().synchronize()
        model.comm.all_reduce(cp.zeros(1, cp.float32))
        cp.cuda.Device().synchronize()
    else:
        cp.cuda.Device().synchronize()


def _seconds(model, fn, reps: int) -> float:
    """Median wall time of fn() over reps, every GPU synchronized before and after; one untimed call first
    (compiles, plans, captures the decode graphs of the same shapes)."""
    fn()
    times = []
    for _ in range(reps):
        _sync(model)
        t0 = time.perf_counter()
        fn()
        _sync(model)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


GRAPH_REPS = 30


def _graph_step_ms(model, reps: int = GRAPH_REPS) -> list:
    """GPU time of one decode step, its captured graph replayed `reps` times back to back (no host work
    between steps), per rank (CUDA events). Set beside the host loop's step time it splits a TP step into GPU
    work (all-reduces included) and what the host adds (GIL, rank skew). The replays advance the cache's
    device lengths by `reps` (the caller leaves room for them in the context bucket)."""
    import cupy as cp

    def one(m):
        st = next(iter(m._graphs.values()))
        g = st.graphs[max(k for k in st.graphs if k[1] == 1)]   # (bucket, steps): the one-step graphs
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(g.stream)
        for _ in range(reps):
            g.graph.launch(stream=g.stream)
        end.record(g.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / reps
    if isinstance(model, TPGroup):
        return model._run(lambda comm: one(model.models[comm.rank]))
    return [one(model)]


def _inputs(cfg: LlamaConfig, batch: int, prompt: int, prefill_len: int):
    """The decode prompts and the long prefill prompt (the same in every process: seeded)."""
    rng = np.random.default_rng(0)
    decode_prompts = [[1] + rng.integers(3, cfg.vocab_size, prompt - 1).tolist() for _ in range(batch)]
    return decode_prompts, [[1] + rng.integers(3, cfg.vocab_size, prefill_len - 1).tolist()]


def _measure(model, decode_prompts, long_prompt, steps: int) -> dict:
    """Decode tokens/s of the prompts (`steps` steps of `decode_sample`, the user's loop: greedy ids back on the
    host each step, graphs replayed, within one context bucket), the host step and the graph alone, and
    prefill tokens/s of the long prompt. `model`: a LlamaGPU, a TPGroup, or one process's TPLlamaGPU."""
    batch, prompt, prefill_len = len(decode_prompts), len(decode_prompts[0]), len(long_prompt[0])
    slots = list(range(batch))
    cache = model.new_cache(batch, prompt + 2 * steps + GRAPH_REPS + 2)
    model.prefill(decode_prompts, cache, slots)
    held = [np.full(batch, 5)]

    def decode():
        for _ in range(steps):
            held[0] = model.decode_sample(held[0], cache, slots)
    # the warm-up, the timed run and the graph replays stay in one context bucket (a power of two)
    t_dec = _seconds(model, decode, 1)
    row = {"decode_tokens_per_s": batch * steps / t_dec, "decode_step_ms": t_dec / steps * 1e3,
           "decode_graph_ms": max(_graph_step_ms(model))}
    pcache = model.new_cache(1, prefill_len)
    row["prefill_tokens_per_s"] = prefill_len / _seconds(model, lambda: model.prefill(long_prompt, pcache, [0]), 2)
    return row


def bench_model(cfg: LlamaConfig, fmt: str, batch: int, prompt: int, steps: int, prefill_len: int, sizes) -> dict:
    """`_measure` per tensor-parallel size: LlamaGPU on one GPU, a TPGroup (one thread a GPU) on more."""
    print(f"random weights for dim {cfg.dim}, {cfg.n_layers} layers ...", file=sys.stderr)
    weights = random_weights(cfg, seed=0, dtype=np.float16)
    decode_prompts, long_prompt = _inputs(cfg, batch, prompt, prefill_len)
    out = {}
    for size in sizes:
        if size == 1:
            import cupy as cp
            with cp.cuda.Device(0):
                model = LlamaGPU(cfg, weights, fmt)
        else:
            model = TPGroup.on_gpus(cfg, weights, size, fmt)
        out[size] = row = _measure(model, decode_prompts, long_prompt, steps)
        if size > 1:
            model.close()
        print(f"tp {size}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), file=sys.stderr)
        model = None   # freed before the next size
        _free_all(size)
    return out


def _spmd_rank(path: str, quick: bool, fmt: str) -> int:
    """One process of `--spmd` (started by the launcher): its TPLlamaGPU, measured with the others; rank 0
    writes the row to `path`."""
    comm = NcclComm.from_env()
    cfg, batch, prompt, steps, prefill_len = _MODEL_RUNS[quick]
    model = TPLlamaGPU(cfg, random_weights(cfg, seed=0, dtype=np.float16), comm, fmt)
    decode_prompts, long_prompt = _inputs(cfg, batch, prompt, prefill_len)
    row = _measure(model, decode_prompts, long_prompt, steps)
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(row, f)
    return 0


def _spmd(size: int, quick: bool, fmt: str) -> dict:
    """The TP model one process a GPU (python -m vbw_cupy.dist.launch): rank 0's row."""
    import tempfile
    from vbw_cupy.dist.launch import launch
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "row.json")
        argv = [os.path.abspath(__file__), "--spmd-rank", path, "--fmt", fmt] + (["--quick"] if quick else [])
        rc = launch(argv, nproc=size)
        if rc:
            raise RuntimeError(f"the {size} processes of --spmd failed (status {rc})")
        with open(path) as f:
            return json.load(f)


# ------------------------------------------------------------------------------------------------ ring
def _free_all(size):
    import cupy as cp
    for d in range(size):
        with cp.cuda.Device(d):
            cp.cuda.Device().synchronize()
            cp.get_default_memory_pool().free_all_blocks()


def _timed_on_ranks(comms, make, call, reps: int) -> float:
    """Median over reps of the wall time of call(state) on every rank at once; make(comm) builds each rank's
    state (outside the timing); one untimed call first."""
    import cupy as cp

    def body(comm):
        state = make(comm)
        call(comm, state)
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(reps):
            comm.all_reduce(cp.zeros(1, cp.float32))    # start together
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            call(comm, state)
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
        return times
    per_rank = run_ranks(body, comms)
    return statistics.median(max(ts) for ts in zip(*per_rank))


def ring_seconds(S: int, size: int, Hq: int, Hkv: int, D: int, reps: int) -> float:
    """Seconds of causal ring attention over `size` GPUs (size 1: one `flash_attention` call, the baseline)."""
    import cupy as cp
    from vbw_cupy import flash_attention
    b = zigzag_bounds(S, size)

    def make(comm):
        L = int(sum(b[c + 1] - b[c] for c in (comm.rank, 2 * size - 1 - comm.rank)))
        rnd = cp.random.default_rng(comm.rank)
        return [rnd.standard_normal((1, L, h, D), dtype=cp.float32).astype(cp.float16) for h in (Hq, Hkv, Hkv)]

    if size == 1:
        comms = NcclComm.init_all([0])
        return _timed_on_ranks(comms, make, lambda c, s: flash_attention(*s, causal=True), reps)
    comms = NcclComm.init_all(range(size))
    return _timed_on_ranks(comms, make, lambda c, s: ring_attention(*s, c, seq_len=S, causal=True), reps)


def causal_tflops(S: int, Hq: int, D: int, seconds: float) -> float:
    return 4.0 * S * S / 2 * Hq * D / seconds / 1e12


def bench_ring(S: int, Hq: int, Hkv: int, D: int, size: int, reps: int) -> dict:
    import cupy as cp
    t_ring = ring_seconds(S, size, Hq, Hkv, D, reps)
    _free_all(size)
    out = {"S": S, "ring_s": t_ring, "ring_tflops": causal_tflops(S, Hq, D, t_ring)}
    try:
        t_one = ring_seconds(S, 1, Hq, Hkv, D, reps)
        out.update(one_s=t_one, one_tflops=causal_tflops(S, Hq, D, t_one), speedup=t_one / t_ring,
                   bar=f">= {BARS['ring']}x", passed=t_one / t_ring >= BARS["ring"])
    except cp.cuda.memory.OutOfMemoryError:
        _free_all(size)
        s1 = S // 2
        while True:   # the largest power-of-two fraction of S one GPU holds
            try:
                t_one = ring_seconds(s1, 1, Hq, Hkv, D, reps)
                break
            except cp.cuda.memory.OutOfMemoryError:
                _free_all(size)
                s1 //= 2
        one_tflops = causal_tflops(s1, Hq, D, t_one)
        share = out["ring_tflops"] / (size * one_tflops)
        out.update(one_S=s1, one_s=t_one, one_tflops=one_tflops, tflops_share=share,
                   bar=f">= {BARS['ring_tflops_share']} of {size}x one-GPU TFLOP/s",
                   passed=share >= BARS["ring_tflops_share"])
    _free_all(size)
    return out


# ------------------------------------------------------------------------------------------------ all-reduce
def bench_allreduce(size: int, reps: int = 20) -> dict:
    """Microseconds per NCCL all-reduce (float16, in place) of a decode step's [16, 4096] and a prefill's
    [8192, 4096], eager and inside a captured graph of 64 (a 7B model's count a step), per rank, slowest
    rank reported."""
    import cupy as cp
    comms = NcclComm.init_all(range(size))
    run, out = RankThreads(comms), {}
    for rows in (16, 8192):
        def body(comm):
            x = cp.ones((rows, 4096), dtype=cp.float16)
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                comm.all_reduce(x)   # NCCL sets itself up outside the capture
                stream.synchronize()
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for _ in range(64 * reps // 4):
                    comm.all_reduce(x)
                end.record()
                end.synchronize()
                eager = cp.cuda.get_elapsed_time(start, end) * 1e3 / (64 * reps // 4)
                stream.begin_capture()
                for _ in range(64):
                    comm.all_reduce(x)
                graph = stream.end_capture()
                graph.launch(stream=stream)
                start.record()
                for _ in range(reps):
                    graph.launch(stream=stream)
                end.record()
                end.synchronize()
                return eager, cp.cuda.get_elapsed_time(start, end) * 1e3 / (64 * reps)
        res = run(body)
        out[f"{rows}x4096_eager_us"] = max(r[0] for r in res)
        out[f"{rows}x4096_graph_us"] = max(r[1] for r in res)
    run(lambda comm: comm.close())
    run.close()
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes: checks the script, not the bars")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--only", choices=("model", "ring", "allreduce"))
    p.add_argument("--size", type=int, default=2, help="GPUs (default 2)")
    p.add_argument("--fmt", default="nvfp4", choices=("fp16", "nvfp4", "mxfp4"))
    p.add_argument("--spmd", action="store_true", help="model: also the TP model one process a GPU (the launcher)")
    p.add_argument("--spmd-rank", metavar="PATH", help=argparse.SUPPRESS)   # a process of --spmd
    args = p.parse_args(argv)
    if args.spmd_rank:
        return _spmd_rank(args.spmd_rank, args.quick, args.fmt)
    import cupy as cp
    have = cp.cuda.runtime.getDeviceCount()
    if have < args.size:
        print(f"bench_dist: needs {args.size} GPUs, {have} visible", file=sys.stderr)
        return 2
    os.environ.setdefault("VBW_CUPY_AUTOTUNE", "0")
    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "gpus": args.size}
    if args.only in (None, "model"):
        cfg, batch, prompt, steps, prefill_len = _MODEL_RUNS[args.quick]
        m = bench_model(cfg, args.fmt, batch, prompt, steps, prefill_len, (1, args.size))
        dec = m[args.size]["decode_tokens_per_s"] / m[1]["decode_tokens_per_s"]
        pre = m[args.size]["prefill_tokens_per_s"] / m[1]["prefill_tokens_per_s"]
        res["model"] = {"per_size": m, "decode_speedup": dec, "prefill_speedup": pre,
                        "decode_passed": dec >= BARS["decode"], "prefill_passed": pre >= BARS["prefill"]}
        print(f"model: decode {dec:.2f}x (bar {BARS['decode']}x), prefill {pre:.2f}x (bar {BARS['prefill']}x)")
        if args.spmd:
            row = res["model"]["spmd"] = _spmd(args.size, args.quick, args.fmt)
            print(f"model, one process a GPU: decode {row['decode_tokens_per_s'] / m[1]['decode_tokens_per_s']:.2f}x, "
                  f"prefill {row['prefill_tokens_per_s'] / m[1]['prefill_tokens_per_s']:.2f}x (" +
                  ", ".join(f"{k} {v:.4g}" for k, v in row.items()) + ")")
    if args.only in (None, "allreduce"):
        res["allreduce"] = a = bench_allreduce(args.size)
        print("all-reduce (us, slowest rank): " + ", ".join(f"{k} {v:.1f}" for k, v in a.items()))
    if args.only in (None, "ring"):
        S = 32768 if args.quick else 262144
        r = bench_ring(S, 32, 8, 128, args.size, 2 if args.quick else 3)
        res["ring"] = r
        print("ring: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
