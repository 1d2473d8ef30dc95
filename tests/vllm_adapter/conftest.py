"""Fixtures of the vLLM adapter suite (run in the vLLM venv: scripts/env_vllm.sh).

The suite must fail, not skip, where vllm is missing: vllm is imported here unguarded.
One checkpoint of each kind is written per session and reused by every engine test.
"""

import os
import sys

import pytest
import vllm  # noqa: F401  (an ImportError here fails the whole suite)

sys.path.insert(0, os.path.dirname(__file__))

from qwen4_checkpoint import tiny_config, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def full_checkpoint(tmp_path_factory):
    """(folder, fp32 HF model): every decoder layer QSA."""
    folder = tmp_path_factory.mktemp("qwen4_full")
    return str(folder), write_checkpoint(folder, tiny_config(), seed=0)


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory):
    """(folder, fp32 HF model): GDN, QSA, GDN, QSA."""
    folder = tmp_path_factory.mktemp("qwen4_hybrid")
    return str(folder), write_checkpoint(folder, tiny_config(hybrid=True), seed=1)
