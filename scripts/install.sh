#!/usr/bin/env bash
# Install QSA with its test extra into .venv, then run the standalone example.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
# Pin the CPU build of torch first: an open range would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0 triton==3.6.0
.venv/bin/pip install -q -e '.[test]'
.venv/bin/python examples/standalone.py
