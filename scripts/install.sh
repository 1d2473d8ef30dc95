#!/usr/bin/env bash
# Install QSA with its test extra into .venv, then run the standalone demo (python -m qsa_core).
#
#   bash scripts/install.sh
#
# torch comes first, chosen for the machine:
# - with an NVIDIA GPU (nvidia-smi lists one): the package index's default build, a CUDA
#   build that brings the triton it pins;
# - without one: the CPU build (about 200 MB instead of several GB), from the index in
#   QSA_TORCH_INDEX, by default the PyTorch CPU index. The CPU build brings no triton: the
#   kernels' interpreter (TRITON_INTERPRET=1) then uses the newest triton pyproject allows.
# When the default CPU index fails (unreachable), torch comes from pip's own configuration.
# QSA_TORCH_INDEX="" takes torch from pip's own configuration (a mirror, local wheels);
# QSA_TORCH is the torch requirement (default "torch>=2.10"). A .venv whose torch imports
# keeps it. Nothing else is pinned here: pyproject's ranges are torch's own.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_REQ=${QSA_TORCH:-torch>=2.10}

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    if nvidia-smi -L >/dev/null 2>&1; then
        index=${QSA_TORCH_INDEX-}
        echo "install.sh: NVIDIA GPU found: torch from ${index:-the package index} (CUDA build)"
    else
        index=${QSA_TORCH_INDEX-$CPU_INDEX}
        echo "install.sh: no NVIDIA GPU: torch from ${index:-the pip configuration} (CPU build)"
    fi
    if [ -n "$index" ]; then
        if ! pip install -q --retries 1 --timeout 30 --index-url "$index" "$TORCH_REQ"; then
            [ "$index" = "$CPU_INDEX" ] || exit 1  # an index the user named: its failure stands
            echo "install.sh: the PyTorch CPU index failed (unreachable?): torch from the pip configuration" \
                 "instead (from plain PyPI that is a CUDA build, several GB; QSA_TORCH_INDEX=URL names" \
                 "another index)" >&2
            pip install -q "$TORCH_REQ"
        fi
    else
        pip install -q "$TORCH_REQ"
    fi
fi
pip install -q -e '.[test]'
.venv/bin/python - <<'PY'
import importlib.metadata as md

def version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"

print("install.sh:", ", ".join(f"{p} {version(p)}" for p in ("torch", "triton", "transformers")))
PY
.venv/bin/python -m qsa_core
