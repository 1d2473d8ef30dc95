#!/usr/bin/env bash
# The decode top-k on the H200: session 23's leads (written without GPU time, never run yet).
# Run from any directory after installing .whl-gpu (pydantic):
#
#   OUT_DIR=$OUT bash benchmarks/device/topk_probe.sh [SECONDS]   # default 420
#
# 1. bench_dsamp on 1M B4, 1M B4 x 4 MTP rows and 128K B4: the default tiles against one
#    4096-column compaction step (blk4k at 8 warps, blk4k-w16) and 4096-column segments
#    (seg4k); `again` re-times the default (the shape's noise). Every variant's packed rows
#    must equal main's bit for bit before it is timed. At 1M every row's fullest segment
#    sweeps two 2048-column steps today (NOTES.md, the decode top-k).
# 2. Nsight Compute on one cold fp8 1M B4 step (`ncu_step.py`): the top-k kernel's warp
#    states, scheduler and per-instruction stall samples (SourceCounters), saved as a report
#    and printed as details and as the source page (SASS with the Triton lines) in CSV.
# Logs: $OUT_DIR/topk_*.
. "$(dirname "$0")/probe_env.sh" topk 420 "$@"
NCU=${NCU:-/usr/local/cuda/bin/ncu}

stamp "1. bench_dsamp: default tiles vs blk4k, blk4k-w16, seg4k" | tee "$OUT/topk_dsamp.txt"
timeout $(( $(left) * 2 / 3 )) python3 -u benchmarks/bench_dsamp.py --shapes 1m-b4,1m-b4x4,128k-b4 \
  --variants blk4k,blk4k-w16,seg4k,again 2>&1 | grep -v "^$" | tee -a "$OUT/topk_dsamp.txt"
stamp "bench_dsamp rc ${PIPESTATUS[0]}" | tee -a "$OUT/topk_dsamp.txt"

if [ "$(left)" -gt 60 ] && [ -x "$NCU" ]; then
  stamp "2. ncu: the top-k of one cold fp8 1M B4 step" | tee "$OUT/topk_ncu.txt"
  timeout $(( $(left) - 20 )) "$NCU" --profile-from-start off --clock-control none --cache-control none \
    --kernel-name regex:_topk_prefill_kernel --launch-count 1 --import-source yes \
    --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section SourceCounters -f -o "$OUT/topk" \
    python3 benchmarks/ncu_step.py --case 1m-b4-fp8 2>&1 | tail -20 | tee -a "$OUT/topk_ncu.txt"
  "$NCU" --import "$OUT/topk.ncu-rep" --page details >> "$OUT/topk_ncu.txt" 2>&1
  "$NCU" --import "$OUT/topk.ncu-rep" --page source --csv --print-source sass > "$OUT/topk_source.csv" 2>&1 \
    || stamp "the source page did not print (see the report)" | tee -a "$OUT/topk_ncu.txt"
else
  stamp "2. skipped: $(left) s left or no ncu at $NCU" | tee -a "$OUT/topk_ncu.txt"
fi
stamp "done"
grep -hE " bits | select us| variant |failed|DIFFERS" "$OUT/topk_dsamp.txt"
