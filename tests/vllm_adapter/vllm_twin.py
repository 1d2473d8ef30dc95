"""The standalone twin of `QSATinyForCausalLM`: same weights, `qsa_core.QSAAttention` layers
run by the core's `standalone.Runner` (no vLLM), for reference greedy generations."""

from __future__ import annotations

import torch
from torch import nn

from qsa_adapters.vllm.tiny_model import TinyMLP, TinyRMSNorm
from qsa_core import QSAAttention, QSAConfig
from qsa_core.standalone import Runner


class TwinBlock(nn.Module):
    """A `QSATinyDecoderLayer` with the core layer: forward(x, meta, cache) for the Runner."""

    def __init__(self, config: QSAConfig, intermediate_size: int) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = TinyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = QSAAttention(config)
        self.post_attention_layernorm = TinyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TinyMLP(config.hidden_size, intermediate_size)

    def forward(self, x, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyTwin(nn.Module):
    """Module tree with the checkpoint's names, so `load_state_dict(weights)` is strict."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        qsa = QSAConfig.from_hf(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.model.layers = nn.ModuleList(
            TwinBlock(qsa, hf_config.intermediate_size) for _ in range(hf_config.num_hidden_layers)
        )
        self.model.norm = TinyRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int, page_size: int) -> list[list[int]]:
        """Greedy tokens per prompt: one step prefills every prompt, then batched decodes."""
        runner = Runner(list(self.model.layers), page_size=page_size, num_pages=256,
                        max_requests=len(prompts), shuffle_pages=True)
        chunks = {i: torch.tensor(p) for i, p in enumerate(prompts)}
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_tokens):
            hidden = runner.step({i: self.model.embed_tokens(ids) for i, ids in chunks.items()})
            chunks = {}
            for i, h in hidden.items():
                tok = int(self.lm_head(self.model.norm(h[-1:])).argmax(-1))
                out[i].append(tok)
                chunks[i] = torch.tensor([tok])
        return out


def twin_greedy(hf_config, weights, prompts, max_tokens, page_size=16):
    twin = TinyTwin(hf_config)
    twin.load_state_dict(weights, strict=True)
    return twin.eval().greedy(prompts, max_tokens, page_size)
