"""`QSATinyForCausalLM`: a small decoder whose attention layers are QSA (tests, examples).

embed_tokens -> N x [RMSNorm -> QSA attention -> residual, RMSNorm -> SiLU MLP -> residual]
-> RMSNorm -> lm_head. The config is a transformers `Qwen4ExpTextConfig` (its indexer_*
fields set) plus `intermediate_size` for the MLP; weight names follow HF:
model.embed_tokens, model.layers.N.{input_layernorm, self_attn.*, post_attention_layernorm,
mlp.{gate,up,down}_proj}, model.norm, lm_head. `tiny_checkpoint` writes such a folder.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from .attention import QSAAttentionLayer


class TinyRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, in fp32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class TinyMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class QSATinyDecoderLayer(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, layer_id: int, prefix: str) -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.input_layernorm = TinyRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QSAAttentionLayer(
            vllm_config=vllm_config, config=cfg, layer_id=layer_id, prefix=f"{prefix}.self_attn"
        )
        self.post_attention_layernorm = TinyRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = TinyMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class QSATinyModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            QSATinyDecoderLayer(vllm_config=vllm_config, layer_id=i, prefix=f"{prefix}.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = TinyRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class QSATinyForCausalLM(nn.Module):
    """The vLLM model class registered by the `qsa` plugin."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        if cfg.tie_word_embeddings:
            raise ValueError("QSATinyForCausalLM needs tie_word_embeddings = false (it loads lm_head)")
        self.model = QSATinyModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """positions int64 [N]; returns the final hidden states [N, hidden]."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        return self.model(positions, x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in QSATinyForCausalLM")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded
