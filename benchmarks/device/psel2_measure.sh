#!/usr/bin/env bash
# Issue 12 (prefill selection at long context): main's select_prefill route ("plan") against the
# two-pass scores ("tp": samples only, a bound launch, then only the runs reaching each row's
# bound; "tp4": the same with runs of 16 columns), bit-exact first (radix route and reference,
# random and tied data), then timed by part; the score-launch profile; larger chunks; the layer.
#
#   bash benchmarks/device/psel2_measure.sh [select|sweep|chunks|layer|all ...]   (default: select)
#
# Logs and JSON go to $OUT_DIR (or $OUT, else /tmp/out)/psel2. Stages and rough wall times on one
# H200 (compiles included, parallel): select ~90 s (1M, 128K; 16K unchanged: two-pass needs tile
# skip, from 32768 columns), sweep ~40 s, chunks ~30 s, layer: bench_qsa's three 16K-row prefill
# cases twice (QSA_PREFILL_TWO_PASS=0 / 1), minutes (the reference checks at 1M).
# What to read: psel-1M.log / psel-128K.log lines "exact" (a DIFFERS is a bug: stop), their
# select / scores / cand / pass1 / bound / pass2 us; sweep.log (us per chunk, ms per 16K rows:
# main = scores + samples, nosamp, pass1 = samples only, pass2 = live runs only, tiles, chunk rows);
# chunks.log (64 vs 256-row chunks); layer-*/table.md (whole step, main vs QSA_PREFILL_TWO_PASS=1).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:/tmp/site PYTHONUNBUFFERED=1
unset QSA_PREFILL_TWO_PASS  # "plan" is main's route; the two-pass variants set their tiles themselves
OUT=${OUT_DIR:-${OUT:-/tmp/out}}/psel2
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/progress.log"; }
STAGES=("${@:-select}")
[ "${STAGES[0]}" = all ] && STAGES=(select sweep chunks layer)
SWEEP=main,nosamp,pass1,pass2,p1_s4,p1_w8,p1_g128,p1_r64,p1_sp2k
log "stages ${STAGES[*]}; $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1)"

# Compile every kernel the stages time, in parallel processes (Triton's cache), then time serially.
timeout 120 python3 benchmarks/bench_select_prefill.py --warm-only --contexts 1M,128K --variants plan,tp,tp4 \
  --workers 8 > "$OUT/warm_select.log" 2>&1 &
[[ " ${STAGES[*]} " == *" sweep "* ]] && timeout 120 python3 benchmarks/bench_psel.py --sweep "$SWEEP" \
  --contexts 1M --warm-only --workers 9 > "$OUT/warm_sweep.log" 2>&1 &
wait
log "compiled: $(tail -1 "$OUT/warm_select.log") | $(tail -1 "$OUT/warm_sweep.log" 2>/dev/null)"

for stage in "${STAGES[@]}"; do
  case $stage in
    select)
      for ctx in 1M 128K; do
        python3 benchmarks/bench_psel.py --contexts $ctx --variants plan,tp,tp4 --ties-rows 64 \
          --out "$OUT/psel-$ctx.json" > "$OUT/psel-$ctx.log" 2>&1
        log "select $ctx: $(grep -c exact "$OUT/psel-$ctx.log") exact, $(grep -c DIFFERS "$OUT/psel-$ctx.log") differ"
      done ;;
    sweep)
      python3 benchmarks/bench_psel.py --sweep "$SWEEP" --contexts 1M --sweep-rows 64,256,1024 \
        --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
      log "sweep done" ;;
    chunks)
      python3 benchmarks/bench_psel.py --contexts 1M --variants plan,tp --scratch-mib 256 \
        --out "$OUT/chunks.json" > "$OUT/chunks.log" 2>&1
      log "chunks done" ;;
    layer)
      for tp in 0 1; do
        QSA_PREFILL_TWO_PASS=$tp timeout 900 python3 benchmarks/bench_qsa.py --no-dense --no-plot \
          --out "$OUT/layer-tp$tp" --only prefill-16384-1-16384-bf16 prefill-131072-1-16384-bf16 \
          prefill-1048576-1-16384-bf16 > "$OUT/layer-tp$tp.log" 2>&1
        log "layer QSA_PREFILL_TWO_PASS=$tp rc $?"
      done ;;
    *) log "unknown stage $stage" ;;
  esac
done
log done
