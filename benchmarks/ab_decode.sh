#!/usr/bin/env bash
# A/B of the decode rows (issue 43's targets): main's tree against this checkout (and any other trees
# named with --tree), in one GPU session. Each tree runs every configuration in one bench_qsa.py
# process; the trees alternate, main first, for two rounds (clock drift and the order of process
# starts hit every tree alike); every run is checked against the reference before it is timed
# (bench_qsa.py); then a table of the best and every run per column, each tree against main. Fails
# on the first run that fails or fails its check.
#
#   bash benchmarks/ab_decode.sh [--prefill-data random|recency] [--tree DIR]... MAIN_TREE OUT [KEY ...]
#
# MAIN_TREE: a checkout or export of main (its benchmarks/bench_qsa.py runs with its own packages);
# OUT: a folder for the runs' results.json (created); --tree DIR: another tree to time beside this
# checkout (an export of one of its commits, say); paths absolute or relative to the folder this is
# run from; KEYs: results.json keys (default: the five decode rows of issue 43's targets);
# --prefill-data: bench_qsa.py's (recency: scores whose top groups cluster, as served rows' do;
# default random).
set -euo pipefail
PY="${PYTHON:-python3}"
TREES=()
DATA=random
while [ "${1:-}" = --tree ] || [ "${1:-}" = --prefill-data ]; do
    if [ "$1" = --tree ]; then TREES+=("$(cd "$2" && pwd)"); else DATA="$2"; fi
    shift 2
done
[ $# -ge 2 ] || { echo "usage: ab_decode.sh [--prefill-data random|recency] [--tree DIR]... MAIN_TREE OUT [KEY ...]" >&2
                  exit 2; }
MAIN="$(cd "$1" && pwd)"
OUT="$(mkdir -p "$2" && cd "$2" && pwd)"
shift 2
cd "$(dirname "$0")/.."
TREES=("$PWD" "${TREES[@]}")
KEYS=("$@")
[ ${#KEYS[@]} -gt 0 ] || KEYS=(decode-8192-1-1-bf16 decode-131072-4-1-bf16 decode-131072-64-1-bf16
                               decode-1048576-4-1-bf16 decode-1048576-4-4-bf16)
for tree in "$MAIN" "${TREES[@]}"; do
    [ -f "$tree/benchmarks/bench_qsa.py" ] || { echo "ab_decode.sh: $tree has no benchmarks/bench_qsa.py" >&2; exit 2; }
done
unset TRITON_INTERPRET QSA_BACKEND

run() {  # run TREE NAME: every key on one tree, into OUT/NAME
    local tree="$1" dir="$OUT/$2"
    echo "== $2: $tree" >&2
    (cd "$tree" && PYTHONPATH="$tree:$tree/kernels:$tree/adapters" "$PY" benchmarks/bench_qsa.py \
        --only "${KEYS[@]}" --no-dense --no-plot --config-timeout 240 --prefill-data "$DATA" --out "$dir")
}

for round in 1 2; do
    run "$MAIN" "main-$round"
    for i in "${!TREES[@]}"; do
        run "${TREES[$i]}" "tree$i-$round"
    done
done

"$PY" - "$OUT" "${#TREES[@]}" "${TREES[@]}" "${KEYS[@]}" <<'PYEOF'
import json, sys
from pathlib import Path

out, n = Path(sys.argv[1]), int(sys.argv[2])
trees, keys = sys.argv[3:3 + n], sys.argv[3 + n:]
cols = ("whole step", "attention", "select+expand", "prepare")


def runs(name):
    found = {}
    for path in sorted(out.glob(f"{name}-*/results.json")):
        for r in json.loads(path.read_text())["results"]:
            c = r["case"]
            key = f"{c['kind']}-{c['context']}-{c['batch']}-{c['rows']}-{c['index_dtype']}"
            if not r.get("check", "").startswith("ok"):
                sys.exit(f"{path}: {key} failed its check: {r.get('check')}")
            for col in cols:
                found.setdefault((key, col), []).append(r["us"][col])
    return found


main = runs("main")
for i, tree in enumerate(trees):
    other = runs(f"tree{i}")
    print(f"\ntree{i}: {tree}\n")
    print("| config | column | main us: best (runs) | tree us: best (runs) | tree - main |")
    print("|---|---|---|---|---|")
    for key in keys:
        for col in cols:
            ra, rb = main.get((key, col)), other.get((key, col))
            if not ra or not rb:
                sys.exit(f"no {col} for {key} in {out} (main {ra}, tree{i} {rb})")
            ma, mb = min(ra), min(rb)
            print(f"| {key} | {col} | {ma:.1f} ({', '.join(f'{x:.1f}' for x in ra)}) | "
                  f"{mb:.1f} ({', '.join(f'{x:.1f}' for x in rb)}) | {mb - ma:+.1f} |")
PYEOF
