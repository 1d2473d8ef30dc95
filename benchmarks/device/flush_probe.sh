#!/usr/bin/env bash
# How much of a cold figure is the L2 flush's own write-back (session 23's question; written
# without GPU time, never run yet). Run from any directory after installing .whl-gpu (pydantic):
#
#   OUT_DIR=$OUT bash benchmarks/device/flush_probe.sh [SECONDS]   # default 300
#
# bench_qsa's GraphTimer flushes L2 before each replay by zeroing 256 MB (do_bench's way), so
# the timed work finds L2 full of dirty lines, and its misses write them back to DRAM first.
# A served decode step finds L2 holding mostly clean lines (the previous layers' weight reads).
# Session 19 found every plain read here cost ~11 us + N / 4.07 TB/s. If the fixed part is the
# write-back of up to 60 MB of dirty lines (<= ~15 us at the HBM rate), a read flush removes it.
# 1. bench_stream: random 4 KB chunks, 16-256 MiB, after each flush (write, read).
# 2. bench_step: the decode cases' whole step (default routes), both flushes interleaved.
# Logs: $OUT_DIR/flush_*.txt. Then: bench_qsa.py --flush read for a whole table, beside the
# write-flush table of record, if the difference matters.
. "$(dirname "$0")/probe_env.sh" flush 300 "$@"

stamp "1. bench_stream: reads after a write flush and after a read flush" | tee "$OUT/flush_stream.txt"
timeout $(( $(left) / 4 )) python3 -u benchmarks/bench_stream.py --mb 16,64,128,256 --chunks 4096 \
  --flush write,read 2>&1 | tee -a "$OUT/flush_stream.txt"

stamp "2. bench_step: decode whole steps, write vs read flush" | tee "$OUT/flush_step.txt"
timeout $(( $(left) - 10 )) python3 -u benchmarks/bench_step.py \
  --cases 8k-b1,128k-b4,128k-b4-fp8,1m-b4-fp8,1m-b4,1m-b4x4,128k-b64 --variants auto --flush write,read \
  --rounds 3 2>&1 | tee -a "$OUT/flush_step.txt"
stamp "done"
grep -E "random" "$OUT/flush_stream.txt"
sed -n '/^case /,$p' "$OUT/flush_step.txt"
