#!/usr/bin/env bash
# The GPU tests under compute-sanitizer, with CuPy's memory pools off (VBW_TEST_NO_POOL=1, see conftest.py) so
# every array is its own allocation and an access past its end is caught:
#   memcheck   the bad-index tests of tests/test_call_path.py, the GPU model and block-sparse tests, the GPU fuzz,
#              small warp-specialized attention calls, FP8 attention (its kernel and the V transpose), the M = 1
#              decode GEMV (mmvk: odd K, partial row groups, every k-split)
#   racecheck  a small selection: shared-memory hazards in the attention, paged and sparse kernels
#   synccheck  the same selection: barriers and warp syncs
# Run from the repository root on a GPU machine (tens of minutes: memcheck slows kernels 10-100x). Logs go to
# $OUT (default ./sanitize-logs): <tool>.<n>.pytest.log (pytest's output for selection n) and <tool>.<n>.<pid>.log
# (the sanitizer's, one per process: the fuzz runs each op in a subprocess). Prints one line per tool; exits 1 on
# any sanitizer error or test failure. MEMCHECK / SMALL override the pytest selections (';'-separated), TOOLS the
# tools run (default all three), COMPUTE_SANITIZER the binary.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 VBW_TEST_NO_POOL=1 VBW_CUPY_AUTOTUNE=0
OUT=${OUT:-sanitize-logs}; mkdir -p "$OUT"
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$CS" ]; then echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; fi
# pytest selections, one pytest run each (a -k applies to a whole run), separated by ';'
# (the attention selection runs the warp-specialized kernel: D = 128 and 96, dense and packed varlen, and its
# persistent form on 1- to 7-CTA grids, following the launcher's schedule under a mask)
ATTN="tests/test_attention.py -k 'head_dims and (128 or 96)'; tests/test_attention.py -k 'never_leaks and 128'; tests/test_attention.py -k persistent_tiles; tests/test_attention_fp8.py -k 'gpu and (B2 or D64 or quantize)'"
GEMV="tests/test_gemm.py -k 'diag_decode and mmvk'"
MEMCHECK=${MEMCHECK:-"tests/test_call_path.py -k bad; tests/test_model_gpu.py; tests/test_sparse.py -k 'not 16k'; tests/test_fuzz.py; $ATTN; $GEMV"}
SMALL=${SMALL:-"tests/test_call_path.py -k one-split; tests/test_sparse.py -k 'gpu_blocks and float16 and not causal'; $ATTN; $GEMV"}
TOOLS=${TOOLS:-"memcheck racecheck synccheck"}

# Fill the kernel cache first: NVRTC is not what is being checked, and compiling under the sanitizer is slow.
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_call_path.py -k "one-split and seq_len_0" \
  > "$OUT/warm.log" 2>&1 || true

run_tool() {  # tool, selections: every selection under the tool, then one summary line
  local tool=$1 t0=$SECONDS rc=0 n=0 sel summary=""
  rm -f "$OUT/$tool".*
  IFS=';' read -ra sels <<< "$2"
  for sel in "${sels[@]}"; do
    n=$((n + 1))
    eval "set -- $sel"
    "$CS" --tool "$tool" --target-processes all --error-exitcode 86 --print-limit 50 \
          --log-file "$OUT/$tool.$n.%p.log" \
          python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$OUT/$tool.$n.pytest.log" 2>&1 || rc=1
    summary="$summary | $sel: $(tail -n 1 "$OUT/$tool.$n.pytest.log")"
  done
  # (memcheck and synccheck end with "ERROR SUMMARY: n errors", racecheck with "RACECHECK SUMMARY: ... (n errors")
  local errors; errors=$(cat "$OUT/$tool".*.log 2>/dev/null |
                         sed -n -e 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' -e 's/.*RACECHECK SUMMARY: .*(\([0-9]*\) error.*/\1/p' |
                         awk '{s += $1} END {print s + 0}')
  echo "$tool: $errors errors, $([ $rc = 0 ] && echo "all runs passed" || echo "a run FAILED") in" \
       "$((SECONDS - t0)) s; logs $OUT/$tool.*$summary"
  [ "$errors" = 0 ] && [ "$rc" = 0 ]
}

status=0
for tool in $TOOLS; do
  sels=$SMALL; [ "$tool" = memcheck ] && sels=$MEMCHECK
  run_tool "$tool" "$sels" || status=1
done
exit $status
