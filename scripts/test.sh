#!/usr/bin/env bash
# Run every suite: the core and the Triton kernels (through the interpreter when there is
# no GPU), then each engine adapter in the environment its engine needs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
if ! .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    export TRITON_INTERPRET=1
fi
.venv/bin/python -m pytest -q tests --ignore=tests/sglang --ignore=tests/vllm
