#!/usr/bin/env bash
# Tensor parallelism on CUDA GPUs: the core's rank-sharded QSA layers (Triton kernels, bf16)
# against the unsharded ones with bitwise-equal selections on every rank (NCCL across two
# GPUs, and gloo with two ranks on one GPU), then the per-rank kernel times next to TP 1
# (`benchmarks/bench_qsa.py tp`). NVLink multicast stays off. Fails if a test is skipped, so on a
# machine with one GPU run it with QSA_TP_GPUS=1 (the NCCL test is then deselected).
#
#   PYTHON=python3.12 [QSA_TP_GPUS=1] bash scripts/test_gpu_tp.sh [BENCH_OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${1:-bench-results}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET QSA_BACKEND

select=()
[ "${QSA_TP_GPUS:-2}" = 1 ] && select=(-k "not nccl")
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_tp_gpu.py ${select[@]+"${select[@]}"} 2>&1 | tee "$log"
if grep -qE '[0-9]+ skipped' "$log"; then
    echo "scripts/test_gpu_tp.sh: FAILED: tests were skipped (fewer than 2 GPUs? set QSA_TP_GPUS=1)"
    exit 1
fi
"$PY" benchmarks/bench_qsa.py tp --out "$OUT"
echo "scripts/test_gpu_tp.sh: passed"
