# Sourced by this folder's probe scripts (`. probe_env.sh NAME DEFAULT_SECONDS [SECONDS]`): sets
# LIMIT (SECONDS, else DEFAULT_SECONDS), moves to the repository root (REPO), makes OUT
# ($OUT_DIR, else $OUT, else /tmp/out), exports PYTHONPATH (the repo's three packages, then
# the caller's path or /tmp/site), defines `left` (seconds left of LIMIT) and `stamp` (a line
# with the UTC time and the seconds since the start), and records the GPU's clocks in
# $OUT/NAME_gpu.txt.
set -uo pipefail
LIMIT=${3:-$2}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT_DIR:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/adapters:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - t0))); }
stamp() { echo "[$(date -u +%T) +$(($(date +%s) - t0))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/$1_gpu.txt"
