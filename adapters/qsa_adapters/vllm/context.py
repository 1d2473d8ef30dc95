"""vLLM forward-context plumbing: register a cache-owning layer, read this step's metadata."""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available


def register_layer(vllm_config: VllmConfig, name: str, layer: nn.Module) -> None:
    """Put `layer` into `static_forward_context[name]`: vLLM then asks it for a KV-cache
    spec and a backend, allocates its cache, binds it and hands it per-step metadata."""
    context = vllm_config.compilation_config.static_forward_context
    if name in context:
        raise ValueError(f"duplicate layer name {name!r} in static_forward_context: prefixes must be unique")
    context[name] = layer


def step_metadata(*names: str) -> tuple[Any, ...] | None:
    """This step's metadata of the named layers, or None (profiling and dummy runs).

    A list (vLLM's per-micro-batch metadata) is refused: which entry belongs to the running
    micro-batch is not in it, and the core plans one step at a time (micro-batching is refused
    at start-up, `config_hooks.microbatching_refusal`)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        raise RuntimeError(
            f"QSA_CORE: vLLM handed the layers a list of {len(metadata)} micro-batches' metadata; micro-batching "
            "(--enable-dbo, --ubatch-size > 1) is not served"
        )
    if not isinstance(metadata, dict) or not all(name in metadata for name in names):
        return None
    return tuple(metadata[name] for name in names)
