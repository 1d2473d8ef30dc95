#!/usr/bin/env bash
# The GPU suite, the one command a CUDA user runs: the Triton kernels compiled on the GPU
# (tests/kernels: production shapes, CUDA graphs, the small-shape tests on CUDA tensors), then
# the HF-oracle and runner suites with the core on CUDA, each with both op backends (the
# reference ops on CUDA tensors and the Triton kernels). It fails if any test is skipped.
#
#   PYTHON=python3.12 bash scripts/test_gpu.sh [kernels] [oracle] [runner]   (default: all)
#
# Uses $PYTHON (default python3) as it is: no venv is created; torch with CUDA, triton,
# pydantic, transformers 5.19, pytest and pytest-xdist must import there. QSA_GPU_WORKERS
# sets the pytest-xdist workers of the kernels and oracle suites (default 4; 0 = no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORKERS="${QSA_GPU_WORKERS:-4}"
SUITES=("$@")
[ ${#SUITES[@]} -gt 0 ] || SUITES=(kernels oracle runner)

QSA_GPU_SUITES="${SUITES[*]}" "$PY" - <<'EOF'
import os, sys
import torch
if not torch.cuda.is_available():
    sys.exit("scripts/test_gpu.sh: no CUDA device is visible to this python")
import pydantic, transformers, triton, xdist  # noqa: F401  (fail here, not as a skip later)
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__},"
      f" {torch.cuda.get_device_name()}")
# The oracle is the pinned transformers (pyproject's test extra): 5.17's Qwen4-Exp rotary
# embedding takes 3-D position ids and fails inside HF on every oracle test.
if "oracle" in os.environ["QSA_GPU_SUITES"].split() and transformers.__version__.split(".")[:2] != ["5", "19"]:
    sys.exit(f"scripts/test_gpu.sh: the oracle suite needs transformers 5.19 (pyproject's test extra pins 5.19.0), "
             f"this python has {transformers.__version__}")
EOF

# The repo's packages come from the checkout (nothing is installed).
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/adapters${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET QSA_BACKEND
export QSA_TEST_DEVICE=cuda

LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
failed=0

# run NAME PYTEST-ARGS...: pytest with its skip reasons listed (-rs); a skip fails the suite.
run() {
    local name="$1"
    shift
    echo "=== $name: pytest $*"
    local rc=0
    "$PY" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$LOGS/$name.log" || rc=$?
    local summary
    summary="$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$LOGS/$name.log" | tail -1 || true)"
    if [ "$rc" -ne 0 ]; then
        echo "=== $name: FAILED (pytest exit $rc)"
        failed=1
    elif [ -z "$summary" ] || grep -qE '[0-9]+ (skipped|xfailed|xpassed)' <<<"$summary"; then
        echo "=== $name: FAILED: tests were skipped or no summary was found: ${summary:-none}"
        failed=1
    else
        echo "=== $name: ok: $summary"
    fi
}

xdist=()
[ "$WORKERS" -gt 0 ] && xdist=(-n "$WORKERS")

for suite in "${SUITES[@]}"; do
    case "$suite" in
        # Interpreter-only tests (marker `interpreter`) are deselected: they run in CI on the
        # CPU; so is the sm_90 compile of every planned variant (a CPU compile of about 7
        # core-minutes that holds one worker while the others finish; every kernel test here
        # compiles its own variants for this GPU). Every other kernel test runs here on CUDA
        # tensors, the gpu ones included (a skipif that holds here fails the suite like any skip).
        kernels) run kernels tests/kernels tests/test_negative_zero_ties.py -m "not interpreter" \
                     --deselect tests/kernels/test_compile_sm90.py::test_every_planned_variant_compiles_for_sm90 \
                     ${xdist[@]+"${xdist[@]}"} ;;
        oracle) run oracle tests/test_hf_oracle.py ${xdist[@]+"${xdist[@]}"} ;;
        runner) run runner tests/test_runner.py tests/test_runner_transactions.py tests/test_guard_watch.py tests/test_faults.py tests/test_layer_modes.py tests/test_step_validation.py ;;
        *) echo "unknown suite '$suite' (kernels, oracle, runner)"; exit 2 ;;
    esac
done

if [ "$failed" -ne 0 ]; then
    echo "scripts/test_gpu.sh: FAILED"
    exit 1
fi
echo "scripts/test_gpu.sh: all suites passed, nothing skipped"
