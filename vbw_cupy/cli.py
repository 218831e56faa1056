"""Command line: ``vbw-cupy selftest | info | bench | bench-model | tune | warmup | generate`` (also
``python -m vbw_cupy``)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
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
OP_MODULES = ("fp4", "fp8", "gemm", "attention", "attention_fp8", "paged", "sparse", "models.gpu", "dist.ring", "autotune")


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
    naive = False
    for r in rows:
        ratio = r["peer_ms"] / r["time_ms"] if r.get("peer_ms") and r.get("time_ms") else None
        ratio_s = _fmt(ratio, ".2f") + ("x" if ratio else "")
        if ratio and r.get("peer_naive"):  # in parentheses: no claim against a tuned kernel
            ratio_s, naive = f"({ratio_s})", True
        cells.append([str(r["op"]), str(r["shape"]), _fmt(r.get("error"), ".2e"), _fmt(r.get("bound"), ".2e"),
                      "yes" if r.get("ok") else "NO", _fmt(r.get("time_ms"), ".4f"), str(r.get("peer") or "-"),
                      _fmt(r.get("peer_ms"), ".4f"), ratio_s])
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=out)
    print("ratio = peer time / our time (> 1 means vbw_cupy is faster)", file=out)
    if naive:
        print("(ratio) = against a naive peer, not a tuned kernel: no performance claim. For a real peer install "
              "nvidia-cudnn-frontend (pip install vbw_cupy[cudnn]) or torch.", file=out)


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
    return rt.cupy_missing() if not rt.have_cupy() else "no CUDA device is visible"


# selftest's exit status: 0 every GPU kernel within bounds; 1 a row out of bounds or an op failed;
# 3 no GPU kernel ran (no CuPy, no visible GPU, or one older than sm_80): only the NumPy reference was checked.
EXIT_REFERENCE_ONLY = 3
SELFTEST_EXIT_CODES = (f"exit status: 0 every kernel within its bound; 1 a check failed; {EXIT_REFERENCE_ONLY} no GPU "
                       "kernel ran (no CuPy, no GPU, or one older than sm_80), only the NumPy reference was checked")


def _gpu_unusable() -> str | None:
    """Why the GPU kernels cannot run here, or None when they can."""
    if not rt.gpu_available():
        return _no_gpu_reason()
    try:
        _device.device_arch()
    except RuntimeError as e:
        return str(e)
    return None


def cmd_selftest(args) -> int:
    why = _gpu_unusable()
    if why:
        print(f"vbw-cupy selftest: {why.rstrip('.')}; GPU kernels not run. Checking the NumPy reference path only.")
        rows = _cpu_selftest()
        print_table(rows)
        ok = all(r["ok"] for r in rows)
        print(f"reference path {'within bounds' if ok else 'FAILED'}; no GPU kernel was checked "
              f"(exit status {EXIT_REFERENCE_ONLY if ok else 1})")
        if getattr(args, "cold", False):
            print("--cold: first-call times need a GPU; none were measured")
        return EXIT_REFERENCE_ONLY if ok else 1
    cp = rt.require_cupy()
    dev = cp.cuda.Device().id
    print(f"vbw-cupy selftest on {_device.device_name(dev)} (sm_{_device.device_arch()}), "
          f"NVRTC {rt.nvrtc_version()}", flush=True)
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
    if getattr(args, "cold", False):
        from . import _coldstart
        cold = _coldstart.measure(progress=lambda m: print(m, file=sys.stderr, flush=True))
        _coldstart.print_rows(cold)
    return 1 if failed else 0


def cmd_info(args) -> int:
    from . import autotune
    print(f"vbw_cupy {__version__}")
    print(f"cuda sources: {rt.SOURCE_DIR} (hash {rt.sources_hash()})")
    print(f"cache dir: {rt.cache_dir()}")
    if not rt.have_cupy():
        print(f"CuPy: {rt.cupy_missing().removeprefix('CuPy is ')} (GPU paths unavailable; NumPy inputs use the "
              "reference)")
    else:
        cp = rt.require_cupy()
        print(f"CuPy {cp.__version__}, NVRTC {rt.nvrtc_version()}, CUDA headers: {rt.cuda_include_dir()}")
        why = _gpu_unusable()
        if not rt.gpu_available():
            print("device: none visible")
        elif why:
            print(f"device: {why}")
        else:
            dev = cp.cuda.Device().id
            mem = cp.cuda.runtime.getDeviceProperties(dev)["totalGlobalMem"]
            print(f"device: {_device.device_name(dev)}, sm_{_device.device_arch()}, {_device.num_sms()} SMs, "
                  f"{mem / 2**30:.1f} GiB")
    s = autotune.cache_summary()
    print(f"autotune cache: {s['path']} ({s['status']}, {s['entries']} entries; "
          f"VBW_CUPY_AUTOTUNE={os.environ.get(autotune.ENV_SWITCH, '(unset)')}: "
          f"{'tuning new keys' if autotune.forced() else 'defaults only' if not autotune.enabled() else 'tuning new keys except on settled archs (sm_90: tuned entries or defaults, never timed at a call)'})")
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
    from . import _report
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        print(f"vbw-cupy bench: --report: {args.report} exists and is not a directory", file=sys.stderr)
        return 2
    if args.json:  # a report of earlier runs: nothing to run
        if not args.report:
            print("vbw-cupy bench: --json needs --report DIR", file=sys.stderr)
            return 2
        try:
            results = _report.load(args.json)
        except (OSError, ValueError) as e:  # (a missing file, not JSON, no 'benchmarks' list)
            print(f"vbw-cupy bench: --json: {e}", file=sys.stderr)
            return 2
        print(_report.write(results, args.report))
        return 0
    if importlib.util.find_spec("pytest") is None or importlib.util.find_spec("pytest_benchmark") is None:
        print("vbw-cupy bench: needs pytest and pytest-benchmark: pip install -e '.[test]'", file=sys.stderr)
        return 1
    extra = []
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        json_path = Path(args.report).resolve() / "benchmarks.json"
        extra = [f"--benchmark-json={json_path}"]
    cmd = [sys.executable, "-m", "pytest", str(bench_dir), "--benchmark-only", "-q", *extra, *args.pytest_args]
    print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd, cwd=str(bench_dir.parent))
    why = _gpu_unusable()
    if args.report:
        if not json_path.is_file():
            print(f"vbw-cupy bench: pytest wrote no {json_path}; no report", file=sys.stderr)
            if rc == 0 and why:
                print(f"vbw-cupy bench: {why.rstrip('.')}: nothing was measured (exit status "
                      f"{EXIT_REFERENCE_ONLY})", file=sys.stderr)
                return EXIT_REFERENCE_ONLY
            return rc or 1
        print(_report.write(_report.load([json_path]), args.report))
    if rc == 0 and why and "-h" not in args.pytest_args and "--help" not in args.pytest_args:
        print(f"vbw-cupy bench: {why.rstrip('.')}: every benchmark was skipped, nothing was measured "
              f"(exit status {EXIT_REFERENCE_ONLY})", file=sys.stderr)
        return EXIT_REFERENCE_ONLY
    return rc


def cmd_bench_model(args) -> int:
    script = rt.SOURCE_DIR.parent / "bench" / "bench_model.py"
    if not script.is_file():
        print(f"vbw-cupy bench-model: the benchmark lives in the source checkout (bench/bench_model.py), not found "
              f"next to {rt.SOURCE_DIR}")
        return 1
    why = _gpu_unusable()
    if why:
        print(f"vbw-cupy bench-model: {why.rstrip('.')}; the model benchmark needs a GPU, nothing was measured "
              f"(exit status {EXIT_REFERENCE_ONLY}).")
        return EXIT_REFERENCE_ONLY
    return subprocess.call([sys.executable, str(script), *(["--quick"] if args.quick else [])])


def cmd_tune(args) -> int:
    from . import autotune
    mods = op_modules()  # importing the op modules registers their tunables
    unknown = [n for n in args.kernels if n not in autotune.registered()]
    if unknown:
        print(f"vbw-cupy tune: unknown kernel name(s) {', '.join(unknown)}; expected some of: "
              f"{', '.join(autotune.registered())}", file=sys.stderr)
        return 2
    why = _gpu_unusable()
    if why:
        print(f"vbw-cupy tune: {why.rstrip('.')}; tuning times kernels on a GPU, nothing was measured "
              f"(exit status {EXIT_REFERENCE_ONLY}).")
        return EXIT_REFERENCE_ONLY
    # every candidate of every kernel, compiled in parallel first, so tuning times kernels, not NVRTC (a
    # candidate that does not compile is scored unusable by the tuner, and its row says so)
    rt.precompile([inst for m in mods for inst in m.kernel_instances()])
    rows = autotune.tune(names=args.kernels or None, progress=True)
    autotune.print_tune_table(rows)
    failed = [r for r in rows if r.get("chosen") is None]
    if failed:   # (every candidate of a row failed: its default stays, nothing was tuned there)
        print(f"vbw-cupy tune: {len(failed)} of {len(rows)} rows found no working candidate", file=sys.stderr)
        return 1
    return 0


def cmd_warmup(args) -> int:
    from . import _warmup
    if not rt.have_cupy():
        print(f"vbw-cupy warmup: {rt.cupy_missing()}; nothing to compile (CuPy with NVRTC compiles: pip install "
              "-e '.[cuda12]'; no GPU is needed with --arch).", file=sys.stderr)
        return 1
    arch = args.arch
    if arch is None:
        why = _gpu_unusable()
        if why:
            print(f"vbw-cupy warmup: {why.rstrip('.')}; give --arch (80, 86, 87, 89 or 90) to compile for a GPU that is "
                  "not here.", file=sys.stderr)
            return 1
        arch = _device.device_arch()
    try:
        insts = set(_warmup.op_instances(args.ops, arch)) if args.ops or not args.model else set()
        if args.model:
            insts |= set(_warmup.model_instances(args.model, arch))
    except (ValueError, OSError, KeyError) as e:
        print(f"vbw-cupy warmup: {e}", file=sys.stderr)
        return 2
    what = ", ".join(filter(None, [", ".join(args.ops or []), args.model and f"model {args.model}"])) or "every op"
    print(f"vbw-cupy warmup: {len(insts)} kernel instances ({what}) for sm_{arch} into {rt.cache_dir() / 'kernels'}",
          flush=True)
    unstored = len(rt._unstored)
    bad = rt.precompile(sorted(insts), arch=arch, workers=args.workers, progress=True)
    if rt.kernel_cache_dir() is None or len(rt._unstored) > unstored:  # (compiled, not stored: gone at exit)
        print(f"vbw-cupy warmup: the kernel cache {rt.cache_dir() / 'kernels'} could not be written: nothing was "
              "kept (see the warning above; VBW_CUPY_CACHE_DIR picks another place)", file=sys.stderr)
        return 1
    return 1 if bad else 0


def _default_tokenizer(checkpoint: str) -> Path:
    """tokenizer.json inside a Hugging Face folder, tokenizer.bin beside a llama2.c file."""
    ckpt = Path(checkpoint)
    return ckpt / "tokenizer.json" if ckpt.is_dir() else ckpt.parent / "tokenizer.bin"


def cmd_generate(args) -> int:
    try:
        return _generate(args)
    except BrokenPipeError:   # (main's: the reader of the output went away)
        raise
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
        print(f"vbw-cupy generate: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from .models import Sampler, generate_ids, load_model, load_tokenizer
    from .models.generate import check_prompt
    args.device = args.device or ("gpu" if rt.gpu_available() else "cpu")
    if args.tp != 1:  # tensor-parallel ranks: simulated on cpu, one GPU each over NCCL on gpu (vbw_cupy.dist)
        from .dist import load_tp_model
        model = load_tp_model(args.checkpoint, args.tp, weights=args.weights, device=args.device)
    else:
        model = load_model(args.checkpoint, weights=args.weights or ("fp32" if args.device == "cpu" else "fp16"),
                           device=args.device)
    cfg = model.config
    # (a config with no EOS id: the tokenizer's EOS only ends encodes asked for with eos=True, which this never does)
    tok = load_tokenizer(args.tokenizer or _default_tokenizer(args.checkpoint), cfg.bos_id,
                         cfg.eos_ids[0] if cfg.eos_ids else 2,
                         vocab_size=cfg.vocab_size)
    # (bytes of the command line that are not UTF-8 arrive as surrogates: U+FFFD for each, as a decoder would)
    args.prompt = args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    ids = tok.encode(args.prompt, bos=True)
    check_prompt(ids, cfg.seq_len, 0, cfg.vocab_size)   # (these checks before the prompt is echoed)
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: expected a value >= 0, got {args.max_new_tokens}")
    print(args.prompt, end="", flush=True)
    stream = tok.stream(ids[-1])
    out = generate_ids(model, [ids], max_new_tokens=args.max_new_tokens, sampler=sampler,
                       on_token=lambda b, t: print(stream.push(t), end="", flush=True))
    print(stream.flush())
    if args.print_ids:
        print("ids: " + " ".join(str(t) for t in ids + out.sequences[0].ids))
    print(f"prefill: {out.prefill_tokens} tokens, {out.prefill_tokens_per_s:.1f} tokens/s; "
          f"decode: {out.decode_tokens} tokens, {out.decode_tokens_per_s:.1f} tokens/s "
          f"({getattr(model, 'where', args.device)}, {model.weight_format} weights)", file=sys.stderr)
    seq = out.sequences[0]
    if seq.finish_reason == "stop":
        print(f"stopped after {len(seq.ids)} new tokens: the model sampled a stop id (BOS / EOS: "
              f"{sorted(cfg.stop_ids)})", file=sys.stderr)
    elif seq.finish_reason == "length" and len(seq.ids) < args.max_new_tokens:
        print(f"stopped after {len(seq.ids)} new tokens: the prompt ({len(ids)} tokens) and the generated ones fill "
              f"the model's seq_len = {model.config.seq_len} (the last new token is never fed back, as in llama2.c)",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vbw-cupy", description=__doc__)
    p.add_argument("--version", action="version", version=f"vbw_cupy {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name, help, description, **kw):
        return sub.add_parser(name, help=help, description=description, **kw)

    st = add("selftest", "every kernel against the float64 reference, with timings against its peer",
             "Run every operation at real sizes on the GPU against the float64 reference and print a table of "
             "error, bound, time and the time of a peer measured in the same run. Without a usable GPU it checks "
             "the NumPy reference path instead and says so.", epilog=SELFTEST_EXIT_CODES)
    st.add_argument("--cold", action="store_true", help="also time each op's first call in fresh processes: on an "
                    "empty cache (compiling and tuning) and on the warm disk cache (a minute or two)")
    add("info", "device, architecture, NVRTC version, tuning cache",
        "Print the version, the CUDA sources and their hash, the cache directory, CuPy / NVRTC / CUDA headers, "
        "the device (name, sm_XX, SMs, memory) and what the autotune cache holds.")
    b = add("bench", "run the pytest-benchmark suite in bench/ (source checkout); other options go to pytest",
        "Run `python -m pytest bench/ --benchmark-only -q` in the source checkout. Every other argument is "
        "passed to pytest as given, e.g. `vbw-cupy bench -k attention`; after `--` even options this command "
        "knows (`vbw-cupy bench -- -h` is pytest's help). With --report DIR the results also go to "
        "DIR/benchmarks.json and DIR/index.md: a table per operation and, with matplotlib, a plot of each "
        "operation's throughput against its peers over the benchmark shapes.", allow_abbrev=False)
    b.add_argument("--report", metavar="DIR", help="write DIR/index.md (tables, PNG plots) from this run's results")
    b.add_argument("--json", nargs="+", metavar="FILE", help="with --report: build the report from these "
                   "pytest-benchmark JSON files instead of running the benchmarks")
    t = add("tune", "autotune the standard shapes of every kernel and cache the choices",
            "Compile every tuning candidate in parallel, time the candidates of each kernel's standard shapes on "
            "this GPU and store the winners in $VBW_CUPY_CACHE_DIR/autotune.json; prints a table of the choices.")
    t.add_argument("kernels", nargs="*", help="Tunable names (default: all; an unknown name lists them)")
    w = add("warmup", "compile ahead of time the kernels that ops or a model will use on this GPU",
            "Compile on parallel threads, into the kernel cache ($VBW_CUPY_CACHE_DIR/kernels), every kernel "
            "instance that the given ops (default: every op) or a Llama of the given checkpoint can launch on this "
            "GPU's architecture, tuning candidates included, so that first calls load instead of compiling. A "
            "progress bar appears when it takes more than 2 s. Exit status 1 if an instance failed to compile.")
    from ._warmup import OPS
    w.add_argument("--ops", nargs="+", choices=list(OPS), metavar="OP", help=f"some of: {', '.join(OPS)}")
    w.add_argument("--model", metavar="PATH", help="a llama2.c .bin file or a Hugging Face Llama folder")
    w.add_argument("--arch", type=int, choices=(80, 86, 87, 89, 90),
                   help="compile for this sm_XX instead of the visible GPU's (no GPU needed)")
    w.add_argument("--workers", type=int, default=None, help="compiler threads (default: the CPU count, at most 16)")
    bm = add("bench-model", "Llama decode and prefill against torch and the memory roofline",
             "Run bench/bench_model.py (source checkout, GPU): decode tokens/s of the GPU Llama with nvfp4 and fp16 "
             "weights against a torch fp16 Llama in a CUDA graph and against the memory roofline, and prefill time.")
    bm.add_argument("--quick", action="store_true", help="skip the 7B batch-16 and 2048-token prefill runs")
    g = add("generate", "generate text with a Llama checkpoint (llama2.c .bin or Hugging Face folder)",
            "Load a Llama-architecture checkpoint (llama2.c .bin with tokenizer.bin, or a Hugging Face folder with "
            "config.json, *.safetensors and tokenizer.json) and generate text from a prompt, on the GPU or with "
            "the float64 reference ops on the CPU.")
    g.add_argument("checkpoint", help="a llama2.c .bin file or a Hugging Face Llama folder")
    g.add_argument("--tokenizer", help="tokenizer.bin or tokenizer.json (default: beside / inside the checkpoint)")
    g.add_argument("--prompt", default="", help="the prompt text (default: empty, BOS only)")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="default 256; a sequence also stops at the checkpoint's seq_len")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 is off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--weights", choices=("fp32", "fp16", "nvfp4", "mxfp4"),
                   help="linear weights as stored in memory (default fp32 on cpu, fp16 on gpu)")
    g.add_argument("--device", choices=("gpu", "cpu"), help="default: gpu when one is visible, else cpu")
    g.add_argument("--print-ids", action="store_true", help="print the prompt and generated token ids")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: N GPUs over NCCL, or with --device cpu "
                   "N simulated ranks (default 1)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.cmd == "bench":  # everything argparse did not take goes to pytest, in order (the first "--" dropped)
        if "--" in rest:
            rest.remove("--")
        args.pytest_args = rest
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    cmd = {"selftest": cmd_selftest, "info": cmd_info, "bench": cmd_bench, "tune": cmd_tune,
           "generate": cmd_generate, "bench-model": cmd_bench_model, "warmup": cmd_warmup}[args.cmd]
    try:
        return cmd(args)
    except BrokenPipeError:   # the reader of the output went away (`vbw-cupy selftest | head`): no traceback
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (Python's exit flush then succeeds)
        except (OSError, ValueError):
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
