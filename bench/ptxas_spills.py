"""Registers and spills of every attention kernel instance, from NVRTC's ptxas log: no GPU needed.

    python bench/ptxas_spills.py [--only SUBSTRING] [--all]

Compiles each instance of attention_fwd.cu that vbw_cupy.attention, .sparse and .attention_fp8 can launch on
sm_90 (both kernels: attn_fwd_wg and attn_fwd) with `--ptxas-options=-v`, in parallel, and prints one line per
instance that spills (every instance with --all): spill bytes, registers, static shared memory. Run it before
and after a kernel change and compare: code outside a loop (a prologue, an epilogue) can move ptxas's register
allocation inside it, and the warp-specialized tiles at the edge of their registers then spill (2026-11-27:
4-32 bytes in the D = 64 tiles from changes to a CTA's first and last instructions).
"""
import argparse
import concurrent.futures as cf
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vbw_cupy import _runtime as rt  # noqa: E402
from vbw_cupy import attention, attention_fp8, sparse  # noqa: E402


def instances(only=None):
    names = set()
    for mod in (attention, sparse, attention_fp8):
        if hasattr(mod, "kernel_instances"):
            names |= {n for f, n in mod.kernel_instances(90) if f == attention.SOURCE}
    return sorted(n for n in names if only is None or only in n)


def ptxas_info(name):
    from cupy.cuda import nvrtc
    src = (rt.SOURCE_DIR / attention.SOURCE).read_text()
    prog = nvrtc.createProgram(src, attention.SOURCE, [], [])
    nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, rt.compile_options(90, ("--ptxas-options=-v",)))
    except Exception:
        return name, None, nvrtc.getProgramLog(prog)[-600:]
    log = nvrtc.getProgramLog(prog)
    spill = max((int(x) for x in re.findall(r"(\d+) bytes spill stores", log)), default=0)
    regs = re.findall(r"Used (\d+) registers", log)
    smem = re.findall(r"(\d+) bytes smem", log)
    return name, (spill, int(regs[-1]) if regs else -1, int(smem[-1]) if smem else 0), None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="instances whose name contains this")
    ap.add_argument("--all", action="store_true", help="print every instance, not only those that spill")
    a = ap.parse_args(argv)
    names = instances(a.only)
    print(f"{len(names)} instances (sm_90)", flush=True)
    bad = 0
    with cf.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as ex:
        for name, info, err in ex.map(ptxas_info, names):
            if err is not None:
                bad += 1
                print(f"ERROR {name}: {err}", flush=True)
            elif a.all or info[0]:
                print(f"spill {info[0]:4d} B  regs {info[1]:3d}  static smem {info[2]:4d} B  {name}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
