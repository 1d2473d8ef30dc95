#!/usr/bin/env bash
# Run benchmarks/bench_qsa.py on the H200 machine after the chain's installs (bench_chain.md):
# /tmp/site holds FlashInfer (+ its prebuilt top-k module), TileLang and pydantic; /tmp/qsa-peer
# holds SGLang's three QSA files. Results go to /tmp/qsa-bench-MODE (kept while the machine is warm,
# so the same command in the next call resumes) and are copied to $OUT/bench.
#
#   bash benchmarks/device/run_bench.sh smoke|full [SECONDS] [more bench_qsa.py options]
#
# SECONDS bounds the benchmark process (default 540); configurations are not started after
# SECONDS - 90 (smoke: - 30; each takes well under that), so a full run that does not fit says which
# configurations are left, and rerunning this command finishes them.
set -uo pipefail
MODE=${1:?smoke or full}; LIMIT=${2:-540}; shift; [ $# -gt 0 ] && shift
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:/tmp/site PYTHONUNBUFFERED=1
RES=/tmp/qsa-bench-$MODE; mkdir -p "$RES" "${OUT:-/tmp/out}/bench"
case $MODE in
  smoke) ARGS=(--smoke --no-dense); MARGIN=30 ;;  # dense FlashInfer was seen working; its JIT costs ~13 s a kernel
  full) ARGS=(); MARGIN=90 ;;
  *) echo "mode must be smoke or full, got $MODE" >&2; exit 2 ;;
esac
PEER=(); [ -f /tmp/qsa-peer/sglang-src/sglang/srt/layers/attention/qsa/mqa.py ] && PEER=(--sglang-dir /tmp/qsa-peer/sglang-src)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
TOPK=/tmp/site/flashinfer/data/aot/topk/topk.so
if [ -f "$TOPK" ] && command -v nm >/dev/null; then
  echo "FlashInfer top-k module: $(nm -D --undefined-only "$TOPK" | grep -c cub_topk) undefined CUB symbols (0: complete;" \
    "else linked without cub_topk.cu, which SGLang's deterministic call never uses)"
elif [ -f "$TOPK" ]; then
  echo "FlashInfer top-k module: $TOPK (no nm here to inspect it)"
else
  echo "FlashInfer top-k module: not prebuilt (the SGLang columns will say why)"
fi
python3 -c "import tilelang, flashinfer; print('tilelang', tilelang.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tail -1
# A configuration that runs past CONFIG_TIMEOUT (a compile or kernel that hangs) ends the process
# with exit 3 after noting it; the loop resumes the rest within the same LIMIT.
CONFIG_TIMEOUT=${CONFIG_TIMEOUT:-$([ "$MODE" = full ] && echo 200 || echo 0)}
t0=$(date +%s); rc=1
while :; do
  left=$((LIMIT - ($(date +%s) - t0)))
  [ "$left" -gt "$MARGIN" ] || { echo "no time left for a resume"; break; }
  timeout -k 5 "$left" python3 benchmarks/bench_qsa.py "${ARGS[@]}" "${PEER[@]}" --out "$RES" --no-plot \
    --budget-s $((left - MARGIN)) --config-timeout "$CONFIG_TIMEOUT" "$@" 2>&1 | tee -a "$RES/log.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 3 ] || break
  echo "resuming after an aborted configuration"
done
cp "$RES"/results.json "$RES"/table.md "$RES"/log.txt "${OUT:-/tmp/out}/bench/" 2>/dev/null
echo "bench rc=$rc"
exit "$rc"
