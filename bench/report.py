"""A Markdown report (index.md, a table per operation, PNG plots with matplotlib) from pytest-benchmark JSON:

    python -m pytest bench/ --benchmark-only --benchmark-json=bench.json
    python bench/report.py bench.json --out report/        (or in one step: vbw-cupy bench --report report/)
"""
import argparse
import sys

from vbw_cupy import _report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="pytest-benchmark JSON files (--benchmark-json)")
    p.add_argument("--out", required=True, help="the report's directory")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    a = p.parse_args(argv)
    print(_report.write(_report.load(a.json), a.out, plots=not a.no_plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
