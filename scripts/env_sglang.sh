#!/usr/bin/env bash
# Build (or reuse) the SGLang 0.5.23 test environment for the QSA library.
#
#   bash scripts/env_sglang.sh VENV_DIR
#
# Creates a Python 3.11 venv at VENV_DIR with torch 2.14.1 / torchvision 0.29.1
# (pip takes both from this machine's disk through its pip config; the NVIDIA
# wheels torch needs come from the package index), sglang==0.5.23 without its
# heavy dependencies, and just enough light packages for SGLang's attention /
# memory-pool / plugin modules to import on a CPU-only machine.
# Skips the install when VENV_DIR/bin/python already imports everything; tops up
# an existing Python 3.11 venv that misses something; otherwise builds it anew.
# Non-interactive; safe to run in CI (CI=true, 2 cores, registries only).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/env_sglang.sh VENV_DIR" >&2
    exit 2
fi

VENV_DIR="$1"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

export PIP_NO_INPUT=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_PROGRESS_BAR=off

case "$VENV_DIR" in
    "" | "/" | "$HOME" | "$REPO_ROOT")
        echo "env_sglang.sh: refusing VENV_DIR=$VENV_DIR" >&2
        exit 2
        ;;
esac

TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_PIN=sglang==0.5.23
LIGHT_DEPS=(
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
    pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 dill sentencepiece
    apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf loguru einops openai
    sniffio partial_json_parser
    pytest
)
# What `python -m sglang.launch_server` needs beyond the imports above (HTTP server,
# tokenizer manager, detokenizer, grammar backend) on a CPU machine.
SERVE_DEPS=(
    uvicorn fastapi uvloop python-multipart prometheus-client setproctitle interegular
    xxhash zstandard regex distro easydict "python-dateutil<3" watchfiles jsonschema
    xgrammar soundfile==0.13.1
)

# The modules the QSA tests and the SGLang adapter rely on.
CHECK_PY='
import importlib, sys
mods = [
    "sglang",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.layers.attention.base_attn_backend",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.qsa_kv_pool",
    "sglang.srt.layers.attention.qwen_sparse_attn_backend",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
]
for m in mods:
    importlib.import_module(m)
from sglang.srt.server_args import prepare_server_args  # noqa: F401
import sglang.launch_server, sglang.srt.entrypoints.http_server  # noqa: F401  (the server)
import uvicorn, fastapi, openai  # noqa: F401
import torch, torchvision, triton, sglang
print("ok: sglang", sglang.__version__, "torch", torch.__version__,
      "torchvision", torchvision.__version__, "triton", triton.__version__)
'

# One interpreter start: `import sglang` alone already costs several seconds.
venv_ok() {
    [[ -x "$VENV_DIR/bin/python" ]] || return 1
    "$VENV_DIR/bin/python" -c "$CHECK_PY" 2>/dev/null | grep '^ok: '
}

find_python311() {
    local c
    for c in python3.11 python3 python; do
        if command -v "$c" >/dev/null 2>&1 &&
           "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
            command -v "$c"
            return 0
        fi
    done
    echo "env_sglang.sh: no Python 3.11 interpreter found" >&2
    return 1
}

start=$(date +%s)

install_packages() {
    local pip=("$VENV_DIR/bin/python" -m pip)
    # torch + torchvision first (local wheels; CUDA libs from the index), and
    # triton at whatever version torch 2.14.1 pins (pulled in as its dependency).
    "${pip[@]}" install "${TORCH_PINS[@]}"
    # Light dependencies; keep torch pinned so nothing re-resolves it.
    "${pip[@]}" install "${TORCH_PINS[@]}" "${LIGHT_DEPS[@]}" "${SERVE_DEPS[@]}"
    # SGLang itself without its dependency tree (which pulls GPU kernels).
    "${pip[@]}" install --no-deps "$SGLANG_PIN"
}

if venv_ok; then
    echo "env_sglang.sh: reusing $VENV_DIR (sglang and the checked modules import)"
    reused=1
else
    reused=0
    if [[ -x "$VENV_DIR/bin/python" ]] &&
       "$VENV_DIR/bin/python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
        # A usable venv that misses something (e.g. a package added to this
        # script later): top it up instead of rebuilding the 6 GB from scratch.
        echo "env_sglang.sh: updating $VENV_DIR"
    else
        PY311="$(find_python311)"
        echo "env_sglang.sh: creating $VENV_DIR with $PY311"
        rm -rf "$VENV_DIR"
        "$PY311" -m venv "$VENV_DIR"
        "$VENV_DIR/bin/python" -m pip install --upgrade pip setuptools wheel
    fi
    install_packages
fi

# The repository itself, editable, without touching the pinned environment.
if [[ -f "$REPO_ROOT/pyproject.toml" ]]; then
    "$VENV_DIR/bin/python" -m pip install --no-deps -e "$REPO_ROOT"
fi

if [[ "$reused" == 0 ]]; then
    "$VENV_DIR/bin/python" -c "$CHECK_PY"
fi
echo "env_sglang.sh: done in $(( $(date +%s) - start )) s"
