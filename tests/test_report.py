"""The benchmark report (vbw_cupy._report, `vbw-cupy bench --report`, bench/report.py) from a small synthetic
pytest-benchmark JSON file, on the CPU."""
import json
import pathlib
import subprocess
import sys

import pytest

from vbw_cupy import _report, cli

SAMPLE = pathlib.Path(__file__).parent / "data" / "benchmark_sample.json"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _section(text, op):
    return text.split(f"## {op}\n", 1)[1].split("\n## ", 1)[0]


def test_tables_per_operation_and_wins(tmp_path):
    index = _report.write(_report.load([SAMPLE]), tmp_path, plots=False)
    text = index.read_text()
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == [
        "attention_fwd", "fp4_matmul", "quantize", "stories110m_decode"]
    att = _section(text, "attention_fwd")
    assert "`ratio_vs_FLASH`: 1/2 shapes >= 1 (0.92-1.26x peer time / ours)" in att
    assert "`ratio_vs_CUDNN`: 0/1 shapes >= 1" in att
    assert "| float16-False-4096-128 | 1 | 8 | 16 | 0.95 | 520.1 |" in att       # median 0.001 s = 1 ms
    assert "| float16-True-4096-64 | 0.6 |" in att and "| - |" in att              # a missing peer
    assert "`fraction of copy`: 0/1 shapes >= 1 (0.77x of copy bandwidth)" in _section(text, "quantize")
    model = _section(text, "stories110m_decode")
    assert "| - | 2.4 | vbw nvfp4 | 410.5 |" in model and "shapes >= 1" not in model
    assert "![" not in text and "matplotlib" not in text                          # plots=False: tables only


def test_series_pick_ours_and_same_unit_peers():
    rows = [{"extra_info": b["extra_info"]} for b in _report.load([SAMPLE])]
    assert _report.series(rows[:2]) == ("TFLOP/s", {"vbw_cupy": [520.1, 300.0], "CUDNN": [600.0, None],
                                                    "FLASH": [410.0, 327.0]})
    assert _report.series(rows[2:3]) == ("TFLOP/s", {"vbw_cupy": [6.4], "peer": [2.8]})
    assert _report.series(rows[3:4]) == ("GB/s", {"vbw_cupy": [2400.0], "copy": [3100.0]})
    assert _report.series(rows[4:]) == (None, {})


def test_plots_or_a_note_without_matplotlib(tmp_path, monkeypatch):
    plotted = []
    monkeypatch.setattr(_report, "_plot", lambda path, op, shapes, unit, data: plotted.append((path.name, unit)) or True)
    text = _report.write(_report.load([SAMPLE]), tmp_path).read_text()
    assert plotted == [("attention_fwd.png", "TFLOP/s"), ("fp4_matmul.png", "TFLOP/s"), ("quantize.png", "GB/s")]
    assert "![attention_fwd](attention_fwd.png)" in text
    monkeypatch.setattr(_report, "_plot", lambda *a: False)
    assert "Plots need matplotlib" in _report.write(_report.load([SAMPLE]), tmp_path / "b").read_text()


def test_real_plot_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    _report.write(_report.load([SAMPLE]), tmp_path)
    assert (tmp_path / "attention_fwd.png").read_bytes()[:4] == b"\x89PNG"


def test_not_a_benchmark_file(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a pytest-benchmark JSON"):
        _report.load([tmp_path / "x.json"])


def test_cli_report_from_json_and_after_a_run(tmp_path, monkeypatch, capsys):
    assert cli.main(["bench", "--report", str(tmp_path / "a"), "--json", str(SAMPLE)]) == 0
    assert (tmp_path / "a" / "index.md").is_file()
    assert cli.main(["bench", "--json", str(SAMPLE)]) == 2
    seen = []

    def fake_pytest(cmd, cwd):  # what `pytest --benchmark-json=...` leaves behind
        seen.append(cmd)
        out = next(a for a in cmd if a.startswith("--benchmark-json=")).split("=", 1)[1]
        pathlib.Path(out).write_text(SAMPLE.read_text())
        return 0
    monkeypatch.setattr(cli.subprocess, "call", fake_pytest)
    monkeypatch.setattr(cli, "_gpu_unusable", lambda: None)   # a run that measured (on this CPU: exit 3)
    assert cli.main(["bench", "--report", str(tmp_path / "b"), "-k", "attention"]) == 0
    assert seen[0][-2:] == ["-k", "attention"] and "## fp4_matmul" in (tmp_path / "b" / "index.md").read_text()


def test_bench_report_script(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), str(SAMPLE), "--out", str(tmp_path),
                        "--no-plots"], capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "index.md").read_text().startswith("# vbw_cupy benchmarks")
