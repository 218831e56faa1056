#!/usr/bin/env bash
# One pass over everything that needs a GPU: the GPU test suite, the self-check and each benchmark's
# table, with logs under $OUT (or ./gpu-check). Run from the repository root on a machine with a GPU:
#   bash bench/gpu_check.sh            (a few minutes on an H100/H200, compile time included; FULL=1 for all shapes)
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-check}; mkdir -p "$OUT"
step() { local name=$1; shift; local t0=$SECONDS; echo "== $name: $*"; "$@" > "$OUT/$name.log" 2>&1; local rc=$?
         echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-4}" "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
step info python3 -m vbw_cupy info
step precompile_attention python3 bench/bench_attention.py --precompile
step precompile_decode python3 bench/bench_decode.py --precompile
step tests python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --durations=5
step selftest python3 -m vbw_cupy selftest
TAIL=12 step bench_codec python3 bench/bench_fp4_codec.py
# FULL=1 runs every benchmark shape; the default is a subset that covers each issue's bars
if [ "${FULL:-0}" = 1 ]; then
  TAIL=24 step bench_gemm python3 bench/bench_fp4_gemm.py
  TAIL=40 step bench_attention python3 bench/bench_attention.py --quick
  TAIL=40 step bench_decode python3 bench/bench_decode.py --quick
else
  TAIL=8 step bench_gemm python3 bench/bench_fp4_gemm.py --quick
  TAIL=12 step bench_attention python3 bench/bench_attention.py --quick --D 64 128 --S 4096
  TAIL=8 step bench_decode python3 bench/bench_decode.py --only-bars
fi
