"""Engine-config checks for the core-backed Qwen4-Exp architectures (vLLM's per-architecture
`verify_and_update_config` registry), run when vLLM builds its config, before any weight loads."""

from __future__ import annotations

from typing import Any


def refuse_prefix_caching_without_linear_layers(vllm_config: Any) -> None:
    """vLLM treats every Qwen4-Exp config as hybrid: with prefix caching on it picks the mamba
    'align' cache mode, which asserts "no mamba layers in the model" on the first step when no
    layer is linear_attention. Refuse that combination at config time, naming the fix."""
    text = vllm_config.model_config.hf_text_config
    if vllm_config.cache_config.enable_prefix_caching and "linear_attention" not in text.layer_types:
        raise ValueError(
            "Qwen4-Exp with every layer indexed_attention (no linear_attention layer) cannot run with "
            "prefix caching on in vLLM 0.32 (its hybrid 'align' mamba cache mode needs a mamba layer): "
            "set enable_prefix_caching=False (--no-enable-prefix-caching)"
        )


def install() -> None:
    """Wrap vLLM's config hooks of the three Qwen4-Exp architectures (idempotent)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP"):
        upstream = MODELS_CONFIG_MAP[arch]
        if getattr(upstream, "qsa_core_checks", False):
            continue

        def verify_and_update_config(vllm_config: Any, _upstream=upstream) -> None:
            _upstream.verify_and_update_config(vllm_config)
            refuse_prefix_caching_without_linear_layers(vllm_config)

        MODELS_CONFIG_MAP[arch] = type(
            f"QSACore{upstream.__name__}",
            (upstream,),
            {"qsa_core_checks": True, "verify_and_update_config": staticmethod(verify_and_update_config)},
        )
