#!/usr/bin/env bash
# Measure the one-launch short decode selection (QSA_SHORT_FUSED, select_short.py) against
# main's two launches on the H200 (issue 12; written without GPU time). Run from any directory
# of the checkout (python3 with torch and triton 3.6; <= 240 s wall with compiles):
#
#   OUT_DIR=/tmp/out bash benchmarks/device/dshort_measure.sh [SECONDS]
#
# 1. bench_dshort.py: bits first (fused == main bit for bit on the packed rows, twice, counters
#    left at zero; the score scratch bit for bit; also the groups and the reference on the
#    tie-heavy and mixed batches; fp8 keys), then select alone timed (CUDA-graph replays, L2
#    flushed): main, fused (its tiles), fused-span (main's score span at every batch) at 8K B1 /
#    B4 / B64, 16K B4 and a mixed batch. MTP chunks never take the route (main's score order
#    may differ).
# 2. The whole decode step at 8K B1 (bench_qsa.py) with QSA_SHORT_FUSED=0, 1, then 0 and 1
#    again if time is left (the spread between repeats).
# Logs: $OUT_DIR/dshort_*.txt; a summary at the end. Decide: QSA_SHORT_FUSED=1 becomes the
# default only if every bits column reads "exact" and the fused column beats main at 8K B1 (and
# does not lose at B4 / B64 / 16K B4 / mixed, else the route is limited to the chunks that win);
# the whole 8K B1 step must drop by about the select gain.
set -uo pipefail
LIMIT=${1:-240}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT_DIR:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
stamp() { echo "[$(date -u +%T) +$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/dshort_gpu.txt"

stamp "1. bench_dshort: bits, then select alone" | tee "$OUT/dshort_bench.txt"
timeout $(( $(left) - 110 )) python3 -u benchmarks/bench_dshort.py \
  --shapes 8k-b1,mixed,ties-8k-b4,8k-b4,8k-b64,16k-b4,fp8-8k-b4 2>&1 \
  | tee -a "$OUT/dshort_bench.txt"
stamp "bench_dshort rc ${PIPESTATUS[0]}" | tee -a "$OUT/dshort_bench.txt"

: > "$OUT/dshort_step.txt"
for rep in 1 2; do
  for flag in 0 1; do
    [ "$(left)" -gt 30 ] || { stamp "no time left: whole step fused=$flag (repeat $rep)" | tee -a "$OUT/dshort_step.txt"; continue; }
    stamp "2. whole step 8K B1, QSA_SHORT_FUSED=$flag (repeat $rep)" | tee -a "$OUT/dshort_step.txt"
    QSA_SHORT_FUSED=$flag timeout $(( $(left) - 5 )) python3 -u benchmarks/bench_qsa.py \
      --only decode-8192-1-1-bf16 --no-dense --no-plot --out "$OUT/dshort_step_${flag}_$rep" 2>&1 | tail -12 \
      | sed "s/^/fused=$flag repeat=$rep | /" | tee -a "$OUT/dshort_step.txt"
  done
done

echo
echo "== summary (logs in $OUT) =="
sed -n '/^select (score/,$p' "$OUT/dshort_bench.txt"
grep -h "DIFFERS\|failed" "$OUT/dshort_bench.txt" | head -5
echo "whole step 8K B1 (bench_qsa us per column):"
grep -h "us:" "$OUT/dshort_step.txt" || echo "  (no whole-step figures)"
stamp "done"
