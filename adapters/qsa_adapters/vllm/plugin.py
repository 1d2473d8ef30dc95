"""The `vllm.general_plugins` entry point (runs in every vLLM process, so it is idempotent).

It imports nothing of the model: the backend and the model classes are registered by name
and load when vLLM first asks for them.
"""

from __future__ import annotations

MODEL_MODULE = "qsa_adapters.vllm.qwen4_exp"
ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP")


def register() -> None:
    """Register the QSA_CORE attention backend, the core-backed Qwen4-Exp architectures and
    their config checks (`config_hooks`).

    The architectures replace upstream's under the same names; they are upstream's models
    unless QSA_CORE is chosen or the platform is the CPU (`qwen4_exp.uses_qsa_core`).
    """
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import config_hooks
    from .backend import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "qsa_adapters.vllm.backend.QSACoreBackend")
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{arch}")
    config_hooks.install()
