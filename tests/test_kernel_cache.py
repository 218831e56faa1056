"""The on-disk kernel cache on the CPU (NVRTC and the driver faked): checksummed entries, damaged entries recompiled
with one warning, a cache directory that cannot be used, and cubins loaded from the verified bytes."""
import hashlib
import json
import sys
import types
import warnings

import pytest

from vbw_cupy import _device
from vbw_cupy import _runtime as rt

FILE, NAME, ARCH = "fp4_codec.cu", "quantize_mx<__half>", 90


@pytest.fixture
def compiles(tmp_path, monkeypatch):
    """A fake NVRTC: each compile returns a fresh cubin; the list holds the calls."""
    calls = []

    def compile_cubin(filename, names, arch, extra_options=()):
        calls.append((filename, tuple(names), arch))
        return b"\x7fELF cubin %d for %s" % (len(calls), names[0].encode()), {n: "_Z11quantize_mxI6__halfEvv"
                                                                             for n in names}
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rt, "compile_cubin", compile_cubin)
    monkeypatch.setattr(rt, "nvrtc_version", lambda: "12.8")
    monkeypatch.setattr(rt, "_unstored", {})
    rt.forget_warnings()
    yield calls
    rt.forget_warnings()


def entry_path():
    return rt.cache_dir() / "kernels" / f"{rt._disk_key(FILE, NAME, ARCH, ())}.cubin"


def test_entry_carries_a_checksum_and_is_reused(compiles):
    cubin, lowered = rt._cached_cubin(FILE, NAME, ARCH, ())
    path = entry_path()
    assert path.read_bytes() == f"{hashlib.sha256(cubin).hexdigest()} {lowered}\n".encode() + cubin
    assert lowered == "_Z11quantize_mxI6__halfEvv"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rt._cached_cubin(FILE, NAME, ARCH, ()) == (cubin, lowered)
    assert len(compiles) == 1
    assert [p for p in path.parent.iterdir()] == [path]   # one file an entry, no temp files left


def _damage(kind, path):
    data = path.read_bytes()
    head, cubin = data.split(b"\n", 1)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(data[:len(data) - len(cubin) // 2])
    elif kind == "flipped":
        path.write_bytes(head + b"\n" + cubin[:3] + bytes([cubin[3] ^ 1]) + cubin[4:])
    elif kind == "replaced":
        path.write_bytes(head + b"\nsomeone else's cubin")
    elif kind == "no-cubin":
        path.write_bytes(head + b"\n")
    elif kind == "head-garbage":
        path.write_bytes(b"\xff\xfe\x00 garbage\n" + cubin)
    elif kind == "head-short-hash":
        path.write_bytes(b"abc123 _Z1fv\n" + cubin)
    elif kind == "head-no-lowered":
        path.write_bytes(hashlib.sha256(cubin).hexdigest().encode() + b"\n" + cubin)
    elif kind == "no-newline":
        path.write_bytes(head)


@pytest.mark.parametrize("kind", ["empty", "truncated", "flipped", "replaced", "no-cubin", "head-garbage",
                                  "head-short-hash", "head-no-lowered", "no-newline"])
def test_damaged_entry_is_recompiled_with_one_warning(compiles, kind):
    rt._cached_cubin(FILE, NAME, ARCH, ())
    path = entry_path()
    _damage(kind, path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cubin, lowered = rt._cached_cubin(FILE, NAME, ARCH, ())
        _damage(kind, path)
        rt._cached_cubin(FILE, NAME, ARCH, ())      # damaged again: recompiled again, not warned again
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "unusable" in msgs[0] and "recompiling" in msgs[0], msgs
    assert len(compiles) == 3 and cubin == b"\x7fELF cubin 2 for " + NAME.encode()
    assert rt.read_cached_cubin(path)[0] is not None   # rewritten: the next read is a clean hit


def test_missing_entry_is_a_plain_miss(compiles):
    rt._cached_cubin(FILE, NAME, ARCH, ())
    entry_path().unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt._cached_cubin(FILE, NAME, ARCH, ())
    assert len(compiles) == 2


def test_cache_dir_that_is_a_file(compiles, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(blocker))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = rt._cached_cubin(FILE, NAME, ARCH, ())
        b = rt._cached_cubin(FILE, NAME, ARCH, ())
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "cannot use" in msgs[0] and "in memory for this process only" in msgs[0], msgs
    # kept in memory: the second call (the tuner compiles, then loads) does not compile again
    assert a[0] and b == a and len(compiles) == 1 and blocker.read_text() == "x"


def test_no_home_directory_is_no_cache_with_one_warning(compiles, monkeypatch):
    # HOME unset and no passwd entry (a container's --user): Path.home() raised in every compile
    import pathlib
    monkeypatch.delenv("VBW_CUPY_CACHE_DIR")
    monkeypatch.delenv("HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = rt._cached_cubin(FILE, NAME, ARCH, ())
        assert rt._cached_cubin(FILE, NAME, ARCH, ()) == a and len(compiles) == 1
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "no home directory" in msgs[0] and "VBW_CUPY_CACHE_DIR" in msgs[0], msgs
    assert not rt._NO_HOME.exists() and not rt._NO_HOME.parent.parent.exists()
    from vbw_cupy import autotune
    assert autotune.cache_summary()["status"] == "missing"


def test_sources_edited_while_running_are_not_stored(compiles, monkeypatch):
    # cuda_src/ changed after this process hashed it: a new cubin would be stored under the old sources' key,
    # where a later process with the old sources would load it
    rt.sources_hash()   # (hashed at first use, as in any process that compiled before the edit)
    monkeypatch.setattr(rt, "_hash_sources", lambda: "edited-since")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cubin, _ = rt._cached_cubin(FILE, NAME, ARCH, ())
    assert cubin and not entry_path().exists()
    assert [str(x.message) for x in w if "changed while this process ran" in str(x.message)]


class _FakeFunction:
    def __init__(self, module, name):
        self.module, self.name, self.ptr, self.calls = module, name, 0x1234, []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.calls.append((grid, block, args, shared_mem, stream))


class _FakeModule:
    loaded = []

    def load(self, cubin):
        if not cubin.startswith(b"\x7fELF"):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        self.loaded.append((FakeCuda.device, cubin))

    def get_function(self, name):
        return _FakeFunction(self, name)


class FakeCuda:
    device = 0


def _fake_cupy(monkeypatch):
    function = types.ModuleType("cupy.cuda.function")
    function.Module = _FakeModule
    runtime = types.SimpleNamespace(getDevice=lambda: FakeCuda.device, getDeviceCount=lambda: 2)
    cuda = types.SimpleNamespace(Device=lambda i=None: types.SimpleNamespace(id=FakeCuda.device if i is None else i,
                                                                           compute_capability="90"),
                                 runtime=runtime, function=function)
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.function", function)
    monkeypatch.setattr(rt, "cupy", cupy)
    monkeypatch.setattr(rt, "_modules", {})
    _device._device_arch.cache_clear()
    _FakeModule.loaded = []


def test_get_kernel_loads_the_verified_bytes_per_device(compiles, monkeypatch):
    _fake_cupy(monkeypatch)
    try:
        k = rt.get_kernel(FILE, NAME)
        cubin, _ = rt._cached_cubin(FILE, NAME, ARCH, ())
        assert _FakeModule.loaded == [(0, cubin)] and len(compiles) == 1   # loaded at once, from the bytes
        assert rt.get_kernel(FILE, NAME) is k
        k((1,), (32,), (1, 2), shared_mem=16)
        assert k.kernel.name == "_Z11quantize_mxI6__halfEvv" and k.kernel.calls == [((1,), (32,), (1, 2), 16, None)]
        FakeCuda.device = 1                        # another device: the same object loads into its context
        k((2,), (64,), ())
        assert [d for d, _ in _FakeModule.loaded] == [0, 1]
    finally:
        FakeCuda.device = 0
        _device._device_arch.cache_clear()


def test_kernel_attributes_through_the_driver(compiles, monkeypatch):
    """attributes / max_dynamic_shared_size_bytes as on cupy.RawKernel, read from the loaded function."""
    _fake_cupy(monkeypatch)
    attrs = {}
    driver = types.ModuleType("cupy_backends.cuda.api.driver")
    driver.funcGetAttribute = lambda attr, ptr: attrs.get((attr, ptr), 7)
    driver.funcSetAttribute = lambda ptr, attr, value: attrs.__setitem__((attr, ptr), value)
    api = types.ModuleType("cupy_backends.cuda.api")
    api.driver = driver
    for name, mod in (("cupy_backends", types.ModuleType("cupy_backends")),
                      ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                      ("cupy_backends.cuda.api", api), ("cupy_backends.cuda.api.driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["cupy_backends"].cuda = sys.modules["cupy_backends.cuda"]
    sys.modules["cupy_backends.cuda"].api = api
    try:
        k = rt.get_kernel(FILE, NAME)
        assert k.max_dynamic_shared_size_bytes == 7
        k.max_dynamic_shared_size_bytes = 100_000
        assert attrs == {(8, 0x1234): 100_000} and k.max_dynamic_shared_size_bytes == 100_000
        a = k.attributes
        assert set(a) >= {"num_regs", "shared_size_bytes", "local_size_bytes", "max_threads_per_block"}
        assert a["num_regs"] == 7 and a["max_dynamic_shared_size_bytes"] == 100_000
    finally:
        _device._device_arch.cache_clear()


_RACER = """
import json, sys, pathlib, time
from vbw_cupy import _runtime as rt
d, role, me, n = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sig, readers = pathlib.Path(sys.argv[5]), int(sys.argv[6])
path = d / "k.cubin"
seen = {"hit": 0, "miss": 0, "bad": 0}
if role == "writer":   # the race starts once every reader has read the whole entry stored before it
    t0 = time.time()
    while len(list(sig.iterdir())) < readers and time.time() - t0 < 60:
        time.sleep(0.001)
for i in range(n):
    if role == "writer":   # writer w stores cubins of its own length and content, named after itself
        rt.write_cached_cubin(path, bytes([65 + me]) * (1000 + 37 * me + i % 5), f"kernel_w{me}")
    else:
        if i == 1:
            (sig / f"reader{me}").touch()
        cubin, lowered, why = rt.read_cached_cubin(path)
        if cubin is None:
            seen["bad" if why else "miss"] += 1
            continue
        w = cubin[0] - 65      # every byte of a cubin comes from one writer, and its name says the same one
        assert cubin == bytes([65 + w]) * len(cubin) and lowered == f"kernel_w{w}", (len(cubin), lowered)
        seen["hit"] += 1
print(json.dumps(seen))
"""


def test_concurrent_writers_and_readers_never_pair_the_wrong_cubin(tmp_path):
    """Several processes write the same entry with different cubins while others read it: a reader always gets
    one writer's whole cubin with its own name (an entry is one file renamed into place: never a damaged
    read), every writer's temporary files are gone at the end, and the entry left is whole. The entry exists
    before the processes start (a writer "9" of this process), and the writers start once every reader has read
    it, then the readers read on during the race. (With a cubin and a .name file per entry, racing writers could
    leave one's name beside the other's cubin: a checksum miss for every later process.)"""
    import subprocess
    entry, sig = tmp_path / "entry", tmp_path / "sig"
    entry.mkdir()
    sig.mkdir()
    rt.write_cached_cubin(entry / "k.cubin", bytes([65 + 9]) * 900, "kernel_w9")
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(entry), role, str(i), "300", str(sig), "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, role in enumerate(["writer"] * 3 + ["reader"] * 3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    seen = [json.loads(out.strip().splitlines()[-1]) for (out, _), p in zip(outs, procs) if p.args[4] == "reader"]
    assert len(seen) == 3 and all(x["hit"] == 300 and not x["bad"] and not x["miss"] for x in seen), seen
    assert sorted(x.name for x in entry.iterdir()) == ["k.cubin"]
    cubin, lowered, why = rt.read_cached_cubin(entry / "k.cubin")
    assert cubin is not None and lowered == f"kernel_w{cubin[0] - 65}", why


def test_new_cache_directories_are_private(compiles):
    """Directories the cache creates are its owner's alone (a cubin found there is loaded and run); the
    checksum then guards against damage, not against another user."""
    rt._cached_cubin(FILE, NAME, ARCH, ())
    for d in (rt.cache_dir(), rt.cache_dir() / "kernels"):
        assert d.is_dir() and d.stat().st_mode & 0o077 == 0, (d, oct(d.stat().st_mode))
