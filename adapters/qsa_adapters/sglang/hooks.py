"""The two places SGLang is hooked, both pass-through unless `qsa_core` is the active backend.

- AROUND `attention_registry.attn_backend_wrapper` (applied when the plugin loads): for
  Qwen4-Exp, SGLang swaps whatever `--attention-backend` built for a fresh
  `QwenSparseAttnBackend`; when the built backend is ours, the hybrid wrapper is rebuilt
  around it. Any other backend gets SGLang's result unchanged.
- AROUND `Qwen4ExpAttentionDecoderLayer.self_attention` (applied only when a
  `QSACoreBackend` is built, so processes that do not choose `qsa_core` are not patched):
  runs `layer.run_qsa_layer` when the forward context's backend is ours, else the original.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

from .backend import QSACoreBackend
from .layer import run_qsa_layer

logger = logging.getLogger(__name__)

WRAPPER_TARGET = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
LAYER_CLASS = "sglang.srt.models.qwen4_exp.Qwen4ExpAttentionDecoderLayer"
LAYER_TARGET = LAYER_CLASS + ".self_attention"


def find_core_backend(backend: Any) -> QSACoreBackend | None:
    """`backend` if it is ours, or its full-attention child (hybrid wrappers); else None."""
    for _ in range(3):
        if isinstance(backend, QSACoreBackend):
            return backend
        backend = getattr(backend, "full_attn_backend", None)
        if backend is None:
            return None
    return None


def backend_wrapper_around(original: Callable, runner: Any, full_attn_backend: Any) -> Any:
    """Keep `full_attn_backend` when it is a `QSACoreBackend` that SGLang's wrapper replaced."""
    result = original(runner, full_attn_backend)
    if not isinstance(full_attn_backend, QSACoreBackend) or result is full_attn_backend:
        return result
    child = getattr(result, "full_attn_backend", None)
    if child is full_attn_backend:
        return result
    if child is None or not hasattr(result, "linear_attn_backend"):
        raise RuntimeError(
            f"qsa_core cannot take the full-attention layers of {type(result).__name__}: "
            "expected a hybrid backend with full_attn_backend / linear_attn_backend"
        )
    logger.info(
        "qsa_core: %s's full-attention layers use qsa_core instead of %s",
        type(result).__name__, type(child).__name__,
    )
    return type(result)(full_attn_backend, result.linear_attn_backend, result.full_attn_layers)


def self_attention_around(original: Callable, layer: Any, positions: Any, hidden_states: Any, forward_batch: Any) -> Any:
    """Qwen4ExpAttentionDecoderLayer.self_attention on qsa_core when our backend is active."""
    backend = find_core_backend(get_attn_backend()) if has_forward_context() else None
    if backend is None or not getattr(layer, "is_qsa", False):
        return original(layer, positions, hidden_states, forward_batch)
    return run_qsa_layer(layer, hidden_states, forward_batch)


_layer_hook_installed = False


def install_layer_hook() -> None:
    """Apply the self_attention hook once per process; raise if SGLang did not apply it."""
    global _layer_hook_installed
    if _layer_hook_installed:
        return
    from pkgutil import resolve_name

    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    cls = resolve_name(LAYER_CLASS)
    before = cls.__dict__["self_attention"]
    source = HookSource(plugin_name="qsa_core", dist_name="qsa")  # built outside load_plugins
    HookRegistry.register(LAYER_TARGET, self_attention_around, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()
    if cls.__dict__["self_attention"] is before:
        raise RuntimeError(f"qsa_core could not hook {LAYER_TARGET} (see the HookRegistry log)")
    _layer_hook_installed = True
    logger.info("qsa_core: Qwen4-Exp QSA layers are served by qsa_core")
