#!/usr/bin/env bash
# Stage everything the H200 machine needs for benchmarks/bench_qsa.py's peer columns, in
# git-ignored folders of the checkout that the device call sends (DEST, default /work/main).
#
#   bash benchmarks/device/stage_wheels.sh [DEST]
#
# Env: TOPK_SO (FlashInfer's prebuilt top-k module for sm_90a; default /tmp/bench-topk/topk.so,
# which `benchmarks/device/build_topk.sh` builds in ~28 minutes), SGLANG_SITE (a site-packages that holds sglang 0.5.23;
# default this worktree's .venv-sglang), STAGE_TREE=1 also copies this worktree's files to
# DEST/.stage-bench (needed while the branch is not on main), WHEEL_CACHE (download folder).
#
# Device python is CPython 3.12 (torch 2.11+cu130, triton 3.6, numpy, tqdm, psutil, pynvml there).
# Three folders, each one device call under 64 MiB with the ~1 MiB tracked tree (DEST/.whl* and
# DEST/.stage* are git-ignored there):
#   .whl-bench1  flashinfer-python 0.7.2.post1 (59 MiB; one wheel, one call)
#   .whl-bench2  tilelang 0.1.15 + apache-tvm-ffi 0.1.12 (one version for FlashInfer and TileLang),
#                torch-c-dlpack-ext, cloudpickle, ml-dtypes, pydantic (+ core, annotated-types,
#                typing-inspection, typing-extensions 4.16: pydantic 2.14 needs >= 4.16)
#   .whl-bench3  z3-solver 4.15.4 (tilelang: <4.15.5), nvidia-cudnn-frontend, cuda-tile, nccl4py
#                (FlashInfer's import-time set as seen on the device; nccl-extensions is left out:
#                `import flashinfer` works without it), plus peer/topk.so and peer/sglang-src/
#                (the three SGLang files the benchmark loads, not the package)
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DEST=$(cd "${1:-/work/main}" && pwd)
CACHE=${WHEEL_CACHE:-/tmp/qsa-bench-wheels}
TOPK_SO=${TOPK_SO:-/tmp/bench-topk/topk.so}
SGLANG_SITE=${SGLANG_SITE:-$(ls -d "$HERE"/.venv-sglang/lib/python3*/site-packages | head -1)}
mkdir -p "$CACHE"
for d in .whl-bench1 .stage-bench; do  # they must not travel with every call
  (cd "$DEST" && git check-ignore -q "$d/") || { echo "$DEST: git does not ignore $d/ (add /.whl*/ and /.stage*/ to .git/info/exclude)" >&2; exit 1; }
done
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$CACHE" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
SET1=(flashinfer-python==0.7.2.post1)
SET2=(tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 cloudpickle==3.1.3 ml-dtypes==0.7.0
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
SET3=(z3-solver==4.15.4.0 nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 nccl4py==0.6.0)
pip_dl "${SET1[@]}" "${SET2[@]}" "${SET3[@]}"

wheel_of() {  # pip name==version -> the downloaded file
  local n=${1%%==*} v=${1##*==}
  n=$(echo "$n" | tr '-' '_')
  ls "$CACHE"/${n}-${v}-*.whl 2>/dev/null | head -1 || true
}
fill() {  # folder, specs...
  local dir=$DEST/$1; shift
  rm -rf "$dir"; mkdir -p "$dir"
  for spec in "$@"; do
    local f; f=$(wheel_of "$spec")
    [ -n "$f" ] || { echo "missing wheel for $spec in $CACHE" >&2; exit 1; }
    cp "$f" "$dir/"
  done
}
fill .whl-bench1 "${SET1[@]}"
fill .whl-bench2 "${SET2[@]}"
fill .whl-bench3 "${SET3[@]}"

# FlashInfer's top-k module, prebuilt (compiling it on first use takes ~13 min on the device).
mkdir -p "$DEST/.whl-bench3/peer"
if [ -f "$TOPK_SO" ]; then
  # ALLOW_NO_CUB=1 accepts a module linked without cub_topk.cu (all its references are lazily
  # bound calls): SGLang asks for deterministic=True, which FlashInfer never serves with CUB.
  skip='^$'; [ "${ALLOW_NO_CUB:-0}" = 1 ] && skip='cub_topk'
  if nm -D --undefined-only "$TOPK_SO" | grep "topk" | grep -vq "$skip"; then
    echo "$TOPK_SO has undefined top-k symbols (a source file failed to compile):" >&2
    nm -D --undefined-only "$TOPK_SO" | grep topk >&2; exit 1
  fi
  cp "$TOPK_SO" "$DEST/.whl-bench3/peer/topk.so"
elif [ "${ALLOW_NO_TOPK:-0}" = 1 ]; then  # staged later; without it the SGLang columns say why
  echo "WARNING: no $TOPK_SO yet: staged without it" >&2
else
  echo "no $TOPK_SO: build it first (benchmarks/device/build_topk.sh), or ALLOW_NO_TOPK=1" >&2; exit 1
fi

# SGLang 0.5.23's QSA files the benchmark loads by path (no SGLang import chain).
Q=sglang/srt/layers/attention/qsa
mkdir -p "$DEST/.whl-bench3/peer/sglang-src/$Q"
for f in mqa.py kernel.py sparse_attn.py; do cp "$SGLANG_SITE/$Q/$f" "$DEST/.whl-bench3/peer/sglang-src/$Q/"; done
grep -q '^Version: 0.5.23$' "$SGLANG_SITE"/sglang-0.5.23.dist-info/METADATA \
  || { echo "$SGLANG_SITE does not hold sglang 0.5.23" >&2; exit 1; }

if [ "${STAGE_TREE:-0}" = 1 ]; then  # this worktree's tracked + untracked-not-ignored files
  rm -rf "$DEST/.stage-bench"; mkdir -p "$DEST/.stage-bench"
  (cd "$HERE" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$DEST/.stage-bench")
fi

tree=$(cd "$DEST" && git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
for d in .whl-bench1 .whl-bench2 .whl-bench3 .stage-bench; do
  [ -d "$DEST/$d" ] || continue
  s=$(du -sb "$DEST/$d" | cut -f1)
  printf '%-13s %6.1f MiB (+ tree %.1f MiB)\n' "$d" "$(echo "$s/1048576" | bc -l)" "$(echo "$tree/1048576" | bc -l)"
done
