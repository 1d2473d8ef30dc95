#!/usr/bin/env bash
# Serve a Qwen4-Exp checkpoint with SGLang 0.5.23, its QSA layers on qsa_core.
#
#   bash examples/sglang/launch.sh /path/to/Qwen4-Exp-checkpoint [extra sglang args...]
#   DEVICE=cpu bash examples/sglang/launch.sh /path/to/checkpoint   # every layer QSA; no GPU
#
# Needs SGLang 0.5.23 and this repo installed in the same environment (pip install -e
# /path/to/repo; on the CPU: bash scripts/env_sglang.sh .venv-sglang): the
# `sglang.srt.plugins` entry point `qsa_core` then registers the backend in the launcher
# and in every scheduler process, and on the CPU sets what SGLang needs there itself.
# GPU: TP defaults to all visible GPUs. The log goes to stdout and ./sglang_qsa_core.log.
set -euo pipefail
MODEL="${1:?usage: launch.sh MODEL_PATH [extra sglang args...]}"
shift
PORT="${PORT:-30000}"
if [[ "${DEVICE:-cuda}" == cpu ]]; then
    ARGS=(--device cpu --dtype bfloat16 --host 127.0.0.1 --port "$PORT"
          --disable-radix-cache --skip-server-warmup --disable-cuda-graph
          --max-total-tokens 16384 --max-running-requests 4 --chunked-prefill-size 1024)
else
    ARGS=(--tp-size "${TP:-$(nvidia-smi -L | wc -l)}" --host 0.0.0.0 --port "$PORT")
fi
python -m sglang.launch_server --model-path "$MODEL" --attention-backend qsa_core \
    "${ARGS[@]}" "$@" 2>&1 | tee sglang_qsa_core.log
