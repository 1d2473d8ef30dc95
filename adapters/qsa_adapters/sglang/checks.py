"""What `--attention-backend qsa_core` refuses to serve, checked once when the backend is built."""

from __future__ import annotations

from typing import Any

from qsa_core import QSAConfig

from .caches import INDEX_DTYPES, KV_DTYPES
from .startup import overlap_refusal


def check_runner(runner: Any) -> None:
    """Refuse runner settings the adapter cannot serve correctly (the launcher refuses them
    first, `startup`; this covers runners built without it)."""
    overlap = overlap_refusal(getattr(runner, "server_args", None))
    if overlap is not None:
        raise ValueError(f"qsa_core: {overlap}")
    prefill = getattr(runner, "prefill_attention_backend_str", None)
    decode = getattr(runner, "decode_attention_backend_str", None)
    if prefill is not None and decode is not None and prefill != decode:
        raise ValueError(
            "qsa_core must run both prefill and decode (the caches it writes are its own): use "
            "--attention-backend qsa_core without --prefill-attention-backend / "
            f"--decode-attention-backend; got prefill={prefill!r}, decode={decode!r}"
        )


def model_qsa_config(runner: Any) -> QSAConfig:
    """The model's `QSAConfig` with the index and K/V dtypes of the runner's pool (heads: the
    whole model)."""
    model_config = runner.model_config
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    pool = runner.token_to_kv_pool
    index_dtype = INDEX_DTYPES.get(getattr(pool, "qsa_compressed_dtype", None), "auto")
    kv_cache_dtype = KV_DTYPES.get(getattr(pool, "dtype", None), "auto")
    try:
        return QSAConfig.from_hf(hf, index_dtype=index_dtype, kv_cache_dtype=kv_cache_dtype)
    except ValueError as err:
        arch = getattr(model_config.hf_config, "architectures", None)
        raise ValueError(
            f"--attention-backend qsa_core serves Qwen4-Exp models with a QSA profile "
            f"(indexer_n_heads, indexer_head_dim, indexer_budget, indexer_compress_ratio); "
            f"model {arch} cannot be served: {err}"
        ) from err
