"""Test-environment shim: lets vLLM's Qwen4-Exp import chain load without torchvision.

vLLM's `qwen3_vl` (imported by its Qwen4-Exp model) imports `smart_resize` from transformers'
`image_processing_qwen2_vl`, a module that imports torchvision at its top. The PyPI
torchvision wheels are CUDA builds that fail to load beside torch 2.13.0+cpu, and the CPU
builds are not on PyPI. When torchvision is absent, this maps that one module name onto
transformers' PIL twin (`image_processing_pil_qwen2_vl`, same `smart_resize`); nothing else
changes. `scripts/env_vllm.sh` installs it into the vLLM venv with a `.pth` line, so every
Python process of that venv (vLLM's spawned engine processes too) has it.
A machine with a torchvision that loads (e.g. the CPU build from PyTorch's own index) does
not need it: the shim then does nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
STAND_IN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(STAND_IN)

    def exec_module(self, module):
        sys.modules[TARGET] = module


def install() -> None:
    if importlib.util.find_spec("torchvision") is None and not any(isinstance(f, _StandIn) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIn())


install()
