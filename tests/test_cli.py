"""The command line on the CPU: --version, a description per subcommand, `bench` passing pytest's options through,
selftest's exit status without a GPU, and the one-line refusal of GPUs older than sm_80."""
import types

import pytest

import vbw_cupy
from vbw_cupy import _device
from vbw_cupy import _runtime as rt
from vbw_cupy import cli


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vbw_cupy {vbw_cupy.__version__}"


def test_every_subcommand_has_help_and_a_description():
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd")
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert set(sub.choices) == {"selftest", "info", "bench", "tune", "generate", "bench-model", "warmup"} == set(helps)
    for name, sp in sub.choices.items():
        assert helps[name] and sp.description and len(sp.description) > 40, name
    assert "3" in sub.choices["selftest"].epilog and "reference" in sub.choices["selftest"].epilog


@pytest.mark.parametrize("argv, want", [
    (["bench"], []),
    (["bench", "-k", "attention"], ["-k", "attention"]),
    (["bench", "bench/bench_attention.py", "-x", "-k", "a and b"], ["bench/bench_attention.py", "-x", "-k", "a and b"]),
    (["bench", "--", "-h"], ["-h"]),
    (["bench", "-q", "--", "--benchmark-json", "out.json"], ["-q", "--benchmark-json", "out.json"]),
])
def test_bench_passes_pytest_options_through(monkeypatch, argv, want):
    seen = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd=None: seen.append(cmd) or 0)
    monkeypatch.setattr(cli, "_gpu_unusable", lambda: None)
    assert cli.main(argv) == 0
    (cmd,), = [seen]
    assert cmd[cmd.index("--benchmark-only") + 2:] == want and cmd[2] == "pytest"


def test_unknown_options_of_other_commands_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_selftest_without_a_gpu_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(rt, "gpu_available", lambda: False)
    assert cli.main(["selftest"]) == cli.EXIT_REFERENCE_ONLY == 3
    out = capsys.readouterr().out
    assert "GPU kernels not run" in out and "no GPU kernel was checked (exit status 3)" in out


def test_selftest_fails_with_1_when_the_reference_is_wrong(monkeypatch, capsys):
    monkeypatch.setattr(rt, "gpu_available", lambda: False)
    monkeypatch.setattr(cli, "_cpu_selftest", lambda: [{"op": "x", "shape": "-", "ok": False}])
    assert cli.main(["selftest"]) == 1


def _old_gpu(monkeypatch, arch="75", name=b"Tesla T4"):
    """CuPy that sees one GPU of compute capability `arch`."""
    dev = types.SimpleNamespace(id=0, compute_capability=arch)
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": name},
                                    getDevice=lambda: 0)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i=None: dev, runtime=runtime),
                                 ndarray=type("ndarray", (), {}))
    monkeypatch.setattr(rt, "cupy", fake)
    monkeypatch.setattr(_device, "_device_cache", {})
    _device._device_arch.cache_clear()
    return fake


def test_old_gpu_refused_with_one_line_before_any_compile(monkeypatch, capsys):
    _old_gpu(monkeypatch)

    def no_compile(*a, **k):
        raise AssertionError("compiled for an unsupported GPU")
    monkeypatch.setattr(rt, "compile_cubin", no_compile)
    monkeypatch.setattr(rt, "_modules", {})
    with pytest.raises(RuntimeError) as e:
        rt.get_kernel("fp4_codec.cu", "quantize_mx<__half>")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("vbw_cupy needs an sm_80 or newer GPU (Ampere+); this is sm_75 Tesla T4")
    with pytest.raises(RuntimeError, match="needs an sm_80"):
        _device.query_device()
    # selftest and tune say why and check only the reference (tune: nothing measured, the same exit status)
    assert cli.main(["selftest"]) == 3
    assert "this is sm_75 Tesla T4" in capsys.readouterr().out
    assert cli.main(["tune"]) == 3
    assert "this is sm_75 Tesla T4" in capsys.readouterr().out
    assert cli.main(["tune", "no_such_kernel"]) == 2
    err = capsys.readouterr().err
    assert "unknown kernel name(s) no_such_kernel" in err and "attention_fwd_d128" in err
    _device._device_arch.cache_clear()


def test_sm80_and_newer_accepted(monkeypatch):
    for arch in ("80", "86", "90", "120"):
        _old_gpu(monkeypatch, arch, "NVIDIA X")
        assert _device.device_arch() == int(arch)
    _device._device_arch.cache_clear()


def test_bench_without_a_gpu_says_nothing_was_measured(monkeypatch, capsys):
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd=None: 0)
    monkeypatch.setattr(cli, "_gpu_unusable", lambda: "no CUDA device is visible")
    assert cli.main(["bench"]) == cli.EXIT_REFERENCE_ONLY
    assert "nothing was measured" in capsys.readouterr().err
    assert cli.main(["bench", "--", "-h"]) == 0   # pytest's help is not a benchmark run


def test_bench_report_without_a_gpu_and_bad_json_files(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd=None: 0)   # (pytest ran, wrote no results)
    monkeypatch.setattr(cli, "_gpu_unusable", lambda: "no CUDA device is visible")
    assert cli.main(["bench", "--report", str(tmp_path / "r")]) == cli.EXIT_REFERENCE_ONLY
    assert "nothing was measured" in capsys.readouterr().err
    (tmp_path / "notjson.json").write_text("{oops")
    (tmp_path / "other.json").write_text('{"machine_info": {}}')
    (tmp_path / "ints.json").write_text('{"benchmarks": [1]}')
    for name, match in (("missing.json", "No such file"), ("notjson.json", "not a JSON file"),
                        ("other.json", "no 'benchmarks' list"), ("ints.json", "are not all objects")):
        assert cli.main(["bench", "--report", str(tmp_path / "r"), "--json", str(tmp_path / name)]) == 2
        assert match in capsys.readouterr().err
    assert cli.main(["bench", "--report", str(tmp_path / "ints.json")]) == 2   # a file where the directory goes
    assert "exists and is not a directory" in capsys.readouterr().err


def test_cold_start_scripts_name_real_ops():
    """selftest --cold: every op's first-call script is valid Python calling public API that exists."""
    import ast
    from vbw_cupy import _coldstart
    for op, (setup, call) in _coldstart.OPS.items():
        tree = ast.parse(_coldstart._script(setup, call))
        names = {n.attr for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "vc"}
        assert names, op
        for name in names:
            assert hasattr(vbw_cupy, name), (op, name)


@pytest.mark.gpu
def test_cold_start_first_call_is_timed_in_a_fresh_process(tmp_path):
    """One op through selftest --cold's path: an empty cache costs more than the warm disk cache it fills."""
    from vbw_cupy import _coldstart
    op = "quantize nvfp4 4096x4096"
    cold, stats = _coldstart.first_call_s(op, str(tmp_path))
    warm = _coldstart.first_call_s(op, str(tmp_path))[0]
    assert 0 < warm < cold, (warm, cold)
    assert stats["tuned"] == 0 and stats["compile_s"] == 0.0  # quantize has nothing to tune
    assert any(tmp_path.rglob("*.cubin")), "the first process left no kernel in the cache"


def test_cold_start_reports_a_failed_op_and_goes_on(monkeypatch, capsys):
    """A first-call process that fails or times out is a 'failed' row; the other ops are still measured."""
    import subprocess
    from vbw_cupy import _coldstart

    def fake(op, cache_dir, autotune=True, timeout=600.0):
        assert "vbw_cupy_cold_" in cache_dir
        if op.startswith("fp4_matmul"):
            raise RuntimeError(f"{op}: the first-call process failed:\nValueError: boom")
        if op.startswith("paged"):
            raise subprocess.TimeoutExpired("python", timeout)
        return 0.5, {"compile_s": 0.25, "timing_s": 0.125}
    monkeypatch.setattr(_coldstart, "first_call_s", fake)
    rows = _coldstart.measure(progress=lambda m: None)
    assert [r["op"] for r in rows] == list(_coldstart.OPS)
    by = {r["op"]: r for r in rows}
    assert by["quantize nvfp4 4096x4096"]["cold_s"] == 0.5 and not by["quantize nvfp4 4096x4096"]["ok"]  # warm 0.5 > 0.1
    assert by["fp4_matmul M=16 4096x4096"]["error"] == "ValueError: boom"
    assert "timed out" in by["paged_attention B=8 ctx 2048"]["error"]
    _coldstart.print_rows(rows)
    out = capsys.readouterr().out
    assert "failed" in out and "OVER" in out and "0.25     0.12" in out


def test_a_cupy_that_fails_to_import_is_named(monkeypatch, capsys):
    # an installed CuPy whose import failed (a missing CUDA library) was reported as "not installed"
    from vbw_cupy import _runtime as rt
    monkeypatch.setattr(rt, "cupy", None)
    monkeypatch.setattr(rt, "_CUPY_IMPORT_ERROR", ImportError("libnvrtc.so.12: cannot open shared object file"))
    assert rt.cupy_missing() == ("CuPy is installed but failed to import (ImportError: libnvrtc.so.12: cannot open "
                                 "shared object file)")
    assert cli.main(["info"]) == 0
    assert "CuPy: installed but failed to import (ImportError: libnvrtc.so.12" in capsys.readouterr().out
    missing = ModuleNotFoundError("No module named 'cupy'")
    missing.name = "cupy"
    monkeypatch.setattr(rt, "_CUPY_IMPORT_ERROR", missing)
    assert rt.cupy_missing() == "CuPy is not installed"



def test_a_closed_output_pipe_is_no_error(monkeypatch, capsys):
    # `vbw-cupy generate ... | head`: generate's OSError handler took the BrokenPipeError ("[Errno 32] Broken pipe",
    # exit 2) before main's, which ends quietly
    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli, "_generate", closed)
    monkeypatch.setattr(cli.os, "dup2", lambda *a: None)   # (the test's stdout stays as it is)
    assert cli.main(["generate", "x.bin"]) == 1
    assert "Broken pipe" not in capsys.readouterr().err
