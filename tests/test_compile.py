"""Every kernel variant compiles through NVRTC for sm_80 and sm_90 on a machine with no GPU."""
import pytest

from vbw_cupy import _runtime as rt
from vbw_cupy.cli import op_modules

pytestmark = [pytest.mark.skipif(not rt.have_cupy(), reason="CuPy (with NVRTC) is not installed"), pytest.mark.slow]

def _modules():
    from vbw_cupy import autotune  # its probe kernel is compiled too
    return op_modules() + [autotune]


INSTANCES = sorted({inst for m in _modules() if hasattr(m, "kernel_instances") for inst in m.kernel_instances()})


def test_every_source_file_has_instances():
    used = {f for f, _ in INSTANCES}
    sources = {p.name for p in rt.SOURCE_DIR.glob("*.cu")}
    assert sources - used == set(), f"kernels never compiled by any module: {sources - used}"


CHUNK = 24  # instances per NVRTC program: a big file is several tests, so a CPU-only run shows its progress
CHUNKS = [(f, i) for f in sorted({f for f, _ in INSTANCES})
          for i in range(-(-sum(1 for g, _ in INSTANCES if g == f) // CHUNK))]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("filename, chunk", CHUNKS, ids=[f"{f}-{i}" for f, i in CHUNKS])
def test_compiles(filename, chunk, arch):
    names = [n for f, n in INSTANCES if f == filename][chunk * CHUNK:(chunk + 1) * CHUNK]
    cubin, lowered = rt.compile_cubin(filename, names, arch)
    assert len(cubin) > 0 and set(lowered) == set(names)


def test_compile_error_shows_log():
    with pytest.raises(rt.CompileError, match="fp4_codec.cu.*no_such_kernel"):
        rt.compile_cubin("fp4_codec.cu", ["no_such_kernel<int>"], 80)


def test_precompile_fills_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path))
    some = [(f, n) for f, n in INSTANCES if f == "fp4_codec.cu"][:3]
    assert rt.precompile(some, arch=80, workers=2, progress=False) == []
    stamp = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()}
    assert len(stamp) == len(some)  # one file an entry (its checksum and lowered name, then the cubin)
    assert rt.precompile(some, arch=80, workers=2, progress=False) == []  # second time: all cache hits
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()} == stamp  # nothing rewritten
    bad = rt.precompile([("fp4_codec.cu", "no_such_kernel<int>")], arch=80, workers=1, progress=False)
    assert len(bad) == 1 and "no_such_kernel" in bad[0][1]
