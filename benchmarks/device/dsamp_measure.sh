#!/usr/bin/env bash
# Measure the per-row-samples decode selection (QSA_DECODE_SAMPLES, issue 12 item 1) against
# main's routes on the H200 (session 12's results/session12/dsamp_variants.txt came from it).
# Run from any directory:
#
#   OUT_DIR=/tmp/out bash benchmarks/device/dsamp_measure.sh [SECONDS]   # default 240
#
# 1. bench_dsamp.py over 128K B4, 1M B4, 1M B4 x 4 MTP rows, 128K B64 and three mixed batches
#    (1M + 3 x 256K, 1M + 3 x 64K, 128K + 3 x 16K: short rows in a long plan). Per shape both
#    routes run in one process (the switch is read when each planner is made); the new route's
#    packed rows must equal main's bit for bit (random data, then integer data: ties, ReLU
#    zeros) before either is timed. select = qsa_select (score + top-k, packed rows), us,
#    CUDA-graph replay median, L2 flushed before each replay.
# 2. With the time left: tile variants of the new route (tile skip, segment width, warps) on the few-row
#    shapes, each checked against main first.
# Logs: $OUT_DIR/dsamp_*.txt; the summary table is the last lines of stage 1.
. "$(dirname "$0")/probe_env.sh" dsamp 240 "$@"

stamp "1. bench_dsamp: bits, then select main vs dsamp" | tee "$OUT/dsamp_bench.txt"
timeout $(( $(left) * 3 / 4 )) python3 -u benchmarks/bench_dsamp.py 2>&1 | tee -a "$OUT/dsamp_bench.txt"
stamp "bench_dsamp rc ${PIPESTATUS[0]}" | tee -a "$OUT/dsamp_bench.txt"

if [ "$(left)" -gt 40 ]; then
  stamp "2. variants of the new route" | tee "$OUT/dsamp_variants.txt"
  timeout $(( $(left) - 5 )) python3 -u benchmarks/bench_dsamp.py --shapes 1m-b4,128k-b4,1m-b4x4 \
    --variants skip,seg4k,skip4k,w16 2>&1 | grep -v "^$" | tee -a "$OUT/dsamp_variants.txt"
fi
stamp "done"
echo "=== summary: per shape (bits, then select us) ==="
grep -hE " bits | select us| variant |failed" "$OUT/dsamp_bench.txt" "$OUT/dsamp_variants.txt" 2>/dev/null
sed -n '/^shape /,$p' "$OUT/dsamp_bench.txt"
