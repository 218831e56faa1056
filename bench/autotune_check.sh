#!/usr/bin/env bash
# The autotuner's bars (issue 5) in one pass, logs under $OUT (or ./autotune-check):
#  1. the benchmark tables with VBW_CUPY_AUTOTUNE=0 (per-architecture defaults),
#  2. `vbw-cupy tune` on the standard shapes (precompiles every candidate first),
#  3. the same tables again, now served from the tuning cache,
#  4. a fresh process's first call of a tuned kernel: cache hit, no timing (autotune.stats()).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export VBW_CUPY_CACHE_DIR=${VBW_CUPY_CACHE_DIR:-/tmp/vbw-autotune-check}
OUT=${OUT:-autotune-check}; mkdir -p "$OUT"
tables() {  # $1: log suffix
  python3 bench/bench_fp4_gemm.py --quick --no-check > "$OUT/gemm_$1.log" 2>&1
  python3 bench/bench_attention.py --quick --D 64 128 --S 4096 > "$OUT/attention_$1.log" 2>&1
  python3 bench/bench_decode.py --only-bars > "$OUT/decode_$1.log" 2>&1
}
VBW_CUPY_AUTOTUNE=0 tables default
python3 -m vbw_cupy tune > "$OUT/tune.log" 2>&1; echo "tune rc=$?"
VBW_CUPY_AUTOTUNE=1 tables tuned
python3 - > "$OUT/fresh_process.log" 2>&1 <<'PY'
import time, cupy as cp, vbw_cupy as vc
from vbw_cupy import autotune
w = vc.quantize(cp.random.standard_normal((8192, 8192), dtype=cp.float32), "nvfp4")
a = cp.random.standard_normal((16, 8192), dtype=cp.float32).astype(cp.float16)
vc.fp4_matmul(a[:1], w); cp.cuda.Device().synchronize()     # compile + weight prepare, outside the timing
autotune.reset()
t0 = time.perf_counter(); vc.fp4_matmul(a, w); cp.cuda.Device().synchronize(); first = time.perf_counter() - t0
t0 = time.perf_counter(); vc.fp4_matmul(a, w); cp.cuda.Device().synchronize(); second = time.perf_counter() - t0
print(f"fresh process, tuned key M=16: first call {first * 1e3:.2f} ms, second {second * 1e3:.2f} ms, stats {autotune.stats()}")
PY
tail -n 30 "$OUT/tune.log"; cat "$OUT/fresh_process.log"
for f in gemm attention decode; do echo "== $f: default, then tuned"; tail -n 12 "$OUT/${f}_default.log"; tail -n 12 "$OUT/${f}_tuned.log"; done
