"""fp4_matmul (FP4 weights, fp16 activations) against cupy.matmul in float16 on the dequantized weight, same run.

pytest bench/bench_fp4_gemm.py --benchmark-only       (pytest-benchmark; ratios in extra_info)
python bench/bench_fp4_gemm.py [--quick] [--fmt nvfp4|mxfp4] (prints the table)

Timing, M < 1024 (memory-bound): CUDA events around 10 back-to-back calls after warm-up, median of 7 such
groups, divided by 10 (so host launch overhead counts only where it starves the GPU); ours and the peer in 6
rounds, the order flipped each round, each side's median time and the median of the per-round ratios reported
(`_timing.alternating`).
Timing, M >= 1024 (compute-bound, the card at its power cap): sustained, `_timing.steady_ms` (1 s of calls, then
1 s timed in ~50 ms windows), ours and the peer in 2 rounds of flipped order; the SM clock each side ran at is
printed (NVML). Short bursts inherit the clock the previous work left (cuBLAS fp16 settles lower than the FP8
GEMM at 700 W): timed that way W4A8 read 1.18-1.29x where sustained it runs 1.29-1.33x
(notes/session-2026-11-27o.md).
Weights are rotated among copies totalling more than 2x the L2 (FP4 weights of 8192^2 are 36 MB and would
otherwise stay in the 50 MB L2), the same for the peer's fp16 weights. TFLOP/s = 2 M N K / t; weight GB/s =
bytes of the FP4 tensor (data + scales) / t.
The epilogue variant adds bias + silu: fused in fp4_matmul, a CuPy elementwise kernel after cupy.matmul.
--w4a4: the activations are an FP4Tensor (quantized once, outside the timing; the call's conversion of them
to FP8 is timed), the peer the same cuBLAS fp16 product (its epilogue variant has no epilogue).
--w4a8: the activations are an FP8Tensor (vbw_cupy.quantize_fp8, outside the timing), the same peer; with
--fmt mxfp4 the FP8 tensor-core path with no conversion pass. Both print issue 17's bar (>= 1.3x) per row.
"""
import math
import sys

import numpy as np
import pytest

cp = pytest.importorskip("cupy") if __name__ != "__main__" else __import__("cupy")

from vbw_cupy import _timing, gemm  # noqa: E402
from vbw_cupy.fp4 import dequantize, quantize  # noqa: E402
from vbw_cupy.fp8 import quantize_fp8  # noqa: E402

MS = (1, 16, 64, 256, 4096)
NKS = ((8192, 8192), (14336, 4096), (4096, 14336))
ROTATE_BYTES = 120e6
STEADY_FROM_M = 1024  # rows from this M are timed sustained (_timing.steady_ms)

_silu_bias = None


def _peer_epilogue(y, bias):
    global _silu_bias
    if _silu_bias is None:
        _silu_bias = cp.ElementwiseKernel("T y, T b", "T z", "float v = (float)y + (float)b; z = (T)(v / (1.f + expf(-v)))",
                                          "vbw_bench_silu_bias")
    return _silu_bias(y, bias)


def setup(M, N, K, fmt="nvfp4", epilogue=False, seed=0, w4a4=False, w4a8=False):
    rs = cp.random.RandomState(seed)
    w0 = quantize(rs.standard_normal((N, K), dtype=cp.float32), fmt)
    n_q = max(1, min(8, math.ceil(ROTATE_BYTES / w0.nbytes)))
    ws = [w0] + [quantize(rs.standard_normal((N, K), dtype=cp.float32), fmt) for _ in range(n_q - 1)]
    n_h = max(1, min(8, math.ceil(ROTATE_BYTES / (N * K * 2))))
    wds = [dequantize(w, np.float16) for w in ws[:n_h]]
    while len(wds) < n_h:
        wds.append(wds[-1].copy())
    a = rs.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
    bias = rs.standard_normal(N, dtype=cp.float32).astype(cp.float16) if epilogue else None
    act = "silu" if epilogue else None
    if w4a4 or w4a8:  # activations given quantized (MXFP4 weights: the FP8 tensor-core path)
        bias = None if bias is None else bias.astype(cp.float32)
        qa = quantize_fp8(a) if w4a8 else quantize(a.astype(cp.float32), fmt)
        ours = lambda i: gemm.fp4_matmul(qa, ws[i % n_q], bias, act)  # noqa: E731
        for i in range(n_q):  # each weight copy's one-time conversion, before any timing
            ours(i)
        return ours, (lambda i: cp.matmul(a, wds[i % n_h].T)), (qa, ws[0], bias, act), w0.nbytes
    ours = lambda i: gemm.fp4_matmul(a, ws[i % n_q], bias, act)  # noqa: E731
    if epilogue:
        peer = lambda i: _peer_epilogue(cp.matmul(a, wds[i % n_h].T), bias)  # noqa: E731
    else:
        peer = lambda i: cp.matmul(a, wds[i % n_h].T)  # noqa: E731
    return ours, peer, (a, ws[0], bias, act), w0.nbytes


def _counted(fn):
    """fn(i) as a call without arguments, i counting up across calls (callers rotate weight copies by it)."""
    calls = iter(range(1 << 62))
    return lambda: fn(next(calls))


def time_us(fn, inner=10, reps=15):
    """Median microseconds of fn(i) (`_counted`), `inner` back-to-back calls between events (`_timing.time_ms`)."""
    return 1e3 * _timing.time_ms(_counted(fn), warmup=3, rep=reps, inner=inner)


def measure(M, N, K, fmt="nvfp4", epilogue=False, check=True, w4a4=False, w4a8=False):
    ours, peer, (a, w, bias, act), wbytes = setup(M, N, K, fmt, epilogue, w4a4=w4a4, w4a8=w4a8)
    quantized = w4a4 or w4a8
    steady = M >= STEADY_FROM_M
    mhz = (None, None)
    if steady:  # sustained, the weights rotated as in the bursts
        r = _timing.steady_pair(_counted(ours), _counted(peer))
        t_ours, t_peer, ratio = 1e3 * r["a_ms"], 1e3 * r["b_ms"], r["ratio"]
        mhz = tuple(None if math.isnan(r[k]) else r[k] for k in ("a_mhz", "b_mhz"))
    else:
        t_ours, t_peer, ratio = _timing.alternating(lambda: time_us(ours, reps=7), lambda: time_us(peer, reps=7))
    row = {"M": M, "N": N, "K": K, "fmt": fmt, "epilogue": "bias+silu" if epilogue else "-",
           "ours_us": t_ours, "peer_us": t_peer, "ratio": ratio, "timing": "sustained" if steady else "burst",
           "ours_mhz": mhz[0], "peer_mhz": mhz[1],
           "tflops": 2 * M * N * K / t_ours / 1e6, "peer_tflops": 2 * M * N * K / t_peer / 1e6,
           "weight_GBs": wbytes / t_ours / 1e3,
           "config": {"KIND": "fp8_mx" if w._cache.get("fp8_v1") else "f32"} if quantized else gemm.chosen_config(a, w)}
    if quantized:
        row["fmt"] = "e4m3A" if w4a8 else f"{fmt}A"
    if check:
        got = gemm.fp4_matmul(a, w, bias, act)
        a64 = dequantize(a).astype(cp.float64) if quantized else a.astype(cp.float64)
        z = a64 @ dequantize(w).astype(cp.float64).T
        if epilogue:
            z += bias.astype(cp.float64)
            z = z / (1 + cp.exp(-z))
        nz = float(cp.linalg.norm(z))
        row["error"] = float(cp.linalg.norm(got.astype(cp.float64) - z)) / nz
        row["bound"] = 2 * float(cp.linalg.norm(z.astype(cp.float16).astype(cp.float64) - z)) / nz + 1e-6
    return row


CASES = [(m, n, k, False) for m in MS for n, k in NKS] + [(m, 8192, 8192, True) for m in (1, 16, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,epi", CASES, ids=[f"M{m}-N{n}-K{k}{'-bias_silu' if e else ''}" for m, n, k, e in CASES])
def test_fp4_matmul(benchmark, M, N, K, epi):
    row = measure(M, N, K, "nvfp4", epi, check=False)
    ours, _, _, _ = setup(M, N, K, "nvfp4", epi)
    stream = cp.cuda.get_current_stream()

    def timed():
        ours(0)
        stream.synchronize()
    benchmark.pedantic(timed, rounds=20, warmup_rounds=3)
    benchmark.extra_info.update({k: row[k] for k in ("ours_us", "peer_us", "ratio", "tflops", "peer_tflops",
                                                     "weight_GBs", "timing", "ours_mhz", "peer_mhz")})
    benchmark.extra_info["config"] = str(row["config"])


def print_table(rows, out=sys.stdout):
    print(f"{'M':>5} {'N':>6} {'K':>6} {'fmt':6} {'epilogue':9} {'ours us':>9} {'cuBLAS us':>9} {'ratio':>6} "
          f"{'TFLOP/s':>8} {'cuBLAS':>7} {'wGB/s':>7} {'error':>9} {'bound':>9} {'timing':>9} {'MHz':>9}  config",
          file=out)
    for r in rows:
        cfg = r["config"] or {}
        cs = f"{cfg.get('KIND', '?')}" + (f" {cfg['BR']}x{cfg['BC']}x{cfg['BK']} s{cfg['SPLIT']}" if "BR" in cfg else "")
        print(f"{r['M']:>5} {r['N']:>6} {r['K']:>6} {r['fmt']:6} {r['epilogue']:9} {r['ours_us']:9.1f} "
              f"{r['peer_us']:9.1f} {r['ratio']:6.2f} {r['tflops']:8.1f} {r['peer_tflops']:7.1f} "
              f"{r['weight_GBs']:7.0f} {r.get('error', float('nan')):9.2e} {r.get('bound', float('nan')):9.2e} "
              f"{r['timing']:>9} {_mhz(r):>9}  {cs}", file=out, flush=True)
    if any(r["timing"] == "sustained" for r in rows):
        print("MHz: the SM clock ours / cuBLAS ran at (sustained rows; NVML, '-' where it cannot be read)", file=out)


def _mhz(r):
    return "/".join("-" if r[k] is None else f"{r[k]:.0f}" for k in ("ours_mhz", "peer_mhz"))


def diagnose(out=sys.stdout):
    """Where the time goes: the public call vs the bare kernel launch vs a CUDA graph of the call, every
    non-wgmma tuning candidate at M = 1 and 16 (kernel alone, weights rotated past the L2), and the wgmma
    configs at M = 4096 (N = K = 8192)."""
    for M in (1, 16):
        ours, peer, (a, w, bias, act), wbytes = setup(M, 8192, 8192)
        t_call = time_us(ours)
        o, plan = gemm._matmul_gpu(a, w, None, None, np.dtype(np.float16))
        t_launch = time_us(lambda i: gemm._launch(plan, a, o, None))
        try:
            t_graph = 1e3 * _timing.graph_time_ms([lambda: gemm.fp4_matmul(a, w)], target_ms=2.0, reps=10)
        except Exception as exc:
            t_graph = float("nan")
            print(f"graph capture failed: {exc}", file=out)
        print(f"M={M}: call {t_call:.1f} us, bare launch {t_launch:.1f} us, graph {t_graph:.1f} us (same weight: L2-warm), "
              f"cuBLAS {time_us(peer):.1f} us, plan {plan[1]} {plan[-1]}", file=out, flush=True)
        n_q = max(1, math.ceil(ROTATE_BYTES / w.nbytes))
        wsr = [w] + [quantize(cp.random.standard_normal((8192, 8192), dtype=cp.float32)) for _ in range(n_q - 1)]
        for cfg in gemm._regime(M).candidates:  # the tuner's candidates for this M, kernel time alone
            if cfg["KIND"] in gemm._WG:
                continue
            plans = [gemm._matmul_gpu(a, x, None, None, np.dtype(np.float16), cfg=dict(cfg))[1] for x in wsr]
            t = time_us(lambda i: gemm._launch(plans[i % len(plans)], a, o, None))
            print(f"  M={M} {cfg['KIND']} {cfg['BR']}x{cfg['BC']}x{cfg['BK']} stages={cfg['STAGES']} "
                  f"split={cfg['SPLIT']} (-> {plans[0][1]}): {t:.1f} us {wbytes / t / 1e3:.0f} GB/s", file=out, flush=True)
    ours, peer, (a, w, bias, act), wbytes = setup(4096, 8192, 8192)
    flop = 2 * 4096 * 8192 * 8192
    for name in ("wg256", "wgrs256", "wgrs256k", "wgrs128k", "wg128"):
        cfg = dict(gemm.TILES[name], SPLIT=0)
        o, plan = gemm._matmul_gpu(a, w, None, None, np.dtype(np.float16), cfg=cfg)
        t = time_us(lambda i: gemm._launch(plan, a, o, None), inner=3, reps=5)
        print(f"M=4096 {name}: {t:.1f} us {flop / t / 1e6:.1f} TFLOP/s", file=out, flush=True)
    print(f"M=4096 cuBLAS: {time_us(peer, inner=3, reps=5):.1f} us", file=out, flush=True)


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="M in {1, 16, 4096} at N = K = 8192 only")
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--diag", action="store_true", help="launch-overhead and per-config breakdown only")
    p.add_argument("--w4a4", action="store_true", help="activations as an FP4Tensor of --fmt (mxfp4: FP8 tensor "
                   "cores on Hopper), M = 4096 at the three shapes (issue 17's bars)")
    p.add_argument("--w4a8", action="store_true", help="activations as an FP8Tensor (quantize_fp8), weights in --fmt, "
                   "M = 4096 at the three shapes")
    args = p.parse_args()
    if args.diag:
        diagnose()
        sys.exit(0)
    cases = [(m, 8192, 8192, False) for m in (1, 16, 4096)] if args.quick else CASES
    if args.w4a4 or args.w4a8:
        cases = [(4096, n, k, False) for n, k in NKS] + [(4096, 8192, 8192, True)]
    rows = []
    for m, n, k, e in cases:
        try:
            rows.append(measure(m, n, k, args.fmt, e, check=not args.no_check, w4a4=args.w4a4, w4a8=args.w4a8))
        except Exception as exc:  # keep going: one failing shape must not hide the others
            print(f"M={m} N={n} K={k}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    print_table(rows)
    if args.w4a4 or args.w4a8:
        for r in rows:
            if r["epilogue"] == "-":
                print(f"bar: {r['N']}x{r['K']} {r['fmt']} {r['ratio']:.3f}x cuBLAS fp16 (>= 1.3x: "
                      f"{'met' if r['ratio'] >= 1.3 else 'NOT met'})")
