"""paged_attention decode bandwidth: K/V bytes read per second against the device's copy bandwidth.

For batch {1, 8, 64} x context {512, 4096, 32768} x Hq/Hkv {32/8, 32/32} x block size {16, 128}, D = 128,
float16, every sequence at the full context, block tables shuffled. The kernel time is the median over CUDA-graph
replays of many back-to-back launches (so host launch overhead is out), rotating over enough copies of the cache
that every replay reads from DRAM, not L2. KV bandwidth = K + V bytes the call must read / time. The copy
peer is a cupy device-to-device copy of a buffer the size of K + V (at least 256 MB so it is not an L2 copy, at
most 2 GB), counted as bytes read + written, measured in the same run. When vbw_cupy.attention exists, the
peer flash_attention with Sq = 1 on a contiguous cache is timed too (cases up to 4 GB of K + V).

    pytest bench/bench_decode.py --benchmark-only          # pytest-benchmark, ratios in extra_info
    python bench/bench_decode.py [--quick] [--json PATH]    # the bandwidth table in one go
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy import _device  # noqa: E402
from vbw_cupy import _runtime as rt  # noqa: E402
from vbw_cupy import _timing  # noqa: E402
from vbw_cupy import paged  # noqa: E402

BATCHES = (1, 8, 64)
CONTEXTS = (512, 4096, 32768)
HEADS = ((32, 8), (32, 32))
BLOCKS = (16, 128)
D = 128
MIN_ROTATE_BYTES = 256 << 20     # rotate cache copies until at least this many K+V bytes (L2 is 50-60 MB)
CASES = list(itertools.product(BATCHES, CONTEXTS, HEADS, BLOCKS))
BAR_CASES = {(1, 32768, (32, 8), 16), (64, 4096, (32, 8), 16), (8, 512, (32, 8), 16)}
PLAIN_BAR = 0.70  # the call-path issue: paged_attention B=1 ctx 32k called plainly in a loop, fraction of copy


def _fill_random(cp, a, seed):
    """Random normal fp16 in chunks (a 34 GB cache must not need a 68 GB float32 temporary)."""
    flat = a.reshape(-1)
    rs = cp.random.RandomState(seed)
    step = 1 << 28
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rs.standard_normal(n, dtype=cp.float32).astype(a.dtype)


def _copy_gbs(cp, nbytes, detail=None):
    """Best of three device-to-device copies (cudaMemcpyAsync, cupy elementwise on uint8 and on float32
    views) of a buffer the size of K + V (clamped to [256 MB, 2 GB]), as GB/s of bytes read + written."""
    n = int(min(max(nbytes, 64 << 20), 2 << 30)) // 16 * 16
    src = cp.empty(n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    _fill_random(cp, src.view(cp.float16), 7)   # random bits: nothing compressible
    rt_ = cp.cuda.runtime
    ways = {
        "memcpy": lambda: rt_.memcpyAsync(dst.data.ptr, src.data.ptr, n, rt_.memcpyDeviceToDevice,
                                          cp.cuda.get_current_stream().ptr),
        "elementwise_u8": lambda: dst.__setitem__(Ellipsis, src),
        "elementwise_f32": lambda: dst.view(cp.float32).__setitem__(Ellipsis, src.view(cp.float32)),
    }
    res = {k: 2 * n / _timing.graph_time_ms([f], target_ms=20.0) / 1e6 for k, f in ways.items()}
    if detail is not None:
        detail.update(res)
    return max(res.values())


class Case:
    """Caches (rotated copies), block tables and replayable launches for one benchmark shape."""

    def __init__(self, B, ctx, Hq, Hkv, bs, dtype=np.float16, seed=0):
        import cupy as cp
        self.B, self.ctx, self.Hq, self.Hkv, self.bs = B, ctx, Hq, Hkv, bs
        self.kv_bytes = 2 * B * ctx * Hkv * D * np.dtype(dtype).itemsize
        self.copies = max(1, math.ceil(MIN_ROTATE_BYTES / self.kv_bytes))
        nblk = rt.cdiv(ctx, bs)
        total = self.copies * B * nblk
        self.k = cp.empty((total, bs, Hkv, D), dtype=dtype)
        self.v = cp.empty((total, bs, Hkv, D), dtype=dtype)
        _fill_random(cp, self.k, seed)
        _fill_random(cp, self.v, seed + 1)
        rng = np.random.default_rng(seed)
        perm = rng.permutation(total).astype(np.int32).reshape(self.copies, B, nblk)
        self.tables = [cp.asarray(perm[c]) for c in range(self.copies)]
        self.lens = cp.full((B,), ctx, dtype=cp.int32)
        self.q = cp.asarray(rng.standard_normal((B, Hq, D)).astype(dtype))
        self.out = cp.empty_like(self.q)
        self.launches = self.launches_for(None)

    def launches_for(self, cfg):
        return [paged._launch_for(self.q, self.k, self.v, t, self.lens, self.out, cfg, max_seqlen=self.ctx,
                                  explore=True) for t in self.tables]

    def time_ms(self, launches=None):
        return _timing.graph_time_ms([L.run for L in (launches or self.launches)])

    def peer_ms(self):
        """flash_attention with Sq = 1 on a contiguous cache (None when unavailable or too large)."""
        if importlib.util.find_spec("vbw_cupy.attention") is None or self.kv_bytes > (4 << 30):
            return None
        from vbw_cupy import attention
        if not hasattr(attention, "flash_attention"):
            return None
        k = self.k[self.tables[0]].reshape(self.B, -1, self.Hkv, D)[:, :self.ctx]
        v = self.v[self.tables[0]].reshape(self.B, -1, self.Hkv, D)[:, :self.ctx]
        q = self.q[:, None]
        try:
            return _timing.time_ms(lambda: attention.flash_attention(q, k, v), warmup=2, rep=10)
        except Exception as e:  # the peer is someone else's work in progress: report, do not fail
            print(f"  flash_attention peer failed: {type(e).__name__}: {e}", file=sys.stderr)
            return None

    def plain_ms(self, check="device"):
        """The public call in a Python loop (no graph), tables rotated: what a user's decode loop pays."""
        tables = itertools.cycle(self.tables)
        return _timing.time_ms(lambda: paged.paged_attention(self.q, self.k, self.v, next(tables), self.lens,
                                                             check=check, max_seqlen=self.ctx, out=self.out),
                               warmup=self.copies, rep=5, inner=30)

    def free(self):
        del self.k, self.v, self.tables, self.launches


def measure(case_key, with_peer=True, copy_cache={}):
    import cupy as cp
    B, ctx, (Hq, Hkv), bs = case_key
    c = Case(B, ctx, Hq, Hkv, bs)
    try:
        ms = c.time_ms()
        ckey = min(max(c.kv_bytes, MIN_ROTATE_BYTES), 2 << 30)
        if ckey not in copy_cache:
            detail = {}
            copy_cache[ckey] = (_copy_gbs(cp, ckey, detail), detail)
            print(f"  copy {ckey >> 20} MB: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in detail.items()),
                  file=sys.stderr, flush=True)
        copy = copy_cache[ckey][0]
        peer = c.peer_ms() if with_peer else None
        gbs = c.kv_bytes / ms / 1e6
        plain, plain_host = c.plain_ms("device"), c.plain_ms("host")
        return {"B": B, "ctx": ctx, "Hq": Hq, "Hkv": Hkv, "block_size": bs, "splits": c.launches[0].splits,
                "ms": ms, "kv_gbs": gbs, "copy_gbs": copy, "pct_copy": 100 * gbs / copy,
                "plain_ms": plain, "plain_pct_copy": 100 * c.kv_bytes / plain / 1e6 / copy,
                "plain_host_check_ms": plain_host,
                "peer_ms": peer, "peer_ratio": (peer / ms) if peer else None, "rotated_copies": c.copies}
    finally:
        c.free()
        cp.get_default_memory_pool().free_all_blocks()


def format_table(rows):
    """One line per case; '% best' is against the fastest copy measured in the run (the conservative one)."""
    best = max(r["copy_gbs"] for r in rows) if rows else 1.0
    head = f"{'batch':>5} {'ctx':>6} {'Hq/Hkv':>7} {'block':>5} {'splits':>6} {'us':>9} {'KV GB/s':>8} " \
           f"{'copy GB/s':>9} {'% copy':>7} {'% best':>7} {'fa Sq=1 x':>9} {'plain us':>9} {'plain %':>7} " \
           f"{'host-chk us':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        bar = " *" if (r["B"], r["ctx"], (r["Hq"], r["Hkv"]), r["block_size"]) in BAR_CASES else ""
        pr = f"{r['peer_ratio']:.2f}" if r.get("peer_ratio") else "-"
        lines.append(f"{r['B']:>5} {r['ctx']:>6} {str(r['Hq']) + '/' + str(r['Hkv']):>7} {r['block_size']:>5} "
                     f"{r['splits']:>6} {r['ms'] * 1e3:>9.1f} {r['kv_gbs']:>8.0f} {r['copy_gbs']:>9.0f} "
                     f"{r['pct_copy']:>6.1f}% {100 * r['kv_gbs'] / best:>6.1f}% {pr:>9} {r['plain_ms'] * 1e3:>9.1f} "
                     f"{r['plain_pct_copy']:>6.1f}% {r['plain_host_check_ms'] * 1e3:>11.1f}{bar}")
    lines.append(f"copy = copy of a buffer the size of K+V (256 MB..2 GB); best copy in this run {best:.0f} GB/s")
    lines.append("us = kernel time (CUDA-graph replays); plain = paged_attention(...) called in a Python loop with the "
                 "default check=\"device\" (no sync); host-chk = the same with check=\"host\" (a sync a call)")
    lines.append(f"* = the bar cases: kernel >= 70% of copy; plain B=1 ctx 32k >= {100 * PLAIN_BAR:.0f}% of copy; "
                 "fa Sq=1 x = flash_attention time / ours")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- pytest-benchmark
try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.parametrize("case_key", CASES, ids=lambda k: f"B{k[0]}-ctx{k[1]}-{k[2][0]}x{k[2][1]}-bs{k[3]}")
    def test_decode_bandwidth(benchmark, case_key, monkeypatch):
        import cupy as cp
        if "VBW_CUPY_AUTOTUNE" not in os.environ:  # the heuristic split unless the caller asks for tuning
            monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")
        B, ctx, (Hq, Hkv), bs = case_key
        c = Case(B, ctx, Hq, Hkv, bs)
        try:
            L = c.launches[0]
            L.run()
            cp.cuda.Device().synchronize()
            stream = cp.cuda.get_current_stream()

            def call():
                L.run()
                stream.synchronize()

            benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=3)
            ms = c.time_ms()
            copy = _copy_gbs(cp, max(c.kv_bytes, MIN_ROTATE_BYTES))
            gbs = c.kv_bytes / ms / 1e6
            peer = c.peer_ms()
            benchmark.extra_info.update({"kernel_ms_graph": ms, "kv_gbs": gbs, "copy_gbs": copy,
                                         "ratio_of_copy": gbs / copy, "splits": L.splits,
                                         "peer": "flash_attention Sq=1 contiguous", "peer_ms": peer,
                                         "peer_ratio": (peer / ms) if peer else None})
        finally:
            c.free()
            cp.get_default_memory_pool().free_all_blocks()


def precompile():
    """Compile every paged_attention instance (and the sweep's extra configs) into the disk cache, in parallel."""
    names = list(paged.kernel_instances())
    names += [(paged._SOURCE, paged._kernel_name("__half", 128, w, s)) for (w, s) in paged._EXPLORE_CONFIGS]
    rt.precompile(names)


SWEEP_CASES = (((1, 32768, (32, 8), 16), (0, 24, 32, 40, 48, 56, 64)),
               ((1, 32768, (32, 8), 128), (0, 16, 32, 48)),
               ((64, 4096, (32, 8), 16), (0, 1, 2, 3)),
               ((8, 4096, (32, 8), 16), (0, 4, 8)))


def sweep(configs=None):
    """(WARPS, STAGES) configs x split counts (0 = the heuristic) on a few shapes; prints the best per shape."""
    import cupy as cp
    rows = []
    for key, splits in SWEEP_CASES:
        B, ctx, (Hq, Hkv), bs = key
        c = Case(B, ctx, Hq, Hkv, bs)
        for (w, st) in configs or (paged._CONFIGS + paged._EXPLORE_CONFIGS):
            for n in splits:
                try:
                    L = c.launches_for(dict(WARPS=w, STAGES=st, SPLITS=n))
                    ms = c.time_ms(L)
                except Exception as e:
                    print(f"  {key} W{w} S{st} n{n}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                rows.append((key, w, st, n, L[0].splits, ms, c.kv_bytes / ms / 1e6))
        c.free()
        cp.get_default_memory_pool().free_all_blocks()
        mine = [r for r in rows if r[0] == key]
        best = sorted(mine, key=lambda r: r[5])[:4]
        dflt = [r for r in mine if (r[1], r[2], r[3]) == (4, 2, 0)]
        print(f"sweep {key}: default W4S2 " + (f"n->{dflt[0][4]} {dflt[0][5] * 1e3:.1f}us" if dflt else "-")
              + "; best " + "; ".join(f"W{r[1]}S{r[2]} n{r[3]}->{r[4]} {r[5] * 1e3:.1f}us {r[6]:.0f}GB/s"
                                      for r in best), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the flash_attention peer")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only-bars", action="store_true", help="just the two bar cases")
    ap.add_argument("--precompile", action="store_true", help="only compile every instance (parallel) and exit")
    ap.add_argument("--copyscan", action="store_true", help="copy bandwidth at 64 MB .. 2 GB and exit")
    ap.add_argument("--sweep", action="store_true", help="configs x split counts on a few shapes")
    args = ap.parse_args(argv)
    if args.precompile:
        precompile()
        return 0
    if args.copyscan:
        import cupy as cp
        for mb in (64, 128, 256, 384, 512, 1024, 2048):
            d = {}
            _copy_gbs(cp, mb << 20, d)
            print(f"copy {mb:5d} MB: " + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + " GB/s", flush=True)
        return 0
    if args.sweep:
        rows = sweep()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f)
        return 0
    os.environ.setdefault("VBW_CUPY_AUTOTUNE", "0")
    print(f"device: {_device.query_device()['name']} sm_{_device.device_arch()}, {_device.num_sms()} SMs", flush=True)
    cases = [k for k in CASES if not args.only_bars or k in BAR_CASES]
    rows = []
    t0 = time.time()
    for i, k in enumerate(cases, 1):
        try:
            r = measure(k, with_peer=not args.quick)
        except Exception as e:
            print(f"[{i}/{len(cases)}] {k}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        rows.append(r)
        print(f"[{i}/{len(cases)}] {k}: {r['kv_gbs']:.0f} GB/s = {r['pct_copy']:.1f}% of copy "
              f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
