#!/usr/bin/env bash
# Measure the prefill candidate launch's row bound (tile bound of select_prefill.prefill_tiles,
# issue 12) against main's on the H200 (written without GPU time, never run). From any directory:
#
#   OUT_DIR=/tmp/out bash benchmarks/device/pbound_measure.sh [SECONDS]   # default 200
#
# Variants (bench_select_prefill.py VARIANTS): plan = main's (every segment program searches its
# row's samples, _kth_key, 8 reductions); b1 = one bound launch per chunk (a program per row)
# writes the bound, the segment programs read it; b3 = that launch by the bracket search;
# b2 = each segment program's own bracket search (no extra launch). 1M rows have 8 segments (b1 /
# b3 save 7 of 8 searches), 128K rows one (only the bracket can help there).
# 1. bench_select_prefill.py at 1M and 128K, 16384 rows: compiles every route first (parallel
#    processes), then per context the radix route (the reference), and each variant: its packed
#    rows must equal the radix route's bit for bit (two calls) and the reference top-k of its own
#    scores (last chunk), else it is not timed ("DIFFERS"); then select / scores / top-k us
#    (CUDA-graph replay medians, L2 flushed), cand = largest / mean candidates of a row, ovf =
#    rows to the whole-row resolve.
# 2. With >= 45 s left: the same at 16K context.
# Logs: $OUT_DIR/pbound_*.txt (+ .json); the summary ("best ...") is printed last.
. "$(dirname "$0")/probe_env.sh" pbound 200 "$@"
VARIANTS=plan,b1,b3,b2

stamp "1. select of 16384 prefill rows at 1M and 128K: radix, $VARIANTS" | tee "$OUT/pbound_long.txt"
T1=$(( $(left) - 50 )); [ "$T1" -gt 170 ] && T1=170
timeout -k 5 "$T1" python3 -u benchmarks/bench_select_prefill.py --contexts 1M,128K --rows 16384 \
  --variants "$VARIANTS" --workers 10 --out "$OUT/pbound_long.json" 2>&1 | tee -a "$OUT/pbound_long.txt"
stamp "rc ${PIPESTATUS[0]} (124: timed out)" | tee -a "$OUT/pbound_long.txt"

if [ "$(left)" -ge 45 ]; then
  stamp "2. the same at 16K" | tee "$OUT/pbound_16k.txt"
  timeout -k 5 $(( $(left) - 8 )) python3 -u benchmarks/bench_select_prefill.py --contexts 16K --rows 16384 \
    --variants "$VARIANTS" --workers 5 --out "$OUT/pbound_16k.json" 2>&1 | tee -a "$OUT/pbound_16k.txt"
  stamp "rc ${PIPESTATUS[0]}" | tee -a "$OUT/pbound_16k.txt"
fi
stamp "done"
echo "=== summary (us; select = scores + top-k launches; plan = main) ==="
grep -hE "^(16K|128K|1M) |failed|compiled|^best" "$OUT/pbound_long.txt" "$OUT/pbound_16k.txt" 2>/dev/null
