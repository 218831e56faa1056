"""Autotuning of kernel template parameters, remembered on disk (README, "Autotuning").

A kernel module declares what can be tuned once, at import time::

    from vbw_cupy import autotune

    GEMM_TUNABLE = autotune.register(autotune.Tunable(
        name="fp4_gemm",
        params=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
        candidates=tuple(dict(BLOCK_M=m, BLOCK_N=n, WARPS=w, STAGES=s)
                         for m in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3)),
        defaults={80: dict(BLOCK_M=128, BLOCK_N=128, WARPS=8, STAGES=3),
                  86: ..., 89: ..., 90: ...},        # other archs use the nearest lower one
        bucket=lambda s: (autotune.pow2_bucket(s["M"], lo=16, hi=8192), s["N"], s["K"]),
        fits=lambda cfg, lim: smem_bytes(cfg) <= lim["smem_optin"],
        source="fp4_gemm_sm80.cu",                  # a cuda_src/ file, or a tuple of them
        standard_shapes=(({"M": 4096, "N": 4096, "K": 4096}, "float16"),),   # for `vbw-cupy tune`
        bench=make_gemm_bench,                       # (shape, dtype) -> run(cfg), inputs built inside
    ))

and at each call asks for a config, passing a closure that launches the kernel ONCE with a given config on the
caller's own arrays::

    cfg = autotune.pick("fp4_gemm", {"M": M, "N": N, "K": K}, a.dtype, lambda c: _launch(c, a, w, out))
    _launch(cfg, a, w, out)

`pick` returns, in this order of preference:
- ``VBW_CUPY_AUTOTUNE=0``: the per-arch default (``default_config``); nothing is ever timed. With the
  variable unset, on the archs listed in the Tunable's ``settled`` (where an A/B showed tuning not beating the
  defaults): a config ``vbw-cupy tune`` stored in the cache, else the default, never timed at a call;
  ``VBW_CUPY_AUTOTUNE=1`` tunes there too.
- a cache hit: memory first, then ``$VBW_CUPY_CACHE_DIR/autotune.json`` (re-read on every memory miss, so a
  key another process tuned meanwhile is reused).
- otherwise it tunes: the kernels of every candidate that passes ``fits`` compile on parallel threads
  (``_ready_candidates``: each candidate runs once under ``rt.collecting()``, which names the kernels it needs
  without compiling them), and each candidate is timed as soon as its kernels are there, while slower ones
  still compile (the default, always timed first). Timing runs it with CUDA events on the current stream: one
  warm-up launch, then the
  median of 3..50 timed launches, with a zeroed buffer of twice the device's L2 read before every timed launch
  (outside the timed interval) so no config wins from a warm L2 and none pays for a dirty one (a Tunable with ``warm_l2=True`` is timed instead on WARM_INNER back-to-back launches per sample, the
  steady state of repeated calls). Repetitions are capped by measured time: tuning one key costs about
  ``VBW_CUPY_AUTOTUNE_BUDGET_S`` seconds (default 3) of timed launches plus the compile time of the instances;
  a candidate whose first timing is over 3x the best so far is not repeated. The winner is stored in memory and
  merged into the JSON file.
  While the current stream is capturing a CUDA graph, a miss returns the default without timing.

Rules for the ``run`` closure (kernel authors, read this):
- it must let ``rt.NeedsCompile`` through (no bare ``except Exception`` around its launches): that is how the
  tuner learns which kernels to compile before timing a candidate;
- it must be idempotent: it runs many times, so it must not accumulate into its output (zero it inside
  ``run`` if the kernel accumulates, e.g. split-K with atomics) and must not modify its inputs;
- any exception it raises (NVRTC ``CompileError``, ``cudaErrorLaunchOutOfResources``, too many threads,
  a ``ValueError`` for a config it does not support) scores that candidate as unusable; tuning goes on.
- EXCEPT sticky CUDA errors (illegal address, illegal instruction, misaligned address, launch failure,
  hardware stack error): they kill the CUDA context, no later launch in the process can succeed, and they
  cannot be recovered. `pick` re-raises them as a RuntimeError naming the kernel and config. A kernel must
  therefore be correct for every candidate it lists (test all candidates in a subprocess; `fits` must prune
  configs the kernel cannot run, e.g. wgmma with fewer than 128 threads).

The cache key (``make_key``) is ``kernel | source hash | device name | sm_XX | nvrtc X.Y | dtype | bucket``.
The source hash covers the kernel's ``.cu`` file and every ``.cuh`` in ``cuda_src/`` (editing one kernel
does not invalidate the others' tuning; editing a shared header invalidates all). The bucket comes from the
Tunable's ``bucket(shape)``; its rule is documented in the kernel module's docstring; ``pow2_bucket`` is the
usual building block.

The JSON file holds ``{"meta": {"tool": "vbw_cupy.autotune", "format": FORMAT_VERSION, "vbw_cupy": version},
"entries": {key: {...}}}``. Writes go to a temporary file that replaces the old one (``os.replace``), while an
``fcntl.flock`` on ``autotune.json.lock`` is held and after re-reading the file, so two processes tuning at
once both keep their keys. A corrupt, foreign or stale (other format version) file is ignored with one
warning per process and rewritten by the next store. An entry is used only if its config names one this
version declares, with the same keys, values and types (64.0 or true is not 64; ``_declared``), and ``pick``
hands back the declared dict, never the file's; any other entry is ignored with one warning and its key
re-tuned. A read-only cache directory degrades to memory only.

Ahead of time: ``tune(names=None, shapes=None)`` (what ``vbw-cupy tune`` calls) tunes each Tunable's
``standard_shapes`` with its ``bench`` and returns table rows; ``format_rows(rows)`` / ``print_tune_table(rows)``
show them.
``cache_summary()`` describes the file for ``vbw-cupy info``. ``stats()`` counts timer calls and hits.

Tests replace the timer: ``autotune._timer = lambda run, cfg, **kw: ms`` (keywords: ``budget_s``,
``cutoff_ms``, ``flush``), and ``autotune._device_info`` to run without a GPU; ``autotune.reset()`` forgets the
memory cache, warnings and counters (a "new process").

Launch-plan caches in the op modules put ``autotune.generation(name)`` in their keys: it changes whenever a
config that Tunable `name` picks may change (a store for `name`; ``reset`` and ``register`` change it for every
name), so tuning one kernel does not send every other op's calls back through their full, checked path.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _device, _progress
from . import _runtime as rt
from . import _timing

try:  # POSIX; elsewhere writes are still atomic, just not merged under a lock
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

ENV_SWITCH = "VBW_CUPY_AUTOTUNE"
ENV_BUDGET = "VBW_CUPY_AUTOTUNE_BUDGET_S"
FORMAT_VERSION = 1
CACHE_FILENAME = "autotune.json"
TOOL = "vbw_cupy.autotune"
MIN_REPS, MAX_REPS = 3, 50
CUTOFF_FACTOR = 3.0          # a candidate first measured over 3x the best so far is not repeated
CONFIRM_ROUNDS = 3           # the winner and the default re-timed alternately this many times...
CONFIRM_MARGIN = 0.97        # ...and the winner kept only if its median is at least 3% below the default's
WARM_INNER = 4               # back-to-back launches per sample for Tunable.warm_l2
SETTLE_FACTOR = 1.0          # reps target: budget / n_candidates seconds of timed launches each


# ----------------------------------------------------------------------------------------------- declaring
@dataclass(frozen=True)
class Tunable:
    """What one kernel can tune. See the module docstring for an example.

    name: registry name ("fp4_gemm"). params: template parameter names; every config is a dict over them.
    candidates: configs to time. defaults: {arch: config} for at least 80, 86, 89, 90; an arch not listed
    uses the nearest lower one (or the lowest listed when the arch is below all of them).
    bucket: shape dict -> hashable tuple; shapes in one bucket share a tuned config.
    fits: (config, device limits) -> bool, prunes configs before timing (see ``device_limits``).
    source: the cuda_src/ filename (or a tuple of them), hashed into the key. standard_shapes / bench: for ``tune``.
    warm_l2: time back-to-back launches on the caller's arrays instead of one launch after an L2 flush, for
    kernels whose repeated-call speed ranks the configs differently from a cold start (attention on an H200:
    with the flush, one-warpgroup tiles won and then ran 0.62x of the default in back-to-back calls).
    settled: archs whose defaults tuning did not beat (bench/autotune_ab.py: tuned against default configs,
    interleaved in one process): there ``pick`` keeps the defaults unless VBW_CUPY_AUTOTUNE=1 asks for tuning.
    default_for: (shape, arch, defaults' config) -> the default of that shape, for kernels whose best default
    depends on the shape (attention's long sequences); None: defaults[arch] for every shape.
    family: the name whose ``generation`` a store for this Tunable changes ("": its own name); Tunables that one
    op chooses among by shape (fp4_matmul's regimes) share one, so the op's plan keys need not compute which.
    """
    name: str
    params: tuple[str, ...]
    candidates: tuple[dict, ...]
    defaults: dict[int, dict]
    bucket: Callable[[dict], tuple]
    fits: Callable[[dict, dict], bool] | None = None
    source: str = ""
    standard_shapes: tuple = ()
    bench: Callable[[dict, Any], Callable[[dict], None]] | None = None
    warm_l2: bool = False
    settled: tuple[int, ...] = ()
    default_for: Callable[[dict, int, dict], dict] | None = None
    family: str = ""

    def __post_init__(self):
        if not self.defaults:
            raise ValueError(f"Tunable {self.name}: defaults must name a config for at least one arch")
        for what, cfgs in (("candidates", self.candidates), ("defaults", tuple(self.defaults.values()))):
            for c in cfgs:
                if set(c) != set(self.params):
                    raise ValueError(f"Tunable {self.name}: {what} config {c} must set exactly {self.params}")


_registry: dict[str, Tunable] = {}


def register(t: Tunable) -> Tunable:
    """Add (or replace, e.g. on module reload) a Tunable; returns it so modules can keep a handle."""
    global _generation
    with _lock:
        _registry[t.name] = t
        _picked.clear()  # a replaced Tunable may no longer declare a remembered config (see _declared)
        _generation += 1
    return t


def get(name: str) -> Tunable:
    try:
        return _registry[name]
    except KeyError:
        raise KeyError(f"autotune: no Tunable named {name!r} (registered: {sorted(_registry)})") from None


def registered() -> list[str]:
    return sorted(_registry)


_mode_last: tuple = (None, 1)  # (raw value, parsed): every fast-path call asks, the value rarely changes
# os.environ.get costs ~1.3 us (key encoding, value decoding): a fast path's biggest Python item. CPython keeps the
# raw (encoded) environment in os.environ._data, which putenv-ing assignments to os.environ update: read that.
try:
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(ENV_SWITCH)
except (AttributeError, TypeError, ValueError):  # another Python: the public mapping
    _ENV_DATA, _ENV_KEY = os.environ, ENV_SWITCH


def mode() -> int:
    """VBW_CUPY_AUTOTUNE read as 0 ("0", off, false, no: the per-arch defaults everywhere), 1 (unset or any
    other value: tune new keys except on a Tunable's settled archs) or 2 ("1", on, true, yes: tune new keys
    everywhere). Plan caches key on it, so changing the variable takes effect at the next call."""
    global _mode_last
    raw = _ENV_DATA.get(_ENV_KEY)
    if raw != _mode_last[0]:
        v = (os.environ.get(ENV_SWITCH) or "").strip().lower()
        _mode_last = (raw, 0 if v in ("0", "off", "false", "no") else 2 if v in ("1", "on", "true", "yes") else 1)
        if v and _mode_last[1] == 1:  # (once per value: this runs when the variable changes)
            warnings.warn(f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r} is none of 0 / off / false / no, 1 / on / "
                          "true / yes: read as unset (tune new keys except on settled archs)", stacklevel=2)
    return _mode_last[1]


def forced() -> bool:
    """VBW_CUPY_AUTOTUNE=1: tune new keys even on a Tunable's settled archs."""
    return mode() == 2


def enabled() -> bool:
    """VBW_CUPY_AUTOTUNE is not "0": tuning (or a tuned config from the cache) may replace the defaults."""
    return mode() > 0


def _budget_s() -> float:
    try:
        return max(0.05, float(os.environ.get(ENV_BUDGET, "3")))
    except ValueError:
        return 3.0


def pow2_bucket(n: int, lo: int | None = None, hi: int | None = None) -> int:
    """Smallest power of two >= n (1 for n <= 1), clamped to [lo, hi]: 1000 -> 1024, 1024 -> 1024, 1025 -> 2048."""
    n = int(n)
    b = 1 if n <= 1 else 1 << (n - 1).bit_length()
    if lo is not None:
        b = max(b, int(lo))
    if hi is not None:
        b = min(b, int(hi))
    return b


def _nearest_arch(arch: int, archs) -> int:
    archs = sorted(archs)
    lower = [a for a in archs if a <= arch]
    return lower[-1] if lower else archs[0]


def default_config(name: str, arch: int | None = None, shape: dict | None = None) -> dict:
    """The per-arch default of kernel `name` (arch None: the current device's), as a fresh dict; with `shape`,
    the Tunable's default_for that shape where it has one."""
    t = get(name)
    if arch is None:
        arch = _device_info()["arch"]
    cfg = t.defaults[_nearest_arch(int(arch), t.defaults)]
    if shape is not None and t.default_for is not None:
        cfg = t.default_for(shape, int(arch), cfg)
    return dict(cfg)


# -------------------------------------------------------------------------------------------- the device
# Tests replace this with a function returning the same dict shape (no GPU needed).
_device_info: Callable[[], dict] = _device.query_device


def device_limits() -> dict:
    """Limits passed to ``Tunable.fits``: arch, smem_optin (max dynamic+static shared memory per block after
    opt-in, bytes), smem_per_sm, max_threads (per block), regs_per_block, num_sms, l2_bytes."""
    return dict(_device_info()["limits"])


def kernel_fits(kernel, threads: int, smem_bytes: int, limits: dict) -> bool:
    """For a compiled cupy.RawKernel: does a launch with `threads` threads per block and `smem_bytes` of
    dynamic shared memory fit? Uses the kernel's attributes (registers, static smem, max threads); local
    memory (spills) is allowed, the timing judges it. Call it from ``fits`` when the compile is cheap."""
    at = kernel.attributes
    if threads > min(int(at.get("max_threads_per_block", limits["max_threads"])), limits["max_threads"]):
        return False
    if int(at.get("num_regs", 0)) * threads > limits["regs_per_block"]:
        return False
    return int(at.get("shared_size_bytes", 0)) + int(smem_bytes) <= limits["smem_optin"]


# ------------------------------------------------------------------------------------------------ the key
def _dtype_name(dtype) -> str:
    if dtype is None:
        return "none"
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _bucket_str(t: Tunable, shape: dict) -> str:
    b = t.bucket(shape)
    if not isinstance(b, tuple):
        b = (b,)
    return ",".join(str(x) for x in b)


def make_key(name: str, shape: dict, dtype, device: dict | None = None) -> str:
    """``kernel|source hash|device name|sm_XX|nvrtc X.Y|dtype|bucket`` for the current (or given) device."""
    t = get(name)
    dev = device if device is not None else _device_info()
    return "|".join((t.name, rt.source_hash(t.source), dev["name"], f"sm_{dev['arch']}", f"nvrtc{dev['nvrtc']}",
                     _dtype_name(dtype), _bucket_str(t, shape)))


# ---------------------------------------------------------------------------------------------- the cache
_lock = threading.RLock()
_memory: dict[str, dict] = {}
# (name, device id, dtype, shape items, settled) -> config: pick()'s hit path skips building the key (~5 us a call,
# which a host-bound short kernel pays in full). Keyed by the exact shape, not its bucket, so it is bounded:
# forgotten all at once at _MAX_PICKED entries (a decode loop asks with a new sequence length every step).
_picked: dict[tuple, dict] = {}
_MAX_PICKED = 4096
# Bumped whenever a stored config may change: launch-plan caches in the op modules include it in their keys.
_generation = 0                   # bumped by reset() / register(): every Tunable's picks may change
_generations: dict[str, int] = {}  # per Tunable name, bumped by a store for that name


def generation(name) -> tuple[int, int]:
    """What plan keys hold for Tunable `name` (or a Tunable family): it changes whenever a config it picks may
    change."""
    return _generation, _generations.get(name, 0)
_stats = {"timer_calls": 0, "tuned": 0, "memory_hits": 0, "disk_hits": 0, "defaults": 0, "failed": 0,
          "retimed": 0, "compiled": 0, "compile_s": 0.0, "timing_s": 0.0}


def cache_path() -> pathlib.Path:
    return rt.cache_dir() / CACHE_FILENAME


def stats() -> dict:
    """Counters since import / reset(): timer_calls, tuned (keys), memory_hits, disk_hits, defaults, failed
    (candidates scored unusable), retimed (candidates cut off while compiles ran and timed again after them),
    compiled (kernels compiled for candidates, in parallel, while others are
    timed), compile_s and timing_s (seconds of tuning not spent timing, mostly waiting for compiles, and
    seconds spent running candidates for timing)."""
    return dict(_stats)


def reset() -> None:
    """Forget the in-memory cache, the one-time warnings and the counters (what a new process would see)."""
    global _generation
    with _lock:
        _generation += 1
        _memory.clear()
        _picked.clear()
        rt.forget_warnings()
        for k in _stats:
            _stats[k] = type(_stats[k])()



def _meta() -> dict:
    from . import __version__
    return {"tool": TOOL, "format": FORMAT_VERSION, "vbw_cupy": __version__}


def _read_file(path: pathlib.Path) -> tuple[dict, str]:
    """(entries, status) with status "ok", "missing" or why the file was ignored."""
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return {}, "missing"
    except OSError as e:
        return {}, f"unreadable ({e})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # (RecursionError: nested past Python's limit)
        return {}, "corrupt (not valid JSON)"
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or data["meta"].get("tool") != TOOL:
        return {}, "foreign (not written by vbw_cupy.autotune)"
    if data["meta"].get("format") != FORMAT_VERSION:
        return {}, f"stale (format {data['meta'].get('format')!r}, this version reads {FORMAT_VERSION})"
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return {}, "corrupt (no entries table)"
    # entries are checked one by one where they are used (_declared), so one bad entry costs only its own key
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, dict)}, "ok"


def _load(path: pathlib.Path) -> dict:
    entries, status = _read_file(path)
    if status not in ("ok", "missing"):
        rt.warn_once(f"bad:{path}", f"vbw_cupy.autotune: ignoring the tuning cache {path}: {status}; "
                                  "it will be rewritten with the next tuned kernel")
    return entries


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _store(key: str, entry: dict, name: str) -> None:
    """Put one entry (of Tunable `name`) in memory and merge it into the JSON file (lock, re-read, update,
    atomic replace)."""
    with _lock:
        _memory[key] = entry
        for k in [k for k in _picked if k[0] == name]:  # a re-tuned key must not be shadowed by pick()'s shortcut
            del _picked[k]
        t = _registry.get(name)
        fam = (t.family if t is not None else "") or name
        _generations[fam] = _generations.get(fam, 0) + 1
        path = cache_path()
        try:
            rt.make_private_dir(path.parent)
            with _file_lock(path):
                entries = _load(path)
                entries[key] = entry
                data = json.dumps({"meta": _meta(), "entries": entries}, indent=1, sort_keys=True)
                rt.atomic_write(path, data.encode(), fsync=True)
        except OSError as e:
            rt.warn_once(f"ro:{path}", f"vbw_cupy.autotune: cannot write the tuning cache {path} ({e}); "
                                     "tuned configs are kept in memory for this process only")


def _declared(t: Tunable, cfg) -> dict | None:
    """The candidate or default of `t` that a cached config names, or None. Values must match in type as well
    (64.0 or True is not 64: a JSON float would otherwise reach a template argument list as "8.0"), and what is
    returned is the declared dict itself, never the file's. The key hashes the CUDA sources, not the Python
    candidate tables, so an edited table could otherwise hand a kernel a config it lacks."""
    if not isinstance(cfg, dict) or set(cfg) != set(t.params):
        return None
    for c in (*t.candidates, *t.defaults.values()):
        if all(type(cfg[k]) is type(v) and cfg[k] == v for k, v in c.items()):
            return c
    return None


def _lookup(key: str, t: Tunable, limits: dict | None = None) -> dict | None:
    """The cache entry of key (memory, else the file), its config one that t declares and, given the device's
    `limits`, one that t.fits there (a hand-edited or foreign entry never launches an invalid configuration)."""
    e = _memory.get(key)
    if e is None:
        disk = _load(cache_path())
        for k, v in disk.items():  # keep every key read, the next misses are then free
            _memory.setdefault(k, v)
        e = disk.get(key)
        hit = "disk_hits"
    else:
        hit = "memory_hits"
    if e is None:
        return None
    cfg = _declared(t, e.get("config"))
    if cfg is None:
        rt.warn_once(f"stale:{key}", f"vbw_cupy.autotune: ignoring the cached config {e.get('config')!r} for "
                                     f"{t.name}: this version does not declare it (the same keys and values, ints "
                                     "as ints); re-tuning (or, where tuning is settled, using the default)")
        _memory.pop(key, None)
        return None
    if limits is not None and t.fits is not None and not _fits_safely(t, cfg, limits):
        rt.warn_once(f"unfit:{key}", f"vbw_cupy.autotune: ignoring the cached config {cfg!r} for {t.name}: it does "
                                     "not fit this device; re-tuning (or, where tuning is settled, using the default)")
        _memory.pop(key, None)
        return None
    if cfg is not e["config"]:
        e = _memory[key] = {**e, "config": dict(cfg)}
    _stats[hit] += 1
    return e


def _fits_safely(t: Tunable, cfg: dict, limits: dict) -> bool:
    try:
        return bool(t.fits(cfg, limits))
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------- timing
_scratch: dict[int, Any] = {}


def _flush_l2(stream) -> None:
    """Evict the timed kernel's data from L2 by reading a zeroed buffer of twice its size (l2_flush_read): a
    read leaves L2 clean, as a real call finds it (a memset left it dirty, and the write-back slowed the timed
    launch 1.3-1.7x, which ranked memory-bound configs wrongly)."""
    cp = rt.require_cupy()
    dev = cp.cuda.Device()
    got = _scratch.get(dev.id)
    if got is None:
        l2 = int(dev.attributes.get("L2CacheSize", 0)) or (64 << 20)
        got = _scratch[dev.id] = (cp.zeros(2 * l2 // 16 * 16, dtype=cp.uint8), cp.zeros(1, dtype=cp.uint32),
                                  4 * int(dev.attributes.get("MultiProcessorCount", 132)))
    buf, sink, blocks = got
    rt.launch(rt.get_kernel(PROBE_SOURCE, "l2_flush_read"), (blocks,), (256,), (buf, np.int64(buf.nbytes // 16), sink),
              stream=stream)


def _cuda_event_timer(run: Callable[[dict], None], cfg: dict, budget_s: float = 0.2,
                      cutoff_ms: float | None = None, flush: bool = True) -> float:
    """Median milliseconds of run(cfg) on the current stream (`_timing.time_ms`): 1 warm-up, then
    MIN_REPS..MAX_REPS timed launches (as many as fit in budget_s), L2 flushed before each outside the timed
    interval. flush=False times WARM_INNER back-to-back launches per sample instead (the steady state of
    repeated calls)."""
    cp = rt.require_cupy()
    stream = cp.cuda.get_current_stream()
    inner = 1 if flush else WARM_INNER
    before = (lambda: _flush_l2(stream)) if flush else None
    call = lambda: run(cfg)  # noqa: E731
    first = _timing.time_ms(call, warmup=1, rep=1, inner=inner, before=before)
    if cutoff_ms is not None and first > cutoff_ms:
        return first
    reps = int(min(MAX_REPS, max(MIN_REPS, budget_s * 1e3 / max(first * inner, 1e-3))))
    return _timing.time_ms(call, warmup=0, rep=reps, inner=inner, before=before)


# Tests replace this: _timer(run, cfg, budget_s=..., cutoff_ms=...) -> milliseconds.
_timer: Callable[..., float] = _cuda_event_timer

# cudaError / CUresult codes that poison the context: nothing can run after them in this process.
_STICKY = {700, 702, 714, 715, 716, 717, 718, 719}
_STICKY_NAMES = ("illegal address", "illegal_address", "illegal instruction", "illegal_instruction",
                 "misaligned", "unspecified launch failure", "launch_failed", "hardware stack",
                 "invalid program counter", "invalid_pc", "address space")


def _is_sticky(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status in _STICKY:
        return True
    msg = str(exc).lower()
    return type(exc).__name__ in ("CUDARuntimeError", "CUDADriverError") and any(s in msg for s in _STICKY_NAMES)


def _unique(cfgs) -> list[dict]:
    seen, out = set(), []
    for c in cfgs:
        k = tuple(sorted(c.items()))
        if k not in seen:
            seen.add(k)
            out.append(dict(c))
    return out


def _sticky_error(t: Tunable, cfg: dict, e: BaseException) -> RuntimeError:
    return RuntimeError(f"vbw_cupy.autotune: {t.name} config {cfg} hit a sticky CUDA error ({e}); the CUDA context "
                        "is lost and this process cannot launch kernels any more. The kernel must handle every "
                        "candidate it lists (or prune it in fits).")


_ROUNDS = 4   # kernels a candidate may reach one after another (a layout kernel, the GEMM, a split-K reduction)


def _compile_workers() -> int:
    """Compile threads while tuning: one core is left to the thread that times (a stalled launch would count
    as kernel time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(16, cores - 1))


def _ready_candidates(t: Tunable, run, cands, urgent: int | None = None):
    """Yield (i, why, busy) for each candidate of `cands` as soon as its kernels are compiled (why None), or
    once a kernel it needs failed to compile (why: the error; it is scored without compiling again), so
    candidates are timed while slower ones still compile: a first call costs about its slowest compile, not the
    compile then all the timing. busy: compiles were still running when it was yielded (its timing shared the
    CPU with them). Candidate `urgent` (the default, timed first) has its kernels compiled before the others'.

    Each candidate runs once under rt.collecting() (cached kernels load and launch; the first one not compiled
    stops the run with NeedsCompile); what it asked for compiles on an `rt.CompilePool` (NVRTC releases the GIL),
    and when that lands the candidate runs again, for a kernel it reaches only after another (at most _ROUNDS
    rounds; a cache that cannot keep what it compiled asks for a kernel again, and the timing compiles it then).
    The timer's L2 flush kernel is compiled before anything is yielded. Any other error is left to the timing,
    which scores the candidate; with the real (CUDA event) timer each run is synchronized, so a sticky fault is
    blamed on the config that caused it."""
    gpu = _timer is _cuda_event_timer
    failed: dict = {}       # job -> why it failed
    compiled: set = set()   # jobs that landed without error
    waiting: dict = {}      # job -> indices of the candidates waiting for it
    rounds = [0] * len(cands)
    ready: list = []        # (i, why) to yield
    pool = None

    def probe(i):
        """The job candidate i needs next, or None when its kernels are all there."""
        try:
            try:
                with rt.collecting():
                    run(cands[i])
            finally:  # also after NeedsCompile: a kernel launched before it may have faulted
                if gpu:
                    rt.cupy.cuda.get_current_stream().synchronize()
        except rt.NeedsCompile as e:
            return e.job
        except Exception as e:
            if _is_sticky(e):
                raise _sticky_error(t, cands[i], e) from e
        return None

    def submit(job, first: bool):
        nonlocal pool
        pool = pool or rt.CompilePool(_compile_workers())
        _stats["compiled"] += 1
        pool.put(job, first)

    def need(i, job):
        """Candidate i needs `job` next: queue it (or wait for it), or mark i ready when it cannot be had."""
        if job in failed:
            ready.append((i, failed[job]))
        elif job in compiled or rounds[i] >= _ROUNDS:
            ready.append((i, None))   # a cache that cannot keep it, or a long chain: the timing compiles it
        else:
            rounds[i] += 1
            waiting.setdefault(job, []).append(i)
            if len(waiting[job]) == 1:
                submit(job, i == urgent)

    def land():
        """Wait for one compile and move the candidates that waited for it on. Returns the job."""
        job, err = pool.get()
        if err:
            failed[job] = err
        else:
            compiled.add(job)
        for i in waiting.pop(job, []):
            again = None if err else probe(i)
            if again is None:
                ready.append((i, err))
            else:
                need(i, again)
        return job

    try:
        flush = None
        if gpu and not t.warm_l2 and cands:
            try:
                with rt.collecting():
                    rt.get_kernel(PROBE_SOURCE, "l2_flush_read")
            except rt.NeedsCompile as e:
                flush = e.job
                submit(flush, True)
            except Exception:  # (an unloadable image: the timing reports it per candidate)
                pass
        order = sorted(range(len(cands)), key=lambda i: i != urgent)   # the urgent candidate's kernels first
        for i in order:
            job = probe(i)
            if job is None:
                ready.append((i, None))
            else:
                need(i, job)
        while flush is not None and land() != flush:   # the first timing flushes L2 with it
            pass
        while True:
            out = list(ready)
            ready.clear()
            for i, why in out:
                yield i, why, bool(pool is not None and pool.pending)
            if pool is None or not pool.pending:
                return
            land()
    finally:
        if pool is not None:
            pool.close()


def _tune_key(t: Tunable, run, dev: dict, shape: dict | None = None) -> dict:
    """Time the default (of `shape`) and every fitting candidate, each as soon as its kernels are compiled (the
    default first); return the cache entry (config, ms, default, ...)."""
    default = default_config(t.name, dev["arch"], shape)
    limits = dict(dev["limits"])
    cands = []
    for c in _unique([default, *t.candidates]):
        if t.fits is None or _fits_safely(t, c, limits):
            cands.append(c)
    t0 = time.perf_counter()
    per = _budget_s() / max(1, len(cands))
    best, best_ms, default_ms, timing = None, math.inf, None, 0.0
    results: dict = {}   # index -> (config, ms or None, why)
    retime = []          # cut off after one sample taken while compiles ran: timed again once they are done

    def time_one(i, why, busy=False):
        nonlocal best, best_ms, default_ms, timing
        c = cands[i]
        if why is not None:
            results[i] = (c, None, f"compile: {why.splitlines()[0]}"[:200])
            return
        _stats["timer_calls"] += 1
        cutoff = best_ms * CUTOFF_FACTOR if best_ms < math.inf else None
        t1 = time.perf_counter()
        try:
            ms = float(_timer(run, c, budget_s=per, flush=not t.warm_l2, cutoff_ms=cutoff))
            if not ms > 0 or math.isnan(ms):
                raise ValueError(f"timer returned {ms!r}")
        except Exception as e:  # unusable candidate; sticky CUDA errors cannot be survived
            if _is_sticky(e):
                raise _sticky_error(t, c, e) from e
            results[i] = (c, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
            return
        finally:
            timing += time.perf_counter() - t1
        results[i] = (c, ms, None)
        if busy and cutoff is not None and ms > cutoff:
            retime.append(i)
        if c == default:
            default_ms = ms
        if ms < best_ms:
            best, best_ms = c, ms

    urgent = cands.index(default) if default in cands else None
    held = []   # candidates ready before the default: timed right after it (its time sets the others' cutoff)
    with contextlib.closing(_ready_candidates(t, run, cands, urgent)) as ready:
        for i, why, busy in ready:
            if urgent is None or i == urgent:
                time_one(i, why, busy)
                urgent = None
                for iw in held:
                    time_one(*iw)
                held = []
            else:
                held.append((i, why, busy))
    for i in retime:   # a stall beside the compiles must not cut a candidate off for good
        _stats["retimed"] += 1
        time_one(i, None)
    failed = sum(1 for r in results.values() if r[1] is None)
    _stats["failed"] += failed
    t1 = time.perf_counter()
    _stats["compile_s"] += t1 - t0 - timing   # the wall time tuning spent on anything but timing
    if best is not None and best != default and default_ms is not None:
        best, best_ms, default_ms = _confirm(run, default, best, per, flush=not t.warm_l2)
    _stats["timing_s"] += timing + time.perf_counter() - t1
    return {"kernel": t.name, "config": best, "ms": best_ms if best is not None else None,
            "default": default, "default_ms": default_ms, "tried": len(cands),
            "failed": failed, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _confirm(run, default: dict, best: dict, per: float, flush: bool = True):
    """Re-time the sweep's winner against the default, alternately, and keep the winner only if it is at
    least CONFIRM_MARGIN faster: one lucky median in the sweep must not replace a sound default (seen on
    an H200: unconfirmed attention picks ran up to 20% slower than the default in an interleaved A/B).
    Returns (config, its ms, default ms)."""
    d, b = [], []
    try:
        for _ in range(CONFIRM_ROUNDS):
            _stats["timer_calls"] += 2
            d.append(float(_timer(run, default, budget_s=per, cutoff_ms=None, flush=flush)))
            b.append(float(_timer(run, best, budget_s=per, cutoff_ms=None, flush=flush)))
    except Exception as e:
        if _is_sticky(e):
            raise
        return default, (statistics.median(d) if d else math.inf), (statistics.median(d) if d else None)
    dm, bm = statistics.median(d), statistics.median(b)
    return (best, bm, dm) if bm <= CONFIRM_MARGIN * dm else (default, dm, dm)


def _capturing() -> bool:
    try:
        cp = rt.require_cupy()
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:
        return False


def _remember(fast, cfg: dict) -> None:
    """pick()'s shortcut for this exact (name, device, dtype, shape); called under _lock."""
    if fast is not None:
        _picked.pop(fast, None)
        _picked[fast] = cfg
        while len(_picked) > _MAX_PICKED:  # the oldest remembered out first
            del _picked[next(iter(_picked))]


def pick(name: str, shape: dict, dtype, run: Callable[[dict], None]) -> dict:
    """The config to launch kernel `name` with for this shape and dtype (a fresh dict; see module docstring).

    run(cfg) must launch the kernel once with cfg on the caller's arrays; it is called only on a cache miss
    with tuning enabled.
    """
    t = get(name)
    dev = _device_info()
    m = mode()
    if m == 0:
        _stats["defaults"] += 1
        return default_config(name, dev["arch"], shape)
    # settled: what `vbw-cupy tune` stored, else the default (remembered too: a miss reads the file); never timed
    settled = dev["arch"] in t.settled and m == 1
    try:
        fast = (name, dev["id"], dtype, tuple(shape.items()), settled)
        cfg = _picked.get(fast)
    except TypeError:  # an unhashable shape value: take the slow path
        fast = cfg = None
    if cfg is not None:
        _stats["defaults" if settled and cfg == default_config(name, dev["arch"], shape) else "memory_hits"] += 1
        return dict(cfg)
    key = make_key(name, shape, dtype, dev)
    with _lock:
        e = _lookup(key, t, dev["limits"])
        if e is not None:
            _remember(fast, e["config"])
            return dict(e["config"])
        if settled:
            _stats["defaults"] += 1
            _remember(fast, default_config(name, dev["arch"], shape))
            return default_config(name, dev["arch"], shape)
        if _capturing():
            rt.warn_once(f"capture:{key}", f"vbw_cupy.autotune: {name} {_bucket_str(t, shape)} is not tuned and the "
                                         "stream is capturing a CUDA graph: using the default config")
            return default_config(name, dev["arch"], shape)
        with _progress.notice(f"tuning {name} for {_bucket_str(t, shape)} (once per shape bucket and GPU; "
                              "VBW_CUPY_AUTOTUNE=0 turns tuning off)"):
            e = _tune_key(t, run, dev, shape)
        e.update(device=dev["name"], arch=dev["arch"], dtype=_dtype_name(dtype), bucket=_bucket_str(t, shape),
                 shape=_json_shape(shape))
        if e["config"] is None:  # nothing ran: do not remember, fall back to the default
            rt.warn_once(f"allfail:{key}", f"vbw_cupy.autotune: every candidate of {name} failed for {key}; "
                                         "using the default config")
            _memory[key] = {**e, "config": e["default"]}
            return dict(e["default"])
        _stats["tuned"] += 1
        _store(key, e, name)
        _remember(fast, e["config"])
        return dict(e["config"])


# -------------------------------------------------------------------------------------- ahead of time
def _import_kernel_modules() -> None:
    import importlib
    import pkgutil
    from . import __path__ as pkg_path
    for m in pkgutil.iter_modules(pkg_path):
        if m.name.startswith("_") or m.name in ("cli", "autotune", "reference", "__main__"):
            continue
        try:
            importlib.import_module(f"{__package__}.{m.name}")
        except Exception as e:
            rt.warn_once(f"import:{m.name}", f"vbw_cupy.autotune: cannot import vbw_cupy.{m.name} ({e})")


def _fmt_cfg(c: dict | None) -> str:
    return "-" if not c else " ".join(f"{k}={v}" for k, v in c.items())


def tune(names=None, shapes=None, progress: bool = True, force: bool = False) -> list[dict]:
    """Tune ahead of time (``vbw-cupy tune``). names: Tunable names (None: every registered one with a
    ``bench``). shapes: None for each Tunable's ``standard_shapes``; a list of (shape, dtype) pairs for every
    name; or {name: [(shape, dtype), ...]}. force: re-time keys already in the cache. Tuning happens even with
    VBW_CUPY_AUTOTUNE=0. Returns one row per (kernel, shape): kernel, shape, dtype, bucket, default,
    default_ms, chosen, chosen_ms, speedup (default_ms / chosen_ms), cached (True if it was a cache hit)."""
    _import_kernel_modules()
    if names is None:
        names = [n for n in registered() if _registry[n].bench is not None]
    elif isinstance(names, str):
        names = [names]
    jobs = []
    for n in names:
        t = get(n)
        todo = shapes.get(n, ()) if isinstance(shapes, dict) else (shapes if shapes is not None else t.standard_shapes)
        if t.bench is None and todo:
            raise ValueError(f"autotune.tune: {n} has no bench callable, cannot build inputs")
        jobs += [(t, dict(s), d) for s, d in todo]
    dev = _device_info()
    rows = []
    for i, (t, shape, dtype) in enumerate(jobs, 1):
        key = make_key(t.name, shape, dtype, dev)
        t0 = time.perf_counter()
        with _lock:
            e = None if force else _lookup(key, t, dev["limits"])
            cached = e is not None
            if e is None:
                run = t.bench(shape, dtype)
                e = _tune_key(t, run, dev, shape)
                e.update(device=dev["name"], arch=dev["arch"], dtype=_dtype_name(dtype),
                         bucket=_bucket_str(t, shape), shape=_json_shape(shape))
                if e["config"] is not None:
                    _stats["tuned"] += 1
                    _store(key, e, t.name)
                del run
        row = {"kernel": t.name, "shape": dict(shape), "dtype": _dtype_name(dtype), "bucket": _bucket_str(t, shape),
               "default": e.get("default"), "default_ms": e.get("default_ms"),
               "chosen": e.get("config"), "chosen_ms": e.get("ms"), "cached": cached,
               "speedup": (e["default_ms"] / e["ms"]) if e.get("default_ms") and e.get("ms") else None}
        rows.append(row)
        if progress:
            shape_s = " ".join(f"{k}={v}" for k, v in shape.items())
            gain = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
            ms = f"{row['chosen_ms']:.4f} ms" if row["chosen_ms"] else "failed"
            print(f"[{i}/{len(jobs)}] {t.name} {shape_s} {row['dtype']}: {_fmt_cfg(row['chosen'])} {ms} "
                  f"(vs default {gain}){' [cached]' if cached else ''} in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of tune() rows."""
    head = ("kernel", "bucket", "dtype", "default", "default ms", "chosen", "chosen ms", "gain")
    body = [(r["kernel"], r["bucket"], r["dtype"], _fmt_cfg(r["default"]),
             "-" if r["default_ms"] is None else f"{r['default_ms']:.4f}", _fmt_cfg(r["chosen"]),
             "-" if r["chosen_ms"] is None else f"{r['chosen_ms']:.4f}",
             "-" if r["speedup"] is None else f"{r['speedup']:.2f}x") for r in rows]
    w = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(n) for c, n in zip(cells, w)).rstrip()
    return "\n".join([line(head), line(["-" * n for n in w]), *map(line, body)])


def print_tune_table(rows: list[dict], out=None) -> None:
    """Print format_rows(rows) (what ``vbw-cupy tune`` shows at the end)."""
    print(format_rows(rows) if rows else "no kernel with standard shapes to tune", file=out or sys.stdout)


def _ms_or_none(x) -> float | None:
    """A timing read back from the file (hand-edited files may hold anything there, ints past float's range
    too)."""
    return float(x) if (type(x) is float and math.isfinite(x)) or (type(x) is int and abs(x) < 1e300) else None


def _json_shape(shape) -> dict:
    """A shape dict as JSON takes it (NumPy ints and floats as Python ones, anything else as its str)."""
    out = {}
    for k, v in shape.items():
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            v = v.item()
        out[str(k)] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def cache_summary() -> dict:
    """What the tuning cache file holds, for ``vbw-cupy info``: path, status ("ok", "missing", or why it is
    ignored), format, the number of entries, and per entry kernel, device, arch, dtype, bucket, config, ms,
    default_ms. Needs no GPU."""
    path = cache_path()
    entries, status = _read_file(path)
    ms = _ms_or_none
    rows = [{"kernel": v.get("kernel", k.split("|")[0]), "device": v.get("device"), "arch": v.get("arch"),
             "dtype": v.get("dtype"), "bucket": v.get("bucket"), "config": v.get("config"), "ms": ms(v.get("ms")),
             "default_ms": ms(v.get("default_ms"))} for k, v in sorted(entries.items())]
    return {"path": str(path), "status": status, "format": FORMAT_VERSION, "entries": len(rows), "rows": rows}


# ---------------------------------------------------------------------------------- the probe kernel
PROBE_SOURCE = "autotune_probe.cu"
_PROBE_BLOCKS = (64, 128, 256, 512, 1024)
_PROBE_VECS = (1, 2, 4, 8)


def kernel_instances() -> list[tuple[str, str]]:
    """Every (file, instance) this module can launch: the L2 flush of its timer and the probe kernel of its GPU
    test."""
    return [(PROBE_SOURCE, "l2_flush_read"),
            *[(PROBE_SOURCE, f"probe_axpb<{b}, {v}>") for b in _PROBE_BLOCKS for v in _PROBE_VECS]]


def selftest_cases() -> list:
    """The CLI's op-module protocol: the probe has no selftest rows (its GPU test lives in tests/)."""
    return []


def probe_launch(cfg: dict, x, y, alpha: float = 2.0, beta: float = 1.0) -> None:
    """y = alpha * x + beta (float32, contiguous CuPy arrays) with the probe kernel and config cfg."""
    k = rt.get_kernel(PROBE_SOURCE, f"probe_axpb<{cfg['BLOCK']}, {cfg['VEC']}>")
    per = cfg["BLOCK"] * cfg["VEC"]
    rt.launch(k, (rt.cdiv(x.size, per),), (cfg["BLOCK"],),
              (x, y, np.float32(alpha), np.float32(beta), np.int64(x.size)))


def _probe_bench(shape: dict, dtype):
    cp = rt.require_cupy()
    x = cp.arange(shape["n"], dtype=cp.float32)
    y = cp.empty_like(x)
    return lambda cfg: probe_launch(cfg, x, y)


def probe_tunable() -> Tunable:
    """Register and return the probe Tunable ("autotune_probe"; the bucket is pow2_bucket(n)). Not
    registered at import, so ``vbw-cupy tune`` does not list it."""
    return register(Tunable(
        name="autotune_probe",
        params=("BLOCK", "VEC"),
        candidates=tuple({"BLOCK": b, "VEC": v} for b in _PROBE_BLOCKS for v in _PROBE_VECS),
        defaults={80: {"BLOCK": 128, "VEC": 1}},
        bucket=lambda s: (pow2_bucket(s["n"]),),
        fits=lambda cfg, lim: cfg["BLOCK"] <= lim["max_threads"],
        source=PROBE_SOURCE,
        standard_shapes=(({"n": 1 << 25}, "float32"),),
        bench=_probe_bench,
    ))
