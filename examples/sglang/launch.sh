#!/usr/bin/env bash
# Serve a Qwen4-Exp checkpoint with SGLang 0.5.23, its QSA layers on qsa_core.
#
#   bash examples/sglang/launch.sh /path/to/Qwen4-Exp-checkpoint [extra sglang args...]
#
# Needs SGLang 0.5.23 with its CUDA dependencies and this repo installed in the same
# environment (pip install -e /path/to/repo): the `sglang.srt.plugins` entry point
# `qsa_core` then registers the backend in the launcher and in every scheduler process.
# TP defaults to all visible GPUs; the server log goes to stdout and to ./sglang_qsa_core.log.
set -euo pipefail
MODEL="${1:?usage: launch.sh MODEL_PATH [extra sglang args...]}"
shift
TP="${TP:-$(nvidia-smi -L | wc -l)}"
python -m sglang.launch_server \
    --model-path "$MODEL" \
    --attention-backend qsa_core \
    --tp-size "$TP" \
    --host 0.0.0.0 --port "${PORT:-30000}" \
    "$@" 2>&1 | tee sglang_qsa_core.log
