#!/usr/bin/env bash
# Measure the decode attention's one-launch merge (QSA_ONE_LAUNCH_MERGE=1) against the default
# two-launch route (split programs + _combine_kernel) on the H200, bit-equality first:
#   1. sm_90 compile of every attention variant (registers / spill stack per variant);
#   2. the decode attention tests compiled on the GPU (the one-launch output torch.equal to the
#      two-launch one, counters left zero, CUDA-graph replay bits);
#   3. benchmarks/bench_datt.py: per decode shape (8K B1, 128K B4, 128K B64, 1M B4 x 4 rows)
#      bits then attention time (both routes alternately, twice), the whole step (prepare +
#      select + attention, planner with the switch off / on), then one-launch variants
#      (split caps 16 / 8, 4 programs per SM, merge unroll 1 / 4, 4 warps).
#
#   bash benchmarks/device/datt_measure.sh [BENCH_SECONDS]      # default 70: no stage starts after it
#
# Logs go to $OUT/datt (or $OUT_DIR/datt, else /tmp/out/datt). Wall time: about 20 s (1) + 30 s
# (2) + BENCH_SECONDS + the last stage's time; steps 1-2 are skipped with SKIP_TESTS=1.
set -uo pipefail
BUDGET=${1:-70}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
RES=${OUT:-${OUT_DIR:-/tmp/out}}/datt; mkdir -p "$RES"
stamp() { echo "[$(date -u +%T)] $*" | tee -a "$RES/steps.log"; }
stamp "start; $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 120 python3 tests/kernels/test_kernel_attention_compile.py > "$RES/compile.txt" 2>&1
  stamp "sm_90 compile rc $? ($(grep -c '^compiled' "$RES/compile.txt") variants)"
  timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/kernels/test_kernel_attention_decode.py \
    > "$RES/pytest_decode.txt" 2>&1
  stamp "decode tests on the GPU rc $?: $(tail -1 "$RES/pytest_decode.txt")"
fi
python3 benchmarks/bench_datt.py --whole --splits 16,8 --waves 4 --unroll 1,4 --warps 4 --budget-s "$BUDGET" \
  --out "$RES/bench_datt.txt" > "$RES/bench_datt.log" 2>&1
stamp "bench_datt rc $?"
cat "$RES/bench_datt.txt"
