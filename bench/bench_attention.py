"""flash_attention forward: vbw_cupy against torch SDPA (FLASH = FlashAttention-2, CUDNN backends) in one run.

pytest-benchmark:  python -m pytest bench/bench_attention.py --benchmark-only
    D in {64, 128, 256}, S in {1024, 4096, 16384}, causal and not, float16 and bfloat16; B x H keeps
    B * S = 32768 tokens and H * D = 2048 (TARGETS.md's shapes at D = 64 / 128). extra_info holds TFLOP/s
    (4 B H S^2 D / t, halved when causal) of ours and each peer, and ratios = peer time / our time.
    Peers (`peer_names`, the preference of vbw_cupy._peers): cuDNN's SDPA through nvidia-cudnn-frontend
    ("cudnn-fe", no torch needed) when it imports, torch SDPA's FLASH and CUDNN backends when torch with CUDA
    imports; with neither, a naive CuPy matmul-softmax-matmul ("naive", not a tuned kernel: its ratio is no
    performance claim).

Standalone (one device call can test and benchmark):
    python bench/bench_attention.py --quick        TFLOP/s table for the same grid, ours vs FLASH / CUDNN (each
                                                   peer timed before and after ours, its faster time kept): one
                                                   call between two events, as a user's single call costs
    python bench/bench_attention.py --quick --graph  the same, plus both sides replayed from a CUDA graph (no host
                                                   time at all: torch's per-call cost, ~100 us for CUDNN at
                                                   S = 512 on the H100, no longer counts against the peer)
    python bench/bench_attention.py --sustained [SECONDS]  ours vs torch's CUDNN, each side's calls back to back
                                                   (SECONDS warm-up, then SECONDS timed, two rounds of flipped
                                                   order), the SM clock each ran at beside: the card sits at its
                                                   power cap here, and a short timing inherits the other side's
                                                   clock
    python bench/bench_attention.py --sweep        every tile config of vbw_cupy.attention at D 64/128/256
    python bench/bench_attention.py --precompile   compile every kernel instance in parallel (disk cache)
    python bench/bench_attention.py --fp8          flash_attention_fp8 against our float16 flash_attention on the
                                                   same data (D = 128, S = 4k / 8k / 16k; the FP8 side includes
                                                   its V transpose). Sustained timing (`_timing.steady_ms`: 1 s
                                                   of calls, then 1 s timed), the two in 2 rounds of flipped
                                                   order, the SM clock each ran at beside (issue bar: 1.5x our
                                                   float16 from S = 4k)
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy import _device  # noqa: E402
from vbw_cupy import _peers  # noqa: E402
from vbw_cupy import _runtime as rt  # noqa: E402
from vbw_cupy import _timing  # noqa: E402

try:
    import pytest
except ImportError:  # the standalone modes need no pytest
    pytest = None

GRID_D = (64, 128, 256)
GRID_S = (1024, 4096, 16384)


def shape_for(D, S):
    """(B, H): B * S = 32768 tokens, H * D = 2048 (32 heads at D=64, 16 at 128, 8 at 256)."""
    return max(1, 32768 // S), max(1, 2048 // D)


def flops(B, H, S, D, causal):
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def _torch():
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        return torch
    except Exception:
        return None


def peer_names():
    """The peers of this machine, best first: "cudnn-fe" (cudnn-frontend), "FLASH" and "CUDNN" (torch SDPA
    backends); ("naive",) when none of them imports."""
    kinds = _peers.available_kinds()
    names = (["cudnn-fe"] if "cudnn" in kinds else []) + (["FLASH", "CUDNN"] if "torch" in kinds else [])
    return tuple(names) or ("naive",)


def cuda_ms(fn, warmup=3, rep=10):
    """Median ms of fn() over `rep` runs, CUDA events on the current stream, after warm-up."""
    return _timing.time_ms(fn, warmup=warmup, rep=rep)


def config_ms(case, cfg) -> float:
    """ms of one call with an explicit config, by CUDA-graph replay: a call with `config=` rebuilds its plan
    every time, which at short S costs more host time than the kernel (20-30% at S = 512 on an H100), so
    timing it call by call ranks configs by host cost. Graph replay times the kernels alone, for every config
    alike (the public call's own cost is what `quick` times)."""
    return _timing.graph_time_ms([case.ours(cfg)], target_ms=20, reps=3)


class Case:
    def __init__(self, D, S, causal, dtype, B=None, H=None, seed=0):
        import cupy as cp
        import ml_dtypes
        self.cp = cp
        B0, H0 = shape_for(D, S)
        self.B, self.H = B or B0, H or H0
        self.D, self.S, self.causal = D, S, causal
        self.dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
        self.dtype_name = dtype
        rng = cp.random.default_rng(seed)
        shape = (self.B, S, self.H, D)
        self.q, self.k, self.v = (rng.standard_normal(shape, dtype=cp.float32).astype(self.dtype) for _ in range(3))
        self.flops = flops(self.B, self.H, S, D, causal)

    def ours(self, config=None):
        from vbw_cupy import attention as A
        if config is None:
            return lambda: A.flash_attention(self.q, self.k, self.v, causal=self.causal)
        o = self.cp.empty_like(self.q)
        return lambda: A._flash_gpu(self.q, self.k, self.v, causal=self.causal, softmax_scale=None,
                                    window=(-1, -1), softcap=0.0, return_lse=False, out=o, config=config)

    def torch_peer(self, backend):
        torch = _torch()
        if torch is None:
            return None
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"FLASH": SDPBackend.FLASH_ATTENTION, "CUDNN": SDPBackend.CUDNN_ATTENTION}[backend]
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (self.q, self.k, self.v))
        F = torch.nn.functional

        def run():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=self.causal)
        try:
            run()
            torch.cuda.synchronize()
        except Exception:
            return None
        return run

    def cudnn_fe_peer(self):
        """cuDNN SDPA through cudnn-frontend (built once per case), or None where it cannot run the shape."""
        if not hasattr(self, "_cudnn_fe"):
            p = _peers.attention_peer(self.q, self.k, self.v, self.causal, 1.0 / math.sqrt(self.D), kinds=("cudnn",))
            self._cudnn_fe = p.run if p is not None else None
        return self._cudnn_fe

    def naive_peer(self):
        scale = 1.0 / math.sqrt(self.D)
        return lambda: _peers.naive_attention(self.q, self.k, self.v, self.causal, scale)

    def tflops(self, ms):
        return self.flops / ms / 1e9 if ms else None


def _torch_ms(run, rep, per=1):
    """Median ms of run() / per over `rep` runs between torch CUDA events (torch runs on its own current stream,
    so the timing is torch's too)."""
    torch = _torch()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rep):
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / per)
    return float(np.median(times))


def _time_peer_graph(case, name, calls=20):
    """ms per call of the peer replayed from a CUDA graph of `calls` back-to-back calls (torch peers: a torch
    graph; the others: CuPy stream capture), or None where it cannot be captured."""
    try:
        if name in ("FLASH", "CUDNN"):
            fn = case.torch_peer(name)
            if fn is None:
                return None

            def warm():
                for _ in range(3):
                    fn()

            def calls_of_fn():
                for _ in range(calls):
                    fn()
            g = _peers.torch_cuda_graph(warm, calls_of_fn)
            g.replay()
            _torch().cuda.synchronize()
            return _torch_ms(g.replay, 5, per=calls)
        fn = case.cudnn_fe_peer() if name == "cudnn-fe" else None
        return _timing.graph_time_ms([fn], target_ms=20, reps=3) if fn is not None else None
    except Exception:  # a peer that cannot be captured has no graph figure
        return None


def _time_peer(case, name, rep):
    if name in ("FLASH", "CUDNN"):
        fn = case.torch_peer(name)
        if fn is None:
            return None
        for _ in range(3):
            fn()
        return _torch_ms(fn, rep)
    if name == "cudnn-fe":
        fn = case.cudnn_fe_peer()
        return cuda_ms(fn, warmup=3, rep=rep) if fn is not None else None
    if case.B * case.H * case.S * case.S * 4 > _peers.NAIVE_MAX_SCORE_BYTES:  # the S x S scores must fit
        return None
    return cuda_ms(case.naive_peer(), warmup=1, rep=max(3, rep // 3))


# ---------------------------------------------------------------------------------------------- pytest
if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("S", GRID_S)
    @pytest.mark.parametrize("D", GRID_D)
    def test_attention_fwd(benchmark, D, S, causal, dtype):
        cp = pytest.importorskip("cupy")
        if not rt.gpu_available():
            pytest.skip("no CUDA device")
        case = Case(D, S, causal, dtype)
        fn = case.ours()
        stream = cp.cuda.get_current_stream()
        ms = cuda_ms(fn, warmup=3, rep=10)

        def timed():
            fn()
            stream.synchronize()
        benchmark.pedantic(timed, rounds=10, iterations=1, warmup_rounds=2)
        info = {"B": case.B, "H": case.H, "ours_ms": ms, "ours_tflops": case.tflops(ms)}
        for peer in peer_names():
            pms = _time_peer(case, peer, 10)
            info[f"{peer}_ms"] = pms
            info[f"{peer}_tflops"] = case.tflops(pms)
            info[f"ratio_vs_{peer}"] = pms / ms if pms else None
        benchmark.extra_info.update(info)


# ---------------------------------------------------------------------------------------------- standalone
def _grid(Ds, Ss, dtypes):
    """The table's cases in order: each D, S, full then causal, each dtype. One Case (its inputs) alive at a
    time: the previous one is dropped before the next is made (callers also drop theirs)."""
    for D in Ds:
        for S in Ss:
            for causal in (False, True):
                for dt in dtypes:
                    case = Case(D, S, causal, dt)
                    yield case
                    del case


def quick(Ds=(64, 128, 256), Ss=GRID_S, dtypes=("float16", "bfloat16"), rep=10, out=sys.stdout, graph=False):
    """The table. graph: also both sides replayed from CUDA graphs (columns "graph": ours, and each peer's
    ratio), which leaves out the host time of every call."""
    peers = peer_names()
    if peers == ("naive",):
        print(f"peer: {_peers.NAIVE}; install nvidia-cudnn-frontend or torch for a tuned peer", file=out)
    head = f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} {'dtype':>8} | {'ours ms':>8} {'TFLOP/s':>7} | " + \
        " | ".join(f"{p:>6} TF/s  ratio" for p in peers) + \
        (" || graph: ours TF/s | " + " | ".join(f"{p:>6} TF/s  ratio" for p in peers) if graph else "")
    print(head, file=out, flush=True)
    rows = []
    for case in _grid(Ds, Ss, dtypes):
        D, S, causal, dt = case.D, case.S, case.causal, case.dtype_name
        # each peer timed before and after ours, its faster time kept: a slow moment of the GPU during one peer
        # timing does not flatter our ratio
        before = {p: _time_peer(case, p, rep) for p in peers}
        ms = cuda_ms(case.ours(), warmup=3, rep=rep)
        row = {"D": D, "S": S, "B": case.B, "H": case.H, "causal": causal, "dtype": dt, "ms": ms,
               "tflops": case.tflops(ms)}
        cells = []
        for p in peers:
            pms = min((t for t in (before[p], _time_peer(case, p, rep)) if t), default=None)
            row[p] = case.tflops(pms)
            row[f"ratio_{p}"] = pms / ms if pms else None
            cells.append(f"{row[p]:>11.1f} {row[f'ratio_{p}']:>5.2f}x" if pms else f"{'-':>11} {'-':>6}")
        if graph:
            gms = _timing.graph_time_ms([case.ours()], target_ms=20, reps=3)
            row["graph_tflops"] = case.tflops(gms)
            gcells = []
            for p in peers:
                pg = _time_peer_graph(case, p)
                row[f"{p}_graph"] = case.tflops(pg) if pg else None
                row[f"ratio_graph_{p}"] = pg / gms if pg else None
                gcells.append(f"{row[f'{p}_graph']:>11.1f} {row[f'ratio_graph_{p}']:>5.2f}x" if pg
                              else f"{'-':>11} {'-':>6}")
            cells.append(f"| {row['graph_tflops']:>10.1f} | " + " | ".join(gcells))
        rows.append(row)
        print(f"{D:>4} {S:>6} {case.B:>3}x{case.H:<2} {str(causal):>6} {dt:>8} | {ms:>8.3f} "
              f"{row['tflops']:>7.1f} | " + " | ".join(cells), file=out, flush=True)
        del case
    for p in peers:
        for key, label in ((f"ratio_{p}", "single calls"), (f"ratio_graph_{p}", "CUDA graphs")):
            r = [row[key] for row in rows if row.get(key)]
            if r:
                print(f"vs {p}, {label}: geomean {statistics.geometric_mean(r):.3f}x, worst {min(r):.2f}x "
                      f"({len(r)} shapes)", file=out, flush=True)
    return rows


def sustained(Ds=GRID_D, Ss=GRID_S, dtypes=("float16",), warm_s=1.0, time_s=1.0, out=sys.stdout):
    """Ours against torch SDPA's CUDNN backend in sustained use (`_timing.steady_pair`: each side's calls back to
    back for warm_s, then timed for time_s, two rounds of flipped order), with the SM clock each ran at: at
    these sizes the card runs at its power cap, and a short timing inherits the clock the other side left."""
    if _torch() is None:
        print("--sustained needs torch (the CUDNN peer)", file=out)
        return []
    print(f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} {'dtype':>8} | {'ours ms':>8} {'TFLOP/s':>7} {'MHz':>5} | "
          f"{'CUDNN ms':>8} {'TFLOP/s':>7} {'MHz':>5} | ratio", file=out, flush=True)
    rows = []
    for case in _grid(Ds, Ss, dtypes):
        peer = case.torch_peer("CUDNN")
        if peer is None:
            continue
        # (CuPy's events time torch's calls too: both run on the legacy default stream here)
        r = _timing.steady_pair(case.ours(), peer, warm_s=warm_s, time_s=time_s)
        rows.append(r)
        print(f"{case.D:>4} {case.S:>6} {case.B:>3}x{case.H:<2} {str(case.causal):>6} {case.dtype_name:>8} | "
              f"{r['a_ms']:>8.3f} {case.tflops(r['a_ms']):>7.1f} {r['a_mhz']:>5.0f} | {r['b_ms']:>8.3f} "
              f"{case.tflops(r['b_ms']):>7.1f} {r['b_mhz']:>5.0f} | {r['ratio']:.3f}x", file=out, flush=True)
        del case
    if rows:
        ratios = [r["ratio"] for r in rows]
        print(f"vs CUDNN, sustained: geomean {statistics.geometric_mean(ratios):.3f}x, worst {min(ratios):.2f}x "
              f"({len(ratios)} shapes)", file=out, flush=True)
    return rows


def sweep(Ds=(64, 128, 256), Ss=(4096,), rep=10, out=sys.stdout):
    from vbw_cupy import attention as A
    arch = _device.device_arch()
    for D in Ds:
        hd = A.head_dim_bucket(D)
        for S, causal in ((S, c) for S in Ss for c in (False, True)):
            case = Case(D, S, causal, "float16")
            fms = _time_peer(case, "FLASH", rep)
            if fms:
                print(f"D={D:>3} S={S:>5} causal={str(causal):>5} FLASH {case.tflops(fms):7.1f} TFLOP/s", file=out,
                      flush=True)
            best = None
            # wgmma configs twice: Q, K, V by TMA and by cp.async (attention._USE_TMA)
            for cfg, tma in ((c, t) for c in A._all_configs(hd, True) for t in A._tma_variants(c)):
                A._USE_TMA = tma
                k = rt.get_kernel(A.SOURCE, A.instance_name("float16", hd, cfg, True, tma))
                at = k.attributes
                try:
                    ms = config_ms(case, cfg)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"D={D} causal={causal} {cfg}: FAILED {type(e).__name__}: {e}", file=out)
                    continue
                tf = case.tflops(ms)
                default = A.default_config(hd, arch, shape={"Sk": S})
                tag = (" tma" if tma else "") + (" (default)" if cfg == default else "")
                print(f"D={D:>3} S={S:>5} causal={str(causal):>5} {cfg['KIND']:>3} BM={cfg['BLOCK_M']:>3} BN={cfg['BLOCK_N']:>3} "
                      f"W={cfg['WARPS']} QR={cfg['Q_REGS']} ST={cfg['STAGES']} regs={at['num_regs']:>3} local={at['local_size_bytes']:>3}"
                      f" : {ms:8.3f} ms {tf:7.1f} TFLOP/s{tag}", file=out, flush=True)
                if best is None or tf > best[0]:
                    best = (tf, cfg, tma)
            A._USE_TMA = True
            print(f"  best D={D} S={S} causal={causal}: {best[0]:.1f} {best[1]}{' tma' if best[2] else ''}"
                  + (f" ({best[0] / case.tflops(fms):.2f}x FLASH)" if fms else ""), file=out, flush=True)
            del case


# Code variants to compare: name -> NVRTC options (e.g. ("-DSOME_SWITCH",) guarding an experiment in
# attention_fwd.cu). The switches of the last A/B (fused exp + P V, volatile thread index) are now the code.
AB_VARIANTS = {"default": ()}
AB_CONFIGS = {64: ((128, 128, 4, 0, 2), (128, 128, 4, 0, 1), (128, 64, 4, 1, 2)),
              128: ((128, 64, 4, 0, 2), (128, 64, 4, 0, 1), (128, 48, 4, 0, 2))}
AB_SHAPES = ((64, 1024, False), (64, 4096, False), (64, 4096, True), (64, 16384, True), (128, 1024, False),
             (128, 1024, True), (128, 4096, False), (128, 4096, True), (128, 16384, False), (128, 16384, True))


def _ab_cfg(t):
    return dict(zip(("BLOCK_M", "BLOCK_N", "WARPS", "Q_REGS", "STAGES"), t), KIND="mma")


def ab(rep=10, out=sys.stdout):
    """Code variants (NVRTC -D switches of attention_fwd.cu) x tile configs, each shape timed next to torch's
    FLASH backend in the same process; every (variant, config) is first checked against the reference.
    Returns {D: (variant, config)} with the best geometric-mean ratio over the shapes."""
    import json
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_attention as T
    from vbw_cupy import attention as A
    ok = {}
    for vname, opts in AB_VARIANTS.items():
        A._EXTRA_OPTIONS = opts
        for D, cfgs in AB_CONFIGS.items():
            for c in cfgs:
                try:
                    T.run_dense(1, 300, 517, 4, 2, D, "float16", causal=True, seed=1, config=_ab_cfg(c))
                    T.run_dense(1, 200, 333, 4, 1, D, "float16", window=(60, 7), softcap=20.0, seed=2,
                                config=_ab_cfg(c))
                    ok[(vname, D, c)] = True
                    at = rt.get_kernel(A.SOURCE, A.instance_name("float16", D, _ab_cfg(c), True), opts).attributes
                    print(f"AB ok {vname:>12} D={D} {c}: regs {at['num_regs']} local {at['local_size_bytes']}",
                          file=out, flush=True)
                except AssertionError as e:
                    ok[(vname, D, c)] = False
                    print(f"AB correctness FAILED {vname} D={D} {c}: {str(e)[:200]}", file=out, flush=True)
    ratios = {}
    for D, S, causal in AB_SHAPES:
        case = Case(D, S, causal, "float16")
        fl = [_time_peer(case, "FLASH", rep)]
        cells = []
        for vname, opts in AB_VARIANTS.items():
            A._EXTRA_OPTIONS = opts
            for c in AB_CONFIGS[D]:
                if not ok[(vname, D, c)]:
                    continue
                ms = config_ms(case, _ab_cfg(c))
                cells.append((vname, c, ms))
        fl.append(_time_peer(case, "FLASH", rep))
        fms = min(x for x in fl if x) if any(fl) else None
        print(f"AB D={D} S={S} causal={causal}: FLASH {case.tflops(fms):.1f} TF/s (two timings "
              f"{fl[0]:.3f} / {fl[1]:.3f} ms)", file=out, flush=True)
        for vname, c, ms in cells:
            r = fms / ms if fms else None
            ratios.setdefault((vname, D, c), []).append(r)
            print(f"   {vname:>12} {c}: {case.tflops(ms):6.1f} TF/s  x{r:.3f}", file=out, flush=True)
        del case
    best = {}
    for (vname, D, c), rs in ratios.items():
        g = float(np.exp(np.mean(np.log([x for x in rs if x]))))
        print(f"AB geomean D={D} {vname:>12} {c}: x{g:.3f}", file=out, flush=True)
        if D not in best or g > best[D][2]:
            best[D] = (vname, c, g)
    A._EXTRA_OPTIONS = ()
    print("AB best " + json.dumps({str(D): v for D, v in best.items()}), file=out, flush=True)
    return best


def precompile(ab_variants=False):
    """Compile every instance of vbw_cupy.attention (and, with ab_variants, the A/B code variants) for this
    device in parallel into the disk cache, so tests and benchmarks do not pay NVRTC time one at a time."""
    from vbw_cupy import attention as A
    bad = rt.precompile(A.kernel_instances())
    if ab_variants:
        for opts in AB_VARIANTS.values():
            names = {(A.SOURCE, A.instance_name("float16", D, _ab_cfg(c), True))
                     for D, cfgs in AB_CONFIGS.items() for c in cfgs}
            bad += rt.precompile(sorted(names), extra_options=opts)
    return not bad


def fp8(Ss=(4096, 8192, 16384), D=128, out=sys.stdout):
    """FP8 vs float16 on the same values (the FP8 codes from quantize_e4m3 of the float16 inputs), sustained
    plain calls: the card runs at its power cap here, and a short timing inherits the clock the other side
    left (notes/session-2026-11-27o.md)."""
    import cupy as cp
    import vbw_cupy as vc
    print(f"{'D':>4} {'S':>6} {'BxH':>6} {'causal':>6} | {'fp8 ms':>7} {'TFLOP/s':>7} {'MHz':>5} | {'fp16 ms':>7} "
          f"{'TFLOP/s':>7} {'MHz':>5} | {'fp8 / fp16':>10}", file=out, flush=True)
    rows = []
    for S in Ss:
        B, H = shape_for(D, S)
        xs = [cp.random.standard_normal((B, S, H, D), dtype=cp.float32).astype(cp.float16) for _ in range(3)]
        qs = [vc.quantize_e4m3(x) for x in xs]
        codes, ds = [c for c, _ in qs], cp.concatenate([d for _, d in qs])
        for causal in (False, True):
            # the two sustained, in rounds of flipped order
            r = _timing.steady_pair(lambda: vc.flash_attention_fp8(*codes, ds, causal=causal),
                                    lambda: vc.flash_attention(*xs, causal=causal))
            t8, t16, speedup, mhz = r["a_ms"], r["b_ms"], r["ratio"], (r["a_mhz"], r["b_mhz"])
            f = flops(B, H, S, D, causal)
            rows.append({"D": D, "S": S, "causal": causal, "fp8_ms": t8, "fp16_ms": t16, "speedup": speedup,
                         "fp8_mhz": mhz[0], "fp16_mhz": mhz[1]})
            print(f"{D:>4} {S:>6} {B:>3}x{H:<2} {str(causal):>6} | {t8:>7.3f} {f / t8 / 1e9:>7.0f} {mhz[0]:>5.0f} | "
                  f"{t16:>7.3f} {f / t16 / 1e9:>7.0f} {mhz[1]:>5.0f} | {speedup:>9.2f}x", file=out, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--graph", action="store_true", help="--quick: also both sides by CUDA-graph replay")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--precompile", action="store_true")
    p.add_argument("--fp8", action="store_true", help="flash_attention_fp8 vs our float16 (D = 128)")
    p.add_argument("--ab", action="store_true", help="A/B of code variants x tiles vs FLASH, then --quick with "
                   "the best (in this process only)")
    p.add_argument("--sustained", type=float, nargs="?", const=1.0, metavar="SECONDS",
                   help="ours vs torch's CUDNN in sustained use (SECONDS of warm-up, then SECONDS timed, per side "
                        "and round; default 1), SM clocks beside; --D / --S / --dtype pick the shapes (float16 "
                        "by default)")
    p.add_argument("--D", type=int, nargs="*")
    p.add_argument("--S", type=int, nargs="*")
    p.add_argument("--dtype", nargs="*")
    p.add_argument("--rep", type=int, default=10)
    a = p.parse_args(argv)
    if a.precompile:
        precompile(ab_variants=a.ab)
    if a.ab:
        from vbw_cupy import attention as A
        best = ab(rep=a.rep)
        # apply the winners in this process (defaults of sm_90 and the NVRTC switches) for the table below
        for D, (vname, c, _) in best.items():
            A._DEFAULTS[D][_device.device_arch()] = _ab_cfg(c)
        A._EXTRA_OPTIONS = {D: AB_VARIANTS[v] for D, (v, _, _) in best.items()}
    if a.sweep:
        sweep(Ds=tuple(a.D or (64, 128, 256)), Ss=tuple(a.S or [4096]), rep=a.rep)
    if a.fp8:
        fp8(Ss=tuple(a.S or (4096, 8192, 16384)))
    if a.sustained is not None:
        sustained(Ds=tuple(a.D or GRID_D), Ss=tuple(a.S or GRID_S), dtypes=tuple(a.dtype or ("float16",)),
                  warm_s=a.sustained, time_s=a.sustained)
    if a.quick:
        quick(Ds=tuple(a.D or GRID_D), Ss=tuple(a.S or GRID_S), dtypes=tuple(a.dtype or ("float16", "bfloat16")),
              rep=a.rep, graph=a.graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
