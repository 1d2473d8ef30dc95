"""The `vllm.general_plugins` entry point (runs in every vLLM process, so it is idempotent)."""

from __future__ import annotations

TINY_ARCH = "QSATinyForCausalLM"


def register() -> None:
    """Register the QSA_CORE attention backend and the `QSATinyForCausalLM` architecture."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .backend import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "qsa_adapters.vllm.backend.QSACoreBackend")
    if TINY_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TINY_ARCH, f"qsa_adapters.vllm.tiny_model:{TINY_ARCH}")
