"""Run-time compilation of the CUDA sources in ``cuda_src/`` and kernel launch.

Kernels are compiled with NVRTC (through CuPy's binding) straight to a cubin for the device's exact
architecture (``sm_90a`` on Hopper, so wgmma is available), then loaded from those bytes
(``CubinKernel``, through ``cupy.cuda.function.Module``).
We drive NVRTC ourselves rather than through ``RawModule(code=...)`` for three reasons:
- the cache key must cover every ``.cuh`` header a ``.cu`` file includes (CuPy keys on the source
  string only, so an edited header would reuse a stale binary);
- CuPy appends ``-ftz=true``; the FP4 codecs must not flush denormals to stay bit-exact;
- the CPU compile test must build exactly what the GPU path builds, with no GPU present.

Compiled cubins are cached in memory per (device, file, instance, options) and on disk under
``$VBW_CUPY_CACHE_DIR/kernels`` (default ``~/.cache/vbw_cupy``), keyed by a hash of all sources,
the options, the architecture and the NVRTC version. Each entry is one file ``<key>.cubin``, renamed into
place whole: a first line with the cubin's sha256 and the kernel's lowered name, then the cubin (processes
compiling the same kernel at once leave one of their entries, never a mix: NVRTC's cubins differ between
processes). A cubin is loaded only from the bytes whose checksum was just verified (never from a path the
driver reads later), and an empty, truncated or corrupt entry is recompiled with one warning. A process that
sees cuda_src/ change after it hashed it stores nothing more. The checksum guards against damage, not against someone
who can write the directory: point ``VBW_CUPY_CACHE_DIR`` at a directory only you can write. A cache
directory that cannot be used (a file in its place, read-only) means no disk cache, with one warning.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import pathlib
import tempfile
import threading
import time
import warnings

import numpy as np

from . import _checks, _progress

try:  # CuPy is optional: the package and its NumPy reference work without it.
    import cupy
except Exception as _exc:  # pragma: no cover - depends on the machine
    cupy = None
    _CUPY_IMPORT_ERROR = _exc
else:
    _CUPY_IMPORT_ERROR = None


def _find_source_dir() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parent
    for cand in (here.parent / "cuda_src", here / "cuda_src"):  # source tree / installed wheel
        if cand.is_dir():
            return cand
    raise RuntimeError(f"vbw_cupy: cannot find the CUDA sources (cuda_src/) near {here}")


SOURCE_DIR = _find_source_dir()


def cache_dir() -> pathlib.Path:
    """$VBW_CUPY_CACHE_DIR (~ expanded), else ~/.cache/vbw_cupy. Where no home directory can be found (HOME
    unset and no passwd entry for the uid: a container's --user), a path that does not exist, so the caches
    say they cannot be used (one warning) instead of every compile raising."""
    env = os.environ.get("VBW_CUPY_CACHE_DIR")
    if env:
        return pathlib.Path(os.path.expanduser(env))
    try:
        return pathlib.Path.home() / ".cache" / "vbw_cupy"
    except (RuntimeError, KeyError):
        return _NO_HOME


_NO_HOME = pathlib.Path("/nonexistent-home/.cache/vbw_cupy")  # (make_private_dir refuses it: never created)


def make_private_dir(d: pathlib.Path) -> None:
    """mkdir -p d, the directories it creates readable and writable by their owner only (cubins are loaded and
    run from there: nobody else should be able to put one in). Existing directories are left as they are."""
    if d == _NO_HOME or _NO_HOME in d.parents:
        raise FileNotFoundError(2, "no home directory (HOME unset, no passwd entry): set VBW_CUPY_CACHE_DIR", str(d))
    missing = []
    p = d
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            pass
    if not d.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(d))


_warned: set[str] = set()


def warn_once(tag: str, msg: str) -> None:
    """A RuntimeWarning the first time `tag` is seen in this process (forget_warnings() starts over)."""
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def forget_warnings() -> None:
    _warned.clear()


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    """Hash of every file in cuda_src/ when first asked in this process: any edit to any .cu or .cuh
    invalidates every cached binary (a process that sees the sources change stores nothing: _cached_cubin)."""
    return _hash_sources()


def _hash_sources() -> str:
    h = hashlib.sha256()
    for p in sorted(SOURCE_DIR.iterdir()):
        if p.suffix in (".cu", ".cuh"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


_src_hashes: dict = {}  # filename or tuple of filenames -> hash


def source_hash(filename) -> str:
    """Hash of cuda_src/<filename> (or of each file of a tuple of names) plus every .cuh header (headers are
    shared, so any header edit counts)."""
    if not filename:
        return "nosrc"
    h = _src_hashes.get(filename)
    if h is None:
        names = (filename,) if isinstance(filename, str) else tuple(filename)
        d = hashlib.sha256()
        paths = [SOURCE_DIR / n for n in names] + sorted(p for p in SOURCE_DIR.glob("*.cuh"))
        for p in paths:
            d.update(p.name.encode())
            d.update(p.read_bytes() if p.is_file() else b"<missing>")
        h = _src_hashes[filename] = d.hexdigest()[:16]
    return h


def have_cupy() -> bool:
    return cupy is not None


def cupy_missing() -> str:
    """Why there is no CuPy: "CuPy is not installed", or the error of an installed CuPy that failed to import (a
    missing CUDA library, say); "" when it imported."""
    e = _CUPY_IMPORT_ERROR
    if cupy is not None:
        return ""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cupy":
        return "CuPy is not installed"
    return f"CuPy is installed but failed to import ({type(e).__name__}: {e})"


def require_cupy():
    """Return the cupy module or raise a RuntimeError that says what is missing."""
    if cupy is None:
        raise RuntimeError(
            "vbw_cupy: this operation needs CuPy for the GPU path "
            f"(import failed: {_CUPY_IMPORT_ERROR}). Install 'vbw_cupy[cuda12]' or 'vbw_cupy[cuda13]', "
            "or pass NumPy arrays to use the float64 reference.")
    return cupy


def gpu_available() -> bool:
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_gpu_array(x) -> bool:
    return cupy is not None and isinstance(x, cupy.ndarray)


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str | None:
    """A directory holding cuda_fp16.h and friends: CUDA_PATH, the pip wheels, or /usr/local/cuda."""
    cands = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            cands.append(pathlib.Path(os.environ[env]) / "include")
    try:
        import nvidia  # namespace package of the CUDA wheels
        for root in nvidia.__path__:
            root = pathlib.Path(root)
            cands += [root / "cu13" / "include", root / "cuda_runtime" / "include"]
    except Exception:
        pass
    if cupy is not None:
        try:
            cands.append(pathlib.Path(cupy.cuda.get_cuda_path()) / "include")
        except Exception:
            pass
    cands.append(pathlib.Path("/usr/local/cuda/include"))
    for c in cands:
        if (c / "cuda_fp16.h").is_file():
            return str(c)
    return None


def arch_flag(arch: int) -> str:
    # Hopper's wgmma / setmaxnreg need the arch-specific "a" target.
    return f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}"


def compile_options(arch: int, extra: tuple[str, ...] = ()) -> list[str]:
    opts = [arch_flag(arch), "--std=c++17", f"-I{SOURCE_DIR}", f"-DVBW_SRC_HASH=0x{sources_hash()[:8]}"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    return opts + list(extra)


class CompileError(RuntimeError):
    pass


def compile_cubin(filename: str, name_expressions: list[str], arch: int,
                  extra_options: tuple[str, ...] = ()) -> tuple[bytes, dict[str, str]]:
    """Compile cuda_src/<filename> with NVRTC for sm_<arch>; return (cubin, {name: lowered name}).

    Needs no GPU: the CPU compile test calls this for sm_80 and sm_90.
    """
    if cupy is None:
        require_cupy()
    from cupy.cuda import nvrtc
    src = (SOURCE_DIR / filename).read_text()
    opts = compile_options(arch, extra_options)
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        for n in name_expressions:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(
                f"vbw_cupy: NVRTC failed to compile {filename} for {', '.join(name_expressions)} "
                f"(sm_{arch}, options {' '.join(opts)}): {e}\n{log}") from None
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in name_expressions}
        return nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


_lock = threading.Lock()
_modules: dict = {}
# (filename, name, arch, options) -> (cubin, lowered name) for what was compiled but could not be written to the
# disk cache (none configured, or read-only): the tuner compiles before it loads, and would otherwise compile twice
_unstored: dict = {}
_CACHE_FORMAT = 3  # in the disk key: format-3 entries are one file, the cubin's sha256 and name, then the cubin


def _disk_key(filename, name, arch, extra_options) -> str:
    h = hashlib.sha256(repr((_CACHE_FORMAT, sources_hash(), filename, name, arch, tuple(extra_options),
                             nvrtc_version(), cuda_include_dir())).encode())  # (other CUDA headers: other key)
    return h.hexdigest()[:32]


class CubinKernel:
    """One kernel of a cubin held in memory, loaded into each device's context from those bytes on first use
    there; called and queried like ``cupy.RawKernel`` (``kernel(grid, block, args, shared_mem=, stream=)``,
    ``attributes``, a settable ``max_dynamic_shared_size_bytes``)."""

    # CUfunction_attribute values (CUDA driver API, stable)
    _ATTRS = {"max_threads_per_block": 0, "shared_size_bytes": 1, "const_size_bytes": 2, "local_size_bytes": 3,
              "num_regs": 4, "ptx_version": 5, "binary_version": 6, "cache_mode_ca": 7,
              "max_dynamic_shared_size_bytes": 8, "preferred_shared_memory_carveout": 9}

    def __init__(self, cubin: bytes, name: str):
        self.cubin, self.name = cubin, name
        self.pdl = False  # calls pdl_wait() before its dependent reads (get_kernel sets it from PDL_KERNELS)
        self._functions: dict = {}  # device id -> cupy.cuda.function.Function (which keeps its Module loaded)

    @property
    def kernel(self):
        dev = cupy.cuda.runtime.getDevice()
        fn = self._functions.get(dev)
        if fn is None:
            from cupy.cuda import function
            mod = function.Module()
            mod.load(self.cubin)
            fn = self._functions[dev] = mod.get_function(self.name)
        return fn

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        self.kernel(grid, block, args, shared_mem=shared_mem, stream=stream)

    def _attr(self, attr: str) -> int:
        from cupy_backends.cuda.api import driver
        return driver.funcGetAttribute(self._ATTRS[attr], self.kernel.ptr)

    @property
    def attributes(self) -> dict:
        return {a: self._attr(a) for a in self._ATTRS}

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._attr("max_dynamic_shared_size_bytes")

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        from cupy_backends.cuda.api import driver
        driver.funcSetAttribute(self.kernel.ptr, self._ATTRS["max_dynamic_shared_size_bytes"], int(nbytes))


def get_kernel(filename: str, name: str, extra_options: tuple[str, ...] = ()):
    """The kernel `name` (a template instance such as ``"quantize_mx<__half>"``) from cuda_src/<filename>,
    compiled for the current device and cached in memory and on disk. Inside ``collecting()``, a kernel in
    neither cache raises NeedsCompile instead of compiling."""
    cp = require_cupy()
    dev = cp.cuda.Device().id
    key = (dev, filename, name, tuple(extra_options))
    fn = _modules.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _modules.get(key)
        if fn is not None:
            return fn
        from ._device import device_arch  # _device imports this module; raises for GPUs below sm_80
        arch = device_arch(dev)
        job = (filename, name, arch, tuple(extra_options))
        got = _cached_cubin(*job, compile=not getattr(_collect, "on", False))
        if got is None:
            raise NeedsCompile(job)
        fn = CubinKernel(*got)
        fn.pdl = arch >= 90 and name.startswith(PDL_KERNELS)
        fn.kernel  # load now: a bad image fails here, not at some later launch
        _modules[key] = fn
        return fn


class NeedsCompile(Exception):
    """Raised by get_kernel inside ``collecting()`` for a kernel that is not compiled yet; ``job`` is
    (filename, instance, arch, options), what ``compile_many`` takes."""

    def __init__(self, job):
        super().__init__(f"{job[1]} ({job[0]}, sm_{job[2]}) is not compiled yet")
        self.job = job


_collect = threading.local()


@contextlib.contextmanager
def collecting():
    """Within this block (this thread), get_kernel loads what is cached and raises NeedsCompile for anything
    else: the autotuner runs each candidate once this way to learn which kernels it needs, then compiles them
    all at once with compile_many."""
    before = getattr(_collect, "on", False)
    _collect.on = True
    try:
        yield
    finally:
        _collect.on = before


def kernel_cache_dir() -> pathlib.Path | None:
    """$VBW_CUPY_CACHE_DIR/kernels, created if needed; None (one warning) where it cannot be a directory."""
    d = cache_dir() / "kernels"
    try:
        make_private_dir(d)
    except OSError as e:
        warn_once(f"kdir:{d}", f"vbw_cupy: cannot use {d} as the kernel cache ({e.strerror or e}; "
                               f"VBW_CUPY_CACHE_DIR={os.environ.get('VBW_CUPY_CACHE_DIR', '')!r}): compiled "
                               "kernels are kept in memory for this process only")
        return None
    return d


_HEX = frozenset("0123456789abcdef")


def read_cached_cubin(path: pathlib.Path) -> tuple[bytes | None, str, str]:
    """(cubin, lowered name, "") for an entry whose checksum holds; (None, "", why) otherwise, why "" when the
    entry is simply absent. An entry is one file: '<sha256 of the cubin> <lowered name>\n', then the cubin."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None, "", ""
    except OSError as e:
        return None, "", f"unreadable ({e.strerror or e})"
    head, nl, cubin = data.partition(b"\n")
    bad_head = "its first line is not '<sha256> <lowered name>'"
    try:
        digest, lowered = head.decode("ascii").split()
    except (UnicodeDecodeError, ValueError):
        return None, "", bad_head
    if not nl or len(digest) != 64 or not set(digest) <= _HEX or not lowered.isprintable():
        return None, "", bad_head
    if not cubin:
        return None, "", "the cubin is empty"
    if hashlib.sha256(cubin).hexdigest() != digest:
        return None, "", f"the cubin's sha256 does not match ({len(cubin)} bytes: truncated or damaged)"
    return cubin, lowered, ""


def write_cached_cubin(path: pathlib.Path, cubin: bytes, lowered: str) -> None:
    """Store an entry for read_cached_cubin as one file renamed into place whole: writers racing on an entry
    leave one writer's whole entry (two files, a cubin and its name, could end up from different writers)."""
    atomic_write(path, f"{hashlib.sha256(cubin).hexdigest()} {lowered}\n".encode("ascii") + cubin)


def _cached_cubin(filename, name, arch, extra_options, compile: bool = True,
                  notice: bool = True) -> tuple[bytes, str] | None:
    """(cubin, lowered name) from the disk cache, or compiled and stored there (None without `compile`).
    What cannot be stored on disk is kept in memory (_unstored). `notice`: say on stderr when a compile takes
    longer than 2 s."""
    job = (filename, name, arch, tuple(extra_options))
    got = _unstored.get(job)
    if got is not None:
        return got
    d = kernel_cache_dir()
    if d is not None:
        dkey = _disk_key(filename, name, arch, extra_options)
        cubin_path = d / f"{dkey}.cubin"
        cubin, lowered, why = read_cached_cubin(cubin_path)
        if cubin is not None:
            return cubin, lowered
        if why:
            warn_once(f"bad:{cubin_path}", f"vbw_cupy: the cached kernel {cubin_path} ({name}, sm_{arch}) is "
                                           f"unusable: {why}; recompiling it")
    if not compile:
        return None
    with (_progress.notice(f"compiling {name} ({filename}, sm_{arch}; `vbw-cupy warmup` compiles ahead of time)")
          if notice else contextlib.nullcontext()):
        cubin, lowered_map = compile_cubin(filename, [name], arch, extra_options)
    lowered = lowered_map[name]
    if d is not None and _hash_sources() != sources_hash():
        # cuda_src/ changed since this process read its hash: this cubin was compiled from the new text but its
        # key holds the old hash, where a later process with the old sources would load it
        warn_once("edited", f"vbw_cupy: the CUDA sources in {SOURCE_DIR} changed while this process ran: kernels "
                            "compiled from now on are kept in memory only (restart to cache them)")
        d = None
    if d is not None:
        try:
            write_cached_cubin(cubin_path, cubin, lowered)
            return cubin, lowered
        except OSError as e:  # a read-only cache still works, just without the disk copy
            warn_once(f"ro:{d}", f"vbw_cupy: cannot write the kernel cache {d} ({e.strerror or e}): compiled "
                                 "kernels are kept in memory for this process only")
    _unstored[job] = (cubin, lowered)
    return cubin, lowered


def _compile_one(job):
    filename, name, arch, extra = job
    try:
        _cached_cubin(filename, name, arch, extra, notice=False)
        return job, None
    except Exception as e:  # reported by the caller, never fatal there
        return job, f"{type(e).__name__}: {str(e)[:2000]}"


class CompilePool:
    """`_compile_one` on up to `workers` threads of its own (NVRTC releases the GIL, so they run in parallel; no
    processes, so nothing is re-imported and a user's script needs no ``__main__`` guard), urgent jobs first;
    get() returns (job, error) in completion order. Threads that cannot start leave the jobs to the caller's
    thread, one at a time. close() drops the jobs not started and waits for the running ones (NVRTC cannot be
    stopped). Used by compile_jobs (a batch) and by the autotuner (jobs as the candidates ask for them)."""

    def __init__(self, workers: int):
        import itertools
        import queue
        self._jobs, self._done, self._order = queue.PriorityQueue(), queue.SimpleQueue(), itertools.count()
        self.pending, self.threads = 0, []
        for _ in range(max(1, workers)):
            t = threading.Thread(target=self._work, name="vbw_cupy-nvrtc", daemon=True)
            try:
                t.start()
            except RuntimeError as e:  # "can't start new thread" (not a kernel's fault)
                if not self.threads:
                    warn_once(f"pool:{e}", f"vbw_cupy: parallel compile failed ({e}); compiling one kernel at a "
                              "time")
                break
            self.threads.append(t)

    def _work(self):
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            self._done.put(_compile_one(job))

    def put(self, job, urgent: bool = False) -> None:
        self.pending += 1
        if self.threads:
            self._jobs.put((0 if urgent else 1, next(self._order), job))
        else:
            self._done.put(_compile_one(job))

    def get(self):
        self.pending -= 1
        return self._done.get()

    def close(self) -> None:
        for _ in self.threads:
            self._jobs.put((-1, next(self._order), None))   # before every job still queued
        for t in self.threads:
            t.join()


def compile_jobs(jobs, desc: str = "compiling", workers: int | None = None, progress: bool = True) -> dict:
    """Compile (filename, instance, arch, options) jobs into the kernel cache on a `CompilePool`. Returns
    {job: error} for the failures. With `progress`, a bar on stderr once it has taken 2 s. An interrupt cancels
    the jobs not started yet; a pool that cannot start its threads leaves the jobs to this thread, one at a time
    (those already compiled are cache hits)."""
    jobs = sorted(set(jobs))
    if not jobs:
        return {}
    pool = CompilePool(min(workers or os.cpu_count() or 1, len(jobs), 16))
    try:
        for j in jobs:
            pool.put(j)
        done = (pool.get() for _ in jobs)
        if progress:
            done = _progress.bar(done, len(jobs), desc)
        res = list(done)
    finally:
        pool.close()
    return {j: e for j, e in res if e}


def compile_many(jobs, desc: str = "compiling", workers: int | None = None, progress: bool = True
                 ) -> list[tuple[str, str]]:
    """compile_jobs, reporting failures as sorted [(instance, error)]."""
    return sorted((j[1], e) for j, e in compile_jobs(jobs, desc, workers, progress).items())


def precompile(instances, arch: int | None = None, extra_options: tuple[str, ...] = (), workers: int | None = None,
               progress: bool = True) -> list[tuple[str, str]]:
    """Compile (filename, instance) pairs into the disk cache in parallel (compile_many), so later get_kernel
    calls load instead of compiling one at a time. Returns [(instance, error)] for failures. Needs no GPU
    when `arch` is given. With `progress`, a bar on stderr once it has taken 2 s and a summary line."""
    from ._device import device_arch  # _device imports this module
    arch = device_arch() if arch is None else arch
    jobs = sorted({(f, n, arch, tuple(extra_options)) for f, n in instances})
    if not jobs:
        return []
    t0 = time.perf_counter()
    bad = compile_many(jobs, f"compiling for sm_{arch}", workers=workers, progress=progress)
    if progress:
        print(f"precompiled {len(jobs) - len(bad)}/{len(jobs)} kernel instances for sm_{arch} in "
              f"{time.perf_counter() - t0:.1f} s" + "".join(f"\n  FAILED {n}: {e}" for n, e in bad), flush=True)
    return bad


def atomic_write(path: pathlib.Path, data: bytes, fsync: bool = False) -> None:
    """Write `data` to a temporary file beside `path` (flushed to disk first with `fsync`), then rename it over
    `path`: readers see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def launch(kernel, grid, block, args, shared_mem: int = 0, stream=None) -> None:
    """Launch with `shared_mem` bytes of dynamic shared memory, raising the 48 KB opt-in limit when needed.
    Inside `programmatic_launches()` a kernel of PDL_KERNELS is launched as a programmatic dependent."""
    grid = tuple(int(g) for g in grid)
    if min(grid) <= 0:
        return  # never launch an empty grid
    if getattr(kernel, "pdl", False) and pdl_enabled():
        from . import _plans
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        _plans.Launch(kernel, grid, block, args, (), shared_mem)((), st.ptr)
        return
    if shared_mem > 48 * 1024:
        cur = kernel.max_dynamic_shared_size_bytes
        if cur < shared_mem:
            kernel.max_dynamic_shared_size_bytes = int(shared_mem)
    kernel(grid, tuple(int(b) for b in block), args, shared_mem=int(shared_mem),
           stream=stream if stream is not None else cupy.cuda.get_current_stream())


# ---- Programmatic dependent launch (sm_90+; cuda_src/pdl.cuh says what a kernel must do to take part).
# A kernel launched with the attribute may start while the one before it in the stream is still running and
# waits for it in pdl_wait(), so its launch and its weight loads overlap the previous kernel's tail. Used for
# the model's decode graph, where ~300 short kernels run back to back; everywhere else launches are plain.
#: kernels (names as given to get_kernel, by prefix) that call pdl_wait() before any dependent access
PDL_KERNELS = ("vbw_model::", "vbw_fp4gemm::fp4_gemm_mmv<", "vbw_fp4gemm::fp4_gemm_mmvk<",
               "vbw_fp4gemm::fp4_gemm_mma<", "paged_decode<", "paged_decode_combine<")
_pdl_state = threading.local()
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_launch_ex = None  # (cuLaunchKernelEx, config struct type, attribute struct type), False when unavailable


class programmatic_launches:
    """Context manager: launches of PDL_KERNELS in this thread use programmatic dependent launch (on a GPU
    without it, a driver older than CUDA 12.3 or one without cuLaunchKernelEx, launches stay plain)."""

    def __enter__(self):
        self._prev = getattr(_pdl_state, "on", False)
        _pdl_state.on = _pdl_driver_ok() and _launch_kernel_ex() is not None
        return self

    def __exit__(self, *exc):
        _pdl_state.on = self._prev
        return False


_PDL_MIN_DRIVER = 12030  # programmatic launches inside a captured graph need a CUDA 12.3 driver or newer


def _driver_version() -> int:
    """The CUDA driver's version (12030 for 12.3), 0 where it cannot be asked."""
    try:
        return int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        return 0


@functools.lru_cache(maxsize=None)
def _pdl_driver_ok() -> bool:
    return _driver_version() >= _PDL_MIN_DRIVER


def pdl_enabled() -> bool:
    return getattr(_pdl_state, "on", False)


def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx through ctypes (CuPy does not wrap it), or None where it is missing."""
    global _launch_ex
    if _launch_ex is None:
        import ctypes

        class Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
            _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

        class Config(ctypes.Structure):  # CUlaunchConfig
            _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("num_attrs", ctypes.c_uint)]
        try:
            fn = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):
            _launch_ex = False
        else:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            _launch_ex = (fn, Config, Attr)
    return _launch_ex or None


def launch_programmatic(fptr: int, dims, shared_mem: int, stream_ptr: int, params_ptr: int) -> None:
    """cuLaunchKernelEx of the CUfunction `fptr` (grid + block `dims`, packed `params_ptr` as for
    cuLaunchKernel) with programmatic stream serialization allowed."""
    import ctypes
    fn, Config, Attr = _launch_kernel_ex()
    attr = Attr()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    cfg = Config((ctypes.c_uint * 3)(*dims[:3]), (ctypes.c_uint * 3)(*dims[3:]), int(shared_mem), stream_ptr,
                 ctypes.pointer(attr), 1)
    err = fn(ctypes.byref(cfg), ctypes.c_void_p(fptr), ctypes.c_void_p(params_ptr), None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


# ---- the bounded caches of launch plans (`_plans`, the op modules) and of tensor maps (below)
MAX_PLANS = 256  # plans a cache keeps by default


class PlanCache:
    """A bounded mapping key -> plan; a hit moves the key to the back, a full cache drops the oldest."""

    def __init__(self, maxsize: int = MAX_PLANS):
        self.maxsize = int(maxsize)
        self._d: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        d = self._d
        plan = d.get(key)
        if plan is not None:
            try:
                d.move_to_end(key)
            except KeyError:  # dropped by another thread in between
                pass
        return plan

    def put(self, key, plan) -> None:
        with self._lock:
            self._d[key] = plan
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __iter__(self):
        return iter(list(self._d))

    def values(self) -> list:
        return list(self._d.values())

    def items(self) -> list:
        """(key, plan) pairs, least recently used first."""
        return list(self._d.items())

    def __len__(self) -> int:
        return len(self._d)


# ---- TMA tensor maps (Hopper): encoded on the host by the driver's cuTensorMapEncodeTiled, which CuPy does not
# wrap, so it is called through ctypes. A map is 128 opaque bytes passed to the kernel by value (a size-one
# NumPy array of dtype V128 is passed by value by CuPy's launcher).
TENSOR_MAP_BYTES = 128
NO_TENSOR_MAP = np.zeros(1, dtype=f"V{TENSOR_MAP_BYTES}")  # for a kernel's unused map parameter
NULL = np.uint64(0)  # a null pointer kernel argument (an optional array left out)
_TMAP_SWIZZLE_128B = 3
_TMAP_L2_256B = 3
_TMAP_UINT8, _TMAP_UINT16 = 0, 1  # CUtensorMapDataType
_tmap_fn = None          # the driver function, False when it cannot be loaded
_TMAP_CACHE_MAX = 1024
_tmap_cache = PlanCache(_TMAP_CACHE_MAX)  # key -> map, least recently used out


def _tensor_map_encoder():
    global _tmap_fn
    if _tmap_fn is None:
        import ctypes
        try:
            lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            _tmap_fn = False
            return _tmap_fn
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _tmap_fn = fn
    return _tmap_fn


def have_tensor_maps() -> bool:
    """Whether the driver's tensor-map encoder can be called (TMA kernels can be launched)."""
    return bool(_tensor_map_encoder())


def tensor_map(ptr: int, dims: tuple, strides: tuple, box: tuple, elem_bytes: int = 2):
    """A tiled TMA map of a tensor of 16-bit (or, with elem_bytes=1, 8-bit) elements with the 128-byte swizzle:
    dims innermost first, strides (bytes) of dims 1.., box the tile each copy moves (box[0] * elem_bytes = 128
    bytes, one swizzled row). Reads outside dims are zero-filled. Returns a size-one V128 NumPy array (a kernel
    argument), or None where the driver cannot encode it (no driver entry point, or arguments it rejects)."""
    key = (ptr, dims, strides, box, elem_bytes)
    m = _tmap_cache.get(key)
    if m is not None:
        return m
    fn = _tensor_map_encoder()
    if not fn:
        return None
    import ctypes
    rank = len(dims)
    raw = np.zeros(TENSOR_MAP_BYTES + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64  # the driver wants the map 64-byte aligned
    out = raw[off:off + TENSOR_MAP_BYTES]
    res = fn(out.ctypes.data, _TMAP_UINT16 if elem_bytes == 2 else _TMAP_UINT8, rank, ptr, (ctypes.c_uint64 * rank)(*dims),
             (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
             (ctypes.c_uint32 * rank)(*([1] * rank)), 0, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, 0)
    if res != 0:
        return None
    m = out.view(f"V{TENSOR_MAP_BYTES}")
    _tmap_cache.put(key, m)
    return m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def as_gpu_array(x, name: str):
    """Accept CuPy arrays and anything with __dlpack__ / __cuda_array_interface__ (torch, JAX, Numba). What is
    no array (a list, a NumPy scalar) is a TypeError naming `name`, CuPy or not."""
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not isinstance(x, np.generic):
        dev_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else None
        if dev_type == 1:  # kDLCPU: a host array of another library
            raise TypeError(f"{name}: a host (CPU) {type(x).__name__}; pass numpy.asarray(...) of it for the "
                            "float64 reference, or move it to the GPU")
        return require_cupy().from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return require_cupy().asarray(x)
    _checks.check_array_like(name, x)
    raise TypeError(f"{name}: expected a CuPy/NumPy array or a DLPack-capable GPU array, got {type(x).__name__}")


def ensure_contiguous(x):
    return x if x.flags.c_contiguous else cupy.ascontiguousarray(x)


def ensure_aligned16(x):
    """x as a C-contiguous array with a 16-byte aligned base (for 16-byte vector loads): x when it is one, else a
    copy."""
    x = ensure_contiguous(x)
    return x.copy() if x.data.ptr % 16 else x



_CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}


_ctype_memo: dict = {}  # dtype (or type, or name) as passed -> C++ name: dtype.name costs ~1.6 us a call


def ctype(dtype) -> str:
    """C++ type name for a NumPy/CuPy dtype, for template instances (float16 -> "__half")."""
    try:
        return _ctype_memo[dtype]
    except (KeyError, TypeError):
        pass
    name = np.dtype(dtype).name
    if name not in _CTYPES:
        raise TypeError(f"no CUDA type for dtype {name}")
    try:
        _ctype_memo[dtype] = _CTYPES[name]
    except TypeError:
        pass
    return _CTYPES[name]


def check_same_device(**arrays) -> None:
    """ValueError when GPU arrays live on different devices (kernels run on the first one's)."""
    devs = {name: a.device.id for name, a in arrays.items() if is_gpu_array(a)}
    if len(set(devs.values())) > 1:
        raise ValueError("arrays on different devices: " + ", ".join(f"{n} on GPU {d}" for n, d in devs.items()))
