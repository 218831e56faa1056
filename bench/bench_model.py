"""The Llama model end to end: decode tokens/s and prefill time of vbw_cupy's LlamaGPU against a plain torch fp16
implementation of the same model and weights (static KV cache, SDPA, its decode step in a CUDA graph), and
against the memory roofline (bytes a decode step must read / the copy bandwidth measured in the same run).

Shapes (random weights): stories110M (dim 768, 12 layers, 12 heads, hidden 2048, vocab 32000) and a Llama-2-7B
shape (dim 4096, 32 layers, 32 heads, hidden 11008, vocab 32000); prompt 512 tokens, then 248 decode steps (31 chunks of 8), batch 1
and 16. Either side decodes as `generate` does: CHUNK steps replayed from one CUDA graph a call, each step's B next
tokens (greedy, sampled on the GPU) fed back on the device and copied to the host; tokens/s = B * steps / wall
time. "1 step/call" is our decode_sample loop (one graph replay and one copy to the host a step).

A model's start is timed too (stories110M, nvfp4, batch 1, in fresh processes): the first prefill and the first
8 decode steps with an empty kernel cache (cold: every kernel compiled by NVRTC) and again with the disk cache
that run left (warm), phase by phase, so what dominates a first call shows.

    python bench/bench_model.py [--quick] [--json PATH]      # the table
    pytest bench/bench_model.py --benchmark-only             # pytest-benchmark (stories110M, batch 1)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy import _peers, _timing  # noqa: E402
from vbw_cupy.fp4 import FP4Tensor  # noqa: E402
from vbw_cupy.models import LlamaConfig, LlamaGPU  # noqa: E402
from vbw_cupy.models.generate import CHUNK  # noqa: E402
from vbw_cupy.models.llama import random_weights  # noqa: E402

SHAPES = {
    "stories110M": LlamaConfig(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                               seq_len=4096),
    "7B": LlamaConfig(dim=4096, hidden_dim=11008, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                      seq_len=4096),
}
PROMPT, NEW = 512, 256


def _weights(cfg, seed=0):
    import cupy as cp
    return random_weights(cfg, seed=seed, xp=cp, dtype=np.float16)


def step_bytes(model: LlamaGPU, B: int, ctx: float) -> float:
    """Bytes a decode step must read: every linear weight as stored, the embedding rows, K and V of the context."""
    c = model.config
    lin = [L[n] for L in model.layers for n in ("wqkv", "wo", "w13", "w2")] + [model.classifier]
    w = 0
    for l in lin:
        t = l.w
        w += sum(a.nbytes for a in (t.data, t.scales) if a is not None) if isinstance(t, FP4Tensor) else t.nbytes
    kv = B * ctx * c.n_layers * 2 * c.kv_dim * 2
    return w + kv + B * c.dim * 4


# ------------------------------------------------------------------------------------------------ ours
def _decode_steps(steps: int) -> int:
    """Decode steps timed after a prefill that samples the first token: whole chunks (at least one)."""
    return max(CHUNK, (steps - 1) // CHUNK * CHUNK)


def ours(cfg, fmt, B, weights, steps=NEW, prompt=PROMPT):
    import cupy as cp
    model = LlamaGPU(cfg, weights, fmt)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(B)]
    slots = list(range(B))
    res = {"side": f"vbw_cupy {fmt}", "B": B}
    n = _decode_steps(steps)
    cache = model.new_cache(B, prompt + n)
    for rep in range(2):   # the first run builds plans, compiles and captures the graphs; the second replays them
        for chunk in (CHUNK, 1):   # as generate runs it, then one step a call
            for s in slots:
                cache.free(s)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            logits = model.prefill(prompts, cache, slots)
            tok = logits.argmax(axis=1).get()
            t1 = time.perf_counter()
            for _ in range(n // chunk):
                tok = model.decode_steps(tok, cache, slots, chunk)[-1]
            t2 = time.perf_counter()
            if chunk == CHUNK:
                res.update(prefill_ms=(t1 - t0) * 1e3, decode_tok_s=B * n / (t2 - t1))
                if rep == 0:
                    res["first_run_s"] = t2 - t0
            else:
                res["decode_tok_s_1step"] = B * n / (t2 - t1)
    res["bytes_per_step"] = step_bytes(model, B, prompt + n / 2)
    return model, res


# ----------------------------------------------------------------------------------------------- torch
class TorchLlama:
    """A plain torch fp16 Llama with a static KV cache [L, B, Hkv, max_len, D]; the decode step reads the
    position from a device tensor, so it can be captured in a CUDA graph."""

    def __init__(self, cfg, w, B, max_len):
        import torch
        t = lambda a: torch.from_dlpack(a).to(torch.float16)
        self.cfg, self.torch = cfg, torch
        self.emb = t(w.token_embedding)
        self.layers = [dict(att=t(L.rms_att), ffn=t(L.rms_ffn), wqkv=torch.cat([t(L.wq), t(L.wk), t(L.wv)]),
                            wo=t(L.wo), w13=torch.cat([t(L.w1), t(L.w3)]), w2=t(L.w2)) for L in w.layers]
        self.norm, self.cls = t(w.rms_final), t(w.classifier)
        D = cfg.head_dim
        inv = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device="cuda") / D)
        ang = torch.arange(max_len, dtype=torch.float64, device="cuda")[:, None] * inv[None]
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        shape = (cfg.n_layers, B, cfg.n_kv_heads, max_len, D)
        self.k = torch.zeros(shape, dtype=torch.float16, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len

    def _rms(self, x, w):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).half() * w

    def _rope(self, x, pos):  # x [B, H, T, D], adjacent pairs
        c, s = self.cos[pos][:, None], self.sin[pos][:, None]   # [B, 1, T, D/2]
        a, b = x[..., 0::2].float(), x[..., 1::2].float()
        return self.torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).half()

    def forward(self, tokens, pos):
        """tokens [B, T], pos [B, T] (int64 device): logits [B, T, vocab]; K, V stored at pos."""
        torch, cfg = self.torch, self.cfg
        F = torch.nn.functional
        B, T = tokens.shape
        D, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        x = self.emb[tokens]
        key_pos = torch.arange(self.max_len, device="cuda")
        mask = key_pos[None, None, None, :] <= pos[:, None, :, None]       # [B, 1, T, max_len]
        bidx = torch.arange(B, device="cuda")[:, None]
        for i, L in enumerate(self.layers):
            qkv = F.linear(self._rms(x, L["att"]), L["wqkv"])
            q, k, v = qkv.split([cfg.dim, cfg.kv_dim, cfg.kv_dim], -1)
            q = self._rope(q.view(B, T, Hq, D).transpose(1, 2), pos)
            k = self._rope(k.view(B, T, Hkv, D).transpose(1, 2), pos)
            self.k[i][bidx, :, pos] = k.transpose(1, 2)
            self.v[i][bidx, :, pos] = v.view(B, T, Hkv, D)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask,
                                               enable_gqa=Hq != Hkv)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, cfg.dim), L["wo"])
            g, u = F.linear(self._rms(x, L["ffn"]), L["w13"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, L["w2"])
        return F.linear(self._rms(x, self.norm), self.cls).float()


def peer(cfg, B, weights, steps=NEW, prompt=PROMPT):
    import torch
    m = TorchLlama(cfg, weights, B, prompt + _decode_steps(steps) + 2)
    g = torch.Generator(device="cpu").manual_seed(1)
    toks = torch.randint(3, cfg.vocab_size, (B, prompt), generator=g).cuda()
    pos = torch.arange(prompt, device="cuda")[None].expand(B, -1).contiguous()
    res = {"side": "torch fp16", "B": B}
    with torch.no_grad():
        m.forward(toks, pos)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nxt = m.forward(toks, pos)[:, -1].argmax(-1)
        torch.cuda.synchronize()
        res["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        tok_in = nxt[:, None].clone()
        pos_in = torch.full((B, 1), prompt, device="cuda", dtype=torch.long)
        ids = torch.zeros((CHUNK, B), device="cuda", dtype=torch.long)   # each step's ids, copied after a chunk

        def step(i=0):
            out = m.forward(tok_in, pos_in)[:, -1].argmax(-1)
            ids[i].copy_(out)
            tok_in.copy_(out[:, None])
            pos_in.add_(1)

        def warm():
            for _ in range(2):
                step()

        def chunk():   # CHUNK steps a replay, as ours
            for i in range(CHUNK):
                step(i)
        graph = _peers.torch_cuda_graph(warm, chunk)
        for mode in ("eager", "graph"):
            pos_in.fill_(prompt)
            torch.cuda.synchronize()
            n = _decode_steps(steps) if mode == "graph" else min(steps - 1, 32)
            t0 = time.perf_counter()
            for _ in range(n // CHUNK if mode == "graph" else n):
                graph.replay() if mode == "graph" else step()
                ids.cpu()
            res[f"decode_tok_s_{mode}"] = B * n / (time.perf_counter() - t0)
    res["decode_tok_s"] = res["decode_tok_s_graph"]
    m = None   # (the model's memory goes back to torch's pool before empty_cache; the closures above hold m too)
    torch.cuda.empty_cache()
    return res


def profile_step(model, B=1, prompt=PROMPT):
    """Per-kernel GPU time of one eager decode step (torch's profiler sees every kernel of the process)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cache = model.new_cache(B, prompt + 8)
    rng = np.random.default_rng(2)
    model.prefill([rng.integers(3, model.config.vocab_size, prompt).tolist() for _ in range(B)], cache, range(B))
    model.decode([5] * B, cache, range(B), graph=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.decode([5] * B, cache, range(B), graph=False)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            rows[e.key] = rows.get(e.key, 0.0) + us
    total = sum(rows.values())
    return total, sorted(rows.items(), key=lambda kv: -kv[1])[:12]


def run(quick=False):
    import cupy as cp
    copy_gbs = _timing.copy_bandwidth_gbs(1 << 30)
    rows = []
    plan = [("stories110M", (1, 16)), ("7B", (1,) if quick else (1, 16))]
    for name, batches in plan:
        cfg = SHAPES[name]
        w = _weights(cfg)
        for B in batches:
            for fmt in ("nvfp4", "fp16"):
                model, r = ours(cfg, fmt, B, w)
                r["roofline_tok_s"] = B * copy_gbs * 1e9 / r["bytes_per_step"]
                rows.append({"shape": name, **r})
                if name == "7B" and B == 1 and fmt == "nvfp4":
                    total, top = profile_step(model)
                    print(f"\none eager decode step, 7B nvfp4 B=1: {total / 1e3:.3f} ms of kernels")
                    for k, us in top:
                        print(f"  {us / 1e3:8.3f} ms  {100 * us / total:5.1f}%  {k[:100]}")
                del model
                cp.get_default_memory_pool().free_all_blocks()
            rows.append({"shape": name, **peer(cfg, B, w)})
        if not quick:   # prefill 2048 tokens, batch 1
            for fmt in ("nvfp4", "fp16"):
                _, r = ours(cfg, fmt, 1, w, steps=2, prompt=2048)
                rows.append({"shape": name, "side": f"vbw_cupy {fmt}", "B": 1, "prefill2048_ms": r["prefill_ms"]})
            r = peer(cfg, 1, w, steps=2, prompt=2048)
            rows.append({"shape": name, "side": "torch fp16", "B": 1, "prefill2048_ms": r["prefill_ms"]})
        del w
        cp.get_default_memory_pool().free_all_blocks()
    return rows, copy_gbs


# --------------------------------------------------------------------------------------------- first call
# weights: random weights generated on the GPU and quantized (on a cold cache, CuPy compiles the generator too)
START_PHASES = ("import", "weights", "first prefill", "first 8 steps", "next 8 steps")


def _first_call(name: str, fmt: str, t0: float) -> dict:
    """Seconds of each phase of a fresh process's first generation, from t0 (the process's first statement; run
    in a subprocess by start_times)."""
    t = [t0]
    import cupy as cp
    from vbw_cupy.models import LlamaGPU as Model
    cp.cuda.Device().synchronize()
    t.append(time.perf_counter())
    cfg = SHAPES[name]
    model = Model(cfg, _weights(cfg), fmt)
    cp.cuda.Device().synchronize()
    t.append(time.perf_counter())
    cache = model.new_cache(1, PROMPT + 2 * CHUNK + 1)
    tok = model.prefill([list(range(3, 3 + PROMPT))], cache, [0]).argmax(axis=1).get()
    t.append(time.perf_counter())
    for _ in range(2):
        tok = model.decode_steps(tok, cache, [0], CHUNK)[-1]
        t.append(time.perf_counter())
    return {k: b - a for k, a, b in zip(START_PHASES, t, t[1:])}


def start_times(name: str = "stories110M", fmt: str = "nvfp4") -> dict:
    """{"cold": phases, "warm": phases}: _first_call in a fresh process on empty kernel caches (ours and CuPy's),
    then again on the caches it left (VBW_CUPY_CACHE_DIR, CUPY_CACHE_DIR; tuning as configured)."""
    import subprocess
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import time; t0 = time.perf_counter(); import json, sys; sys.path.insert(0, {here!r}); "
            f"import bench_model; print('PHASES', json.dumps(bench_model._first_call({name!r}, {fmt!r}, t0)))")
    out = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, VBW_CUPY_CACHE_DIR=cache_dir, CUPY_CACHE_DIR=os.path.join(cache_dir, "cupy"),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
        for run_ in ("cold", "warm"):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PHASES ")), None)
            if r.returncode != 0 or line is None:
                raise RuntimeError(f"first-call run ({run_}) failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
            out[run_] = json.loads(line[len("PHASES "):])
    return out


def format_start(times: dict, name: str = "stories110M", fmt: str = "nvfp4") -> str:
    lines = [f"first call of a fresh process, {name} {fmt}, batch 1, prompt {PROMPT} (seconds; cold = empty "
             "kernel cache, warm = the cache the cold run left)",
             f"{'':5} " + " ".join(f"{p:>14}" for p in START_PHASES) + f" {'to 1st token':>13}"]
    for run_, ph in times.items():
        first = sum(ph[p] for p in START_PHASES[:3])
        lines.append(f"{run_:5} " + " ".join(f"{ph[p]:14.2f}" for p in START_PHASES) + f" {first:13.2f}")
    return "\n".join(lines)


def format_table(rows, copy_gbs):
    out = [f"copy bandwidth {copy_gbs:.0f} GB/s; prompt {PROMPT}, {_decode_steps(NEW)} decode steps timed; "
           f"{CHUNK} steps a CUDA graph; "
           "first run = the first prefill + decode of a shape (compiles, tunes, captures; the disk caches may be warm)",
           f"{'shape':12} {'side':16} {'B':>3} {'decode tok/s':>12} {'roofline':>9} {'frac':>5} "
           f"{'vs torch':>8} {'1 step/call':>11} {'prefill ms':>10} {'torch eager':>11} {'first run s':>11}"]
    for r in rows:
        if "decode_tok_s" not in r:
            continue
        t = next((p for p in rows if p["shape"] == r["shape"] and p["B"] == r["B"] and p["side"] == "torch fp16"
                  and "decode_tok_s" in p), None)
        frac = r["decode_tok_s"] / r["roofline_tok_s"] if "roofline_tok_s" in r else math.nan
        out.append(f"{r['shape']:12} {r['side']:16} {r['B']:>3} {r['decode_tok_s']:12.1f} "
                   f"{r.get('roofline_tok_s', math.nan):9.0f} {frac:5.2f} "
                   f"{r['decode_tok_s'] / t['decode_tok_s'] if t else math.nan:8.2f} "
                   f"{r.get('decode_tok_s_1step', math.nan):11.1f} {r['prefill_ms']:10.1f} "
                   f"{r.get('decode_tok_s_eager', math.nan):11.1f} {r.get('first_run_s', math.nan):11.2f}")
    for r in rows:
        if "prefill2048_ms" in r:
            t = next(p for p in rows if p["shape"] == r["shape"] and p["side"] == "torch fp16" and "prefill2048_ms" in p)
            out.append(f"prefill 2048 {r['shape']:12} {r['side']:16} {r['prefill2048_ms']:8.1f} ms  "
                       f"{t['prefill2048_ms'] / r['prefill2048_ms']:.2f}x torch")
    return "\n".join(out)


try:  # (the script runs without pytest; under pytest the benchmark is a GPU one, skipped without a device)
    import pytest
    _gpu_mark = pytest.mark.gpu
except ImportError:
    _gpu_mark = lambda f: f  # noqa: E731


@_gpu_mark
def test_stories110m_decode(benchmark):
    import pytest
    pytest.importorskip("cupy")
    cfg = SHAPES["stories110M"]
    model, r = ours(cfg, "nvfp4", 1, _weights(cfg), steps=32)
    cache = model.new_cache(1, PROMPT + 64)
    model.prefill([[1] * PROMPT], cache, [0])
    tok = [5]
    benchmark.pedantic(lambda: model.decode_sample(tok, cache, [0]), rounds=30, iterations=1, warmup_rounds=2)
    benchmark.extra_info.update(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="7B at batch 1 only, no 2048-token prefill")
    ap.add_argument("--json")
    ap.add_argument("--no-pdl", action="store_true",
                    help="plain launches in the decode graph (A/B against programmatic dependent launch)")
    a = ap.parse_args(argv)
    if a.no_pdl:
        from vbw_cupy.models import gpu
        gpu._PDL = False
    start = None if a.quick else start_times()
    rows, copy_gbs = run(a.quick)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows, "start": start}, f, indent=1)
    print(format_table(rows, copy_gbs))
    if start is not None:
        print(format_start(start))


if __name__ == "__main__":
    main()
