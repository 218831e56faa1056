"""Command line: ``vbw-cupy selftest | info | bench | tune | generate`` (also ``python -m vbw_cupy``)."""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from . import __version__
from . import _device
from . import _runtime as rt

# Modules that own kernels; each exposes kernel_instances() and selftest_cases().
OP_MODULES = ("fp4", "gemm", "attention", "paged", "sparse", "models.gpu", "autotune")


def op_modules():
    mods = []
    for name in OP_MODULES:
        try:
            mods.append(importlib.import_module(f"vbw_cupy.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"vbw_cupy.{name}":
                raise
    return mods


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(rows, out=sys.stdout):
    cols = ["op", "shape", "error", "bound", "ok", "time_ms", "peer", "peer_ms", "ratio"]
    cells = []
    for r in rows:
        ratio = r["peer_ms"] / r["time_ms"] if r.get("peer_ms") and r.get("time_ms") else None
        cells.append([str(r["op"]), str(r["shape"]), _fmt(r.get("error"), ".2e"), _fmt(r.get("bound"), ".2e"),
                      "yes" if r.get("ok") else "NO", _fmt(r.get("time_ms"), ".4f"), str(r.get("peer") or "-"),
                      _fmt(r.get("peer_ms"), ".4f"), _fmt(ratio, ".2f") + ("x" if ratio else "")])
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=out)
    print("ratio = peer time / our time (> 1 means vbw_cupy is faster)", file=out)


def _cpu_selftest():
    """Without a GPU: check the reference path against independent computations."""
    import ml_dtypes
    from . import fp4, reference as ref
    rows = []
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * 4).astype(np.float32)
    ok = np.array_equal(ref.e2m1_encode(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    rows.append({"op": "e2m1 rounding vs ml_dtypes", "shape": str(x.shape), "error": 0.0 if ok else 1.0,
                 "bound": 0.0, "ok": ok})
    for fmt in ("mxfp4", "nvfp4"):
        a = rng.standard_normal((256, 1000)).astype(np.float32)
        t0 = time.perf_counter()
        d = fp4.dequantize(fp4.quantize(a, fmt))
        ms = (time.perf_counter() - t0) * 1e3
        err = float(np.linalg.norm(d - a) / np.linalg.norm(a))
        rows.append({"op": f"{fmt} round trip (reference)", "shape": str(a.shape), "error": err, "bound": 0.2,
                     "ok": err < 0.2, "time_ms": ms})
    # blocked float64 attention against one dense softmax: causal, grouped-query, Sq != Sk
    q = rng.standard_normal((1, 300, 4, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 517, 2, 64)).astype(np.float32)
    t0 = time.perf_counter()
    o = ref.flash_attention(q, k, v, causal=True)
    ms = (time.perf_counter() - t0) * 1e3
    kk, vv = np.repeat(k, 2, axis=2).astype(np.float64), np.repeat(v, 2, axis=2).astype(np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) / 8.0
    s[..., np.arange(517)[None, :] > np.arange(300)[:, None] + 517 - 300] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    dense = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vv)
    err = float(np.linalg.norm(o - dense) / np.linalg.norm(dense))  # o is float32: one rounding
    rows.append({"op": "flash_attention (reference)", "shape": "1x300x517, 4/2 heads, D=64, causal",
                 "error": err, "bound": 1e-6, "ok": err < 1e-6, "time_ms": ms})
    # varlen: the same sequence packed with a second one must give the same rows
    q2, k2, v2 = (rng.standard_normal((n, h, 64)).astype(np.float32) for n, h in ((77, 4), (140, 2), (140, 2)))
    cu_q = np.array([0, 300, 377], np.int32)
    cu_k = np.array([0, 517, 657], np.int32)
    ov = ref.flash_attention_varlen(np.concatenate([q[0], q2]), np.concatenate([k[0], k2]),
                                    np.concatenate([v[0], v2]), cu_q, cu_k, causal=True)
    err = ref.rel_error(ov[:300], o[0])
    rows.append({"op": "flash_attention_varlen (reference)", "shape": "2 sequences, vs the dense call",
                 "error": err, "bound": 1e-6, "ok": err < 1e-6})
    # paged: the last query row over the keys scattered into shuffled blocks of 16
    bs, nblk = 16, -(-517 // 16)
    perm = rng.permutation(nblk + 3).astype(np.int32)
    kc, vc_ = (np.zeros((nblk + 3, bs, 2, 64), np.float32) for _ in range(2))
    for i in range(nblk):
        kc[perm[i], :len(k[0, i * bs:(i + 1) * bs])] = k[0, i * bs:(i + 1) * bs]
        vc_[perm[i], :len(v[0, i * bs:(i + 1) * bs])] = v[0, i * bs:(i + 1) * bs]
    op = ref.paged_attention(q[:, -1], kc, vc_, perm[None, :nblk], np.array([517], np.int32))
    err = ref.rel_error(op, o[:, -1])
    rows.append({"op": "paged_attention (reference)", "shape": "517 keys in shuffled blocks of 16",
                 "error": err, "bound": 1e-6, "ok": err < 1e-6})
    return rows


def _no_gpu_reason() -> str:
    return "CuPy is not installed" if not rt.have_cupy() else "no CUDA device is visible"


def cmd_selftest(args) -> int:
    if not rt.gpu_available():
        print(f"vbw-cupy selftest: {_no_gpu_reason()}; GPU kernels not run. Checking the NumPy reference path only.")
        rows = _cpu_selftest()
        print_table(rows)
        return 0 if all(r["ok"] for r in rows) else 1
    cp = rt.require_cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"vbw-cupy selftest on {props['name'].decode()} (sm_{_device.device_arch()}), NVRTC {rt.nvrtc_version()}",
          flush=True)
    cases = [c for m in op_modules() for c in m.selftest_cases()]
    rows, failed = [], 0
    for i, case in enumerate(cases, 1):
        name = getattr(case, "__qualname__", "case")
        print(f"[{i}/{len(cases)}] {name} ...", file=sys.stderr, flush=True)
        try:
            res = case()
        except Exception as e:  # report and go on: one broken op must not hide the others
            traceback.print_exc()
            res = {"op": name, "shape": "-", "error": None, "bound": None, "ok": False,
                   "time_ms": None, "peer": f"error: {type(e).__name__}", "peer_ms": None}
        for r in res if isinstance(res, list) else [res]:
            rows.append(r)
            failed += not r["ok"]
    print_table(rows)
    print(f"{len(rows) - failed}/{len(rows)} rows within bounds")
    return 1 if failed else 0


def cmd_info(args) -> int:
    from . import autotune
    print(f"vbw_cupy {__version__}")
    print(f"cuda sources: {rt.SOURCE_DIR} (hash {rt.sources_hash()})")
    print(f"cache dir: {rt.cache_dir()}")
    if not rt.have_cupy():
        print("CuPy: not installed (GPU paths unavailable; NumPy inputs use the reference)")
    else:
        cp = rt.require_cupy()
        print(f"CuPy {cp.__version__}, NVRTC {rt.nvrtc_version()}, CUDA headers: {rt.cuda_include_dir()}")
        if not rt.gpu_available():
            print("device: none visible")
        else:
            props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
            print(f"device: {props['name'].decode()}, sm_{_device.device_arch()}, {_device.num_sms()} SMs, "
                  f"{props['totalGlobalMem'] / 2**30:.1f} GiB")
    s = autotune.cache_summary()
    print(f"autotune cache: {s['path']} ({s['status']}, {s['entries']} entries; "
          f"VBW_CUPY_AUTOTUNE={'1' if autotune.enabled() else '0'})")
    for row in s["rows"]:
        print(f"  {row['kernel']} {row['dtype']} {row['bucket']} on {row['device']}: {row['config']} "
              f"{row['ms']:.4f} ms (default {row['default_ms']:.4f} ms)" if row.get("ms") and row.get("default_ms")
              else f"  {row}")
    return 0


def cmd_bench(args) -> int:
    bench_dir = rt.SOURCE_DIR.parent / "bench"
    if not bench_dir.is_dir():
        print(f"vbw-cupy bench: the benchmarks live in the source checkout (bench/), not found next to {rt.SOURCE_DIR}")
        return 1
    cmd = [sys.executable, "-m", "pytest", str(bench_dir), "--benchmark-only", "-q", *args.pytest_args]
    return subprocess.call(cmd, cwd=str(bench_dir.parent))


def cmd_tune(args) -> int:
    from . import autotune
    if not rt.gpu_available():
        print(f"vbw-cupy tune: {_no_gpu_reason()}; tuning times kernels on a GPU, nothing to do.")
        return 1
    mods = op_modules()  # importing the op modules registers their tunables
    # every candidate of every kernel, compiled in parallel first, so tuning times kernels, not NVRTC
    rt.precompile([inst for m in mods for inst in m.kernel_instances()])
    rows = autotune.tune(names=args.kernels or None, progress=True)
    autotune.print_tune_table(rows)
    return 0


def _default_tokenizer(checkpoint: str) -> Path:
    """tokenizer.json inside a Hugging Face folder, tokenizer.bin beside a llama2.c file."""
    ckpt = Path(checkpoint)
    return ckpt / "tokenizer.json" if ckpt.is_dir() else ckpt.parent / "tokenizer.bin"


def cmd_generate(args) -> int:
    try:
        return _generate(args)
    except (FileNotFoundError, ValueError, KeyError, ImportError, RuntimeError) as e:
        print(f"vbw-cupy generate: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from .models import Sampler, generate_ids, load_model, load_tokenizer
    args.device = args.device or ("gpu" if rt.gpu_available() else "cpu")
    model = load_model(args.checkpoint, weights=args.weights or ("fp32" if args.device == "cpu" else "fp16"),
                       device=args.device)
    cfg = model.config
    tok = load_tokenizer(args.tokenizer or _default_tokenizer(args.checkpoint), cfg.bos_id, cfg.eos_ids[0],
                         vocab_size=cfg.vocab_size)
    ids = tok.encode(args.prompt, bos=True)
    print(args.prompt, end="", flush=True)
    stream = tok.stream(ids[-1])
    out = generate_ids(model, [ids], max_new_tokens=args.max_new_tokens,
                       sampler=Sampler(args.temperature, args.top_k, args.top_p, args.seed),
                       on_token=lambda b, t: print(stream.push(t), end="", flush=True))
    print(stream.flush())
    if args.print_ids:
        print("ids: " + " ".join(str(t) for t in ids + out.sequences[0].ids))
    print(f"prefill: {out.prefill_tokens} tokens, {out.prefill_tokens_per_s:.1f} tokens/s; "
          f"decode: {out.decode_tokens} tokens, {out.decode_tokens_per_s:.1f} tokens/s "
          f"({args.device}, {model.weight_format} weights)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vbw-cupy", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest", help="every kernel against the float64 reference, with timings against its peer")
    sub.add_parser("info", help="device, architecture, NVRTC version, tuning cache")
    b = sub.add_parser("bench", help="run the pytest-benchmark suite in bench/ (source checkout)")
    b.add_argument("pytest_args", nargs="*")
    t = sub.add_parser("tune", help="autotune the standard shapes of every kernel and cache the choices")
    t.add_argument("kernels", nargs="*")
    g = sub.add_parser("generate", help="generate text with a Llama checkpoint (llama2.c .bin or Hugging Face folder)")
    g.add_argument("checkpoint", help="a llama2.c .bin file or a Hugging Face Llama folder")
    g.add_argument("--tokenizer", help="tokenizer.bin or tokenizer.json (default: beside / inside the checkpoint)")
    g.add_argument("--prompt", default="", help="the prompt text (default: empty, BOS only)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 is off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--weights", choices=("fp32", "fp16", "nvfp4", "mxfp4"),
                   help="linear weights as stored in memory (default fp32 on cpu, fp16 on gpu)")
    g.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu when one is visible, else cpu")
    g.add_argument("--print-ids", action="store_true", help="print the prompt and generated token ids")
    args = p.parse_args(argv)
    return {"selftest": cmd_selftest, "info": cmd_info, "bench": cmd_bench, "tune": cmd_tune,
            "generate": cmd_generate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
