"""Where the time of a short call goes: the host (Python + launch) or the GPU.

For each call it prints three numbers (microseconds per call):
  loop  CUDA events around back-to-back calls (what bench_*.py report: the host counts where it starves the GPU)
  gpu   the same calls queued behind a ~20 ms spin kernel, so the host is done enqueuing before the GPU reaches
        them: the GPU time alone
  host  wall time of enqueuing one call (no synchronisation inside the loop)
If loop ~ host > gpu, the call is host-bound and a faster kernel cannot show. With --profile, a cProfile of
the vbw_cupy calls follows.

    python bench/host_overhead.py [--profile]
"""
import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import vbw_cupy as vc
from vbw_cupy import _plans

_spin = cp.RawKernel(r"""
extern "C" __global__ void vbw_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "vbw_spin")


def _spin_cycles(ms):
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    return np.int64(ms * clock_khz)


def _events_us(fn, n, reps, spin_ms=None):
    """Median us per call of n back-to-back calls between two events (queued behind a spin of spin_ms)."""
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        if spin_ms:
            _spin((1,), (1,), (_spin_cycles(spin_ms),))
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e) * 1e3 / n)
    return float(np.median(times))


def gpu_us(fn, n=40, spin_ms=20.0):
    return _events_us(fn, n, 5, spin_ms)


def loop_us(fn, n=20):
    return _events_us(fn, n, 9)


def host_us(fn, n=200):
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        _spin((1,), (1,), (_spin_cycles(50.0),))  # the GPU is busy: the host never waits on a full queue
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / (n // 5))
        cp.cuda.Device().synchronize()
    return float(np.median(times))


def cases():
    rs = cp.random.RandomState(0)
    for M in (1, 16):
        w = vc.quantize(rs.standard_normal((8192, 8192), dtype=cp.float32))
        a = rs.standard_normal((M, 8192), dtype=cp.float32).astype(cp.float16)
        wd = vc.dequantize(w, np.float16)
        yield f"fp4_matmul M={M} 8192^2", lambda a=a, w=w: vc.fp4_matmul(a, w)
        yield f"  cupy.matmul fp16 M={M}", lambda a=a, wd=wd: cp.matmul(a, wd.T)
    q, k, v = (rs.standard_normal((4, 1024, 16, 64), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    for causal in (False, True):
        yield f"flash_attention 4x1024x16x64 c={int(causal)}", \
            lambda causal=causal: vc.flash_attention(q, k, v, causal=causal)
    try:
        import torch
        import torch.nn.functional as F
        tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v))
        for causal in (False, True):
            def sdpa(causal=causal):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            yield f"  torch FLASH c={int(causal)}", sdpa
    except Exception as exc:  # torch is a peer, never a dependency
        print("no torch peer:", exc)
    B, ctx, bs = 8, 4096, 16
    nb = B * ctx // bs
    kc = rs.standard_normal((nb, bs, 8, 128), dtype=cp.float32).astype(cp.float16)
    vcache = rs.standard_normal((nb, bs, 8, 128), dtype=cp.float32).astype(cp.float16)
    table = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32).reshape(B, -1))
    lens = cp.full(B, ctx, dtype=cp.int32)
    qd = rs.standard_normal((B, 32, 128), dtype=cp.float32).astype(cp.float16)
    yield "paged_attention B=8 ctx=4096", lambda: vc.paged_attention(qd, kc, vcache, table, lens)
    yield "  same, check=\"host\" (syncs)", lambda: vc.paged_attention(qd, kc, vcache, table, lens, check="host")
    x = rs.standard_normal((4096, 4096), dtype=cp.float32).astype(cp.float16)
    yield "quantize nvfp4 4096^2 fp16 scale given", lambda: vc.quantize(x, "nvfp4", global_scale=0.01)
    yield "  same, no scale (amax read: syncs)", lambda: vc.quantize(x, "nvfp4")
    yield "quantize mxfp4 4096^2 fp16", lambda: vc.quantize(x, "mxfp4")
    yield "  bare CuPy kernel launch", lambda: _spin((1,), (1,), (np.int64(0),))
    packed = _plans.Launch(_spin, (1,), (1,), (np.int64(0),))  # what every fast path replays: the floor
    yield "  the same, packed driver launch", lambda: packed((), cp.cuda.get_current_stream().ptr)
    yield "  cp.empty of flash's output", lambda: cp.empty(q.shape, dtype=q.dtype)


HOST_BAR_US = 10.0  # the call-path issue's bar for a repeated call of vbw_cupy's ops (rows not indented)


def main():
    profile = "--profile" in sys.argv
    print(f"{'call':40s} {'loop':>8s} {'gpu':>8s} {'host':>8s}   (us per call; bar: host <= {HOST_BAR_US:g})")
    for name, fn in cases():
        lo, g, h = loop_us(fn), gpu_us(fn), host_us(fn)
        bar = "" if name.startswith(" ") else ("  met" if h <= HOST_BAR_US else "  NOT met")
        print(f"{name:40s} {lo:8.1f} {g:8.1f} {h:8.1f}{bar}", flush=True)
        if profile and not name.startswith(" "):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                fn()
            pr.disable()
            cp.cuda.Device().synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
