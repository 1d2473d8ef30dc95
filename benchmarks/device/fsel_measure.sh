#!/usr/bin/env bash
# Measure the short decode top-k's bracket search (QSA_SHORT_BRACKET, select_topk._kth_bound)
# against main's route on the H200 (issue 12; written without GPU time, never run). Run from any
# directory of the checkout:
#
#   OUT_DIR=/tmp/out bash benchmarks/device/fsel_measure.sh [SECONDS]
#
# 1. bench_fsel.py: per shape main's short route, then the bracket search's variants; every
#    variant must equal main bit for bit (the step's scores twice, crowds of ties, a ReLU-zero
#    threshold, mixed rows) before it is timed (select = score + top-k; topk = the top-k alone).
# 2. The whole decode step at 8K B1 (bench_qsa.py, the table's method) with the switch off / on.
# 3. The short route's tests compiled on the GPU with the switch on (exactness on sm_90).
# Logs: $OUT_DIR/fsel_*.txt. Decide: land QSA_SHORT_BRACKET=1 as the default only where "tiles"
# beats main at 8K B1 / B4 / B64 and 16K B4 and the mixed rows do not regress; the forced-short
# variants (f4k: chunks of 128-256 rows, s8k: 32K B4) say whether select.py's routes should move.
set -uo pipefail
LIMIT=${1:-540}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT_DIR:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
stamp() { echo "[$(date -u +%T) +$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/fsel_gpu.txt"

stamp "1. bench_fsel (short shapes first)" | tee "$OUT/fsel_bench.txt"
timeout $(( $(left) * 2 / 3 )) python3 -u benchmarks/bench_fsel.py \
  --shapes 8k-b1,8k-b4,8k-b64,16k-b4,8k-b128,8k-b256,16k-b256,32k-b4 \
  --variants tiles,b2,b3,b4,early,w8,f4k,s8k 2>&1 | tee -a "$OUT/fsel_bench.txt"
stamp "bench_fsel rc ${PIPESTATUS[0]}" | tee -a "$OUT/fsel_bench.txt"

for flag in 0 1; do
  [ "$(left)" -gt 60 ] || { stamp "no time left for the whole step (switch $flag)"; break; }
  stamp "2. whole step 8K B1, QSA_SHORT_BRACKET=$flag" | tee -a "$OUT/fsel_step.txt"
  QSA_SHORT_BRACKET=$flag timeout $(( $(left) / 2 )) python3 -u benchmarks/bench_qsa.py \
    --only decode-8192-1-1-bf16 --no-dense --no-plot --out "$OUT/fsel_step_$flag" 2>&1 | tail -30 \
    | tee -a "$OUT/fsel_step.txt"
done

if [ "$(left)" -gt 60 ]; then
  stamp "3. short-route tests on the GPU, QSA_SHORT_BRACKET=1" | tee "$OUT/fsel_tests.txt"
  QSA_SHORT_BRACKET=1 timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:xdist -p no:cacheprovider \
    tests/kernels/test_kernel_select_topk.py 2>&1 | tail -15 | tee -a "$OUT/fsel_tests.txt"
fi
stamp "done"
