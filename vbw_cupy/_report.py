"""A Markdown report of pytest-benchmark results: one table per operation and, with matplotlib, one PNG per
operation of our throughput against each peer's over the benchmark shapes.

Input: the JSON files `pytest --benchmark-json` writes. bench/*.py put their measurements in each benchmark's
extra_info: throughput (``ours_tflops`` / ``tflops`` / ``GB/s`` / ``kv_gbs``), the peers' (``<peer>_tflops``,
``peer_tflops``, ``copy GB/s`` / ``copy_gbs``) and ratios (``ratio*``: peer time / ours, > 1 is a win;
``fraction of copy`` / ``ratio_of_copy``: ours / copy bandwidth). Used by `vbw-cupy bench --report DIR` and
bench/report.py.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from collections import defaultdict

#: extra_info keys holding our throughput, first match wins
OURS_KEYS = ("ours_tflops", "tflops", "GB/s", "kv_gbs", "ours_gbs")
_PEER = re.compile(r"^(?:(?P<a>.+)_tflops|copy GB/s|copy_gbs)$")
_RATIO = re.compile(r"^(ratio.*|peer_ratio|fraction of copy)$")


def load(paths) -> list[dict]:
    """Every benchmark of the given pytest-benchmark JSON files, in order."""
    out = []
    for p in paths:
        try:
            data = json.loads(pathlib.Path(p).read_text())
        except ValueError as e:
            raise ValueError(f"{p}: not a JSON file ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
            raise ValueError(f"{p}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
        if not all(isinstance(b, dict) for b in data["benchmarks"]):
            raise ValueError(f"{p}: not a pytest-benchmark JSON file (its 'benchmarks' are not all objects)")
        out += data["benchmarks"]
    return out


def _op_and_shape(bench: dict) -> tuple[str, str]:
    name = bench.get("name", "?")
    op, _, shape = name.partition("[")
    return op.removeprefix("test_"), shape.rstrip("]") or "-"


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "-" if v is None else str(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def series(rows: list[dict]) -> tuple[str | None, dict[str, list]]:
    """(unit, {label: values per row}) of the throughputs to plot: ours, then each peer; (None, {}) if none."""
    keys = {k for r in rows for k, v in r["extra_info"].items() if _number(v) is not None}
    ours = next((k for k in OURS_KEYS if k in keys), None)
    if ours is None:
        return None, {}
    peers = sorted(k for k in keys if k != ours and _PEER.match(k))
    unit = "TFLOP/s" if "tflops" in ours else "GB/s"
    peers = [k for k in peers if ("tflops" in k) == (unit == "TFLOP/s")]
    label = (lambda k: "copy" if k.startswith("copy") else _PEER.match(k).group("a") or k)
    out = {"vbw_cupy": [_number(r["extra_info"].get(ours)) for r in rows]}
    for k in peers:
        out[label(k)] = [_number(r["extra_info"].get(k)) for r in rows]
    return unit, out


def _wins(rows: list[dict]) -> str:
    """One line: how many shapes each ratio wins (> 1) and its range."""
    parts = []
    keys = sorted({k for r in rows for k in r["extra_info"] if _RATIO.match(k)})
    for k in keys:
        vals = [v for v in (_number(r["extra_info"].get(k)) for r in rows) if v is not None]
        if vals:
            what = "of copy bandwidth" if "copy" in k else "peer time / ours"
            span = f"{min(vals):.2f}" if min(vals) == max(vals) else f"{min(vals):.2f}-{max(vals):.2f}"
            parts.append(f"`{k}`: {sum(v >= 1.0 for v in vals)}/{len(vals)} shapes >= 1 ({span}x {what})")
    return "; ".join(parts)


def _plot(path: pathlib.Path, op: str, shapes: list[str], unit: str, data: dict[str, list]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n, k = len(shapes), len(data)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * n * k + 2), 4))
    for i, (label, vals) in enumerate(data.items()):
        ax.bar([j + (i - (k - 1) / 2) * width for j in range(n)], [v if v is not None else 0 for v in vals],
               width, label=label)
    ax.set_xticks(range(n))
    ax.set_xticklabels(shapes, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(f"{op}: vbw_cupy against its peers (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write(benchmarks: list[dict], out_dir, title: str = "vbw_cupy benchmarks", plots: bool = True) -> pathlib.Path:
    """Write out_dir/index.md (a table per operation) and out_dir/<op>.png (where matplotlib is installed and a
    throughput is known). Returns the index's path."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_op: dict[str, list[dict]] = defaultdict(list)
    for b in benchmarks:
        op, shape = _op_and_shape(b)
        by_op[op].append({"shape": shape, "median_ms": _number((b.get("stats") or {}).get("median")),
                          "extra_info": b.get("extra_info") or {}})
    lines = [f"# {title}", "", "Ratios are peer time / our time (> 1: vbw_cupy is faster) or our bandwidth / a "
             "device copy's. Times are pytest-benchmark medians of the whole call, synchronized.", ""]
    missing_plots = False
    for op, rows in by_op.items():
        for r in rows:
            if r["median_ms"] is not None:
                r["median_ms"] *= 1e3  # pytest-benchmark's stats are seconds
        lines += [f"## {op}", ""]
        wins = _wins(rows)
        if wins:
            lines += [wins, ""]
        unit, data = series(rows)
        if unit and plots:
            png = out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', op)}.png"
            if _plot(png, op, [r["shape"] for r in rows], unit, data):
                lines += [f"![{op}]({png.name})", ""]
            else:
                missing_plots = True
        keys = [k for k in dict.fromkeys(k for r in rows for k in r["extra_info"])]
        lines.append("| shape | median ms | " + " | ".join(keys) + " |")
        lines.append("|---" * (len(keys) + 2) + "|")
        for r in rows:
            cells = [r["shape"], _fmt(r["median_ms"])] + [_fmt(r["extra_info"].get(k)) for k in keys]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        lines.append("")
    if not by_op:
        lines += ["No benchmarks in the input.", ""]
    if missing_plots:
        lines += ["(Plots need matplotlib: `pip install matplotlib`.)", ""]
    index = out_dir / "index.md"
    index.write_text("\n".join(lines))
    return index
