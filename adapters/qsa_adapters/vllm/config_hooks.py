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


def uses_qsa_core(vllm_config: Any) -> bool:
    """True when the QSA layers run on qsa_core: QSA_CORE chosen, or the CPU platform."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .backend import BACKEND_NAME

    backend = vllm_config.attention_config.backend
    return current_platform.is_cpu() or (backend is not None and backend == AttentionBackendEnum[BACKEND_NAME])


def microbatching_refusal(parallel_config: Any) -> str | None:
    """Why QSA_CORE cannot serve vLLM's micro-batching (dual batch overlap `--enable-dbo`, or
    `--ubatch-size` > 1), naming the flag; None without it.

    Under micro-batching vLLM splits a step into ubatches, builds each one's metadata with a
    builder of its own and runs them interleaved on two threads. The core plans a step into
    its planner's persistent buffers, one plan and workspace per engine step
    (`QSAStepPairing`): a second ubatch's plan would overwrite the first's while it runs.
    """
    if parallel_config.enable_dbo:
        flag = "--enable-dbo"
    elif parallel_config.ubatch_size > 1:
        flag = f"--ubatch-size {parallel_config.ubatch_size}"
    else:
        return None
    return (
        f"QSA_CORE does not serve micro-batching ({flag}): it plans one step at a time into one "
        f"workspace, and vLLM's micro-batches of a step run interleaved; drop {flag}"
    )


def refuse_microbatching(vllm_config: Any) -> None:
    """Refuse `microbatching_refusal` at config time, before upstream's own check (vLLM 0.32
    and 0.33 refuse it for every Qwen4-Exp QSA model without naming the flag)."""
    reason = microbatching_refusal(vllm_config.parallel_config) if uses_qsa_core(vllm_config) else None
    if reason is not None:
        raise ValueError(reason)


def refuse_unserved_settings(vllm_config: Any) -> None:
    """What the core-backed QSA layers do not serve, refused by name before anything loads
    (in the process that builds the config: `vllm serve` exits at start-up with this error).

    - a KV-cache dtype or fp8 setting the core's main K/V path does not serve
      (`cache.check_kv_cache_settings`; fp8 / fp8_e4m3 / fp8_e5m2 are served);
    - MTP speculative decoding with MRoPE in multimodal mode: the draft steps are planned at
      logical positions (vLLM's proposer hands the draft layers no 3-axis positions to the
      step metadata), which after an image are not the MRoPE ones. Multimodal MRoPE without
      speculation is served (the ring keeps each row's 3-axis position), and so is MTP
      text-only (`--language-model-only` strips MRoPE: a 1-D position feeds all three axes).
    """
    from .cache import check_kv_cache_settings

    if not uses_qsa_core(vllm_config):
        return  # upstream's QSA serves the model
    check_kv_cache_settings(vllm_config)
    text = vllm_config.model_config.hf_text_config
    if (getattr(text, "rope_parameters", None) or {}).get("mrope_section") and vllm_config.speculative_config:
        raise ValueError(
            "QSA_CORE does not serve --speculative-config with Qwen4-Exp's MRoPE (rope_parameters.mrope_section) "
            "in multimodal mode yet (draft steps would rotate at logical, not 3-axis, positions): serve "
            "multimodal without --speculative-config, or text only with --language-model-only"
        )


def text_only_draft_without_mrope(vllm_config: Any) -> None:
    """An MTP draft of a text-only target drops MRoPE as its target did.

    vLLM keeps MRoPE in the draft's config whenever the checkpoint has a vision tower, also
    when the target serves text only (`--language-model-only`); the draft then gets the
    target's 1-D positions, with which MRoPE is plain RoPE. Dropping the fields says so, and
    keeps the draft's QSA layer on the 1-D path the target uses."""
    spec = vllm_config.speculative_config
    target = getattr(spec, "target_model_config", None)
    if target is None or (getattr(target.hf_text_config, "rope_parameters", None) or {}).get("mrope_section"):
        return
    model = vllm_config.model_config
    for config in {id(c): c for c in (model.hf_config, model.hf_text_config)}.values():
        rope = getattr(config, "rope_parameters", None)
        if rope:
            rope.pop("mrope_section", None)
            rope.pop("mrope_interleaved", None)


def install() -> None:
    """Wrap vLLM's config hooks of the three Qwen4-Exp architectures (idempotent)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP"):
        upstream = MODELS_CONFIG_MAP[arch]
        if getattr(upstream, "qsa_core_checks", False):
            continue

        def verify_and_update_config(vllm_config: Any, _upstream=upstream, _draft=arch == "Qwen4ExpMTP") -> None:
            refuse_microbatching(vllm_config)
            _upstream.verify_and_update_config(vllm_config)
            if _draft:
                text_only_draft_without_mrope(vllm_config)
            refuse_prefix_caching_without_linear_layers(vllm_config)
            refuse_unserved_settings(vllm_config)

        MODELS_CONFIG_MAP[arch] = type(
            f"QSACore{upstream.__name__}",
            (upstream,),
            {"qsa_core_checks": True, "verify_and_update_config": staticmethod(verify_and_update_config)},
        )
