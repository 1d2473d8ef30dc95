"""Run QSA with no engine: a tiny HF Qwen4-Exp attention layer through the standalone Runner.

Three requests arrive at different times (chunked prefills and decodes share steps, pages
are shuffled); every output is checked against transformers' `Qwen4ExpTextAttention`.
Usage: python examples/standalone.py
"""

import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextAttention,
    Qwen4ExpTextRotaryEmbedding,
)

from qsa_core import QSAAttention
from qsa_core.standalone import Runner


def tiny_hf_layer() -> Qwen4ExpTextAttention:
    config = Qwen4ExpTextConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128,
        indexer_budget=16, indexer_compress_ratio=4, num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = Qwen4ExpTextAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():  # HF norm weights start at zero: randomise everything
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        # Like a trained indexer, let queries resemble keys so that most group scores are
        # above zero: exact ReLU-zero ties make torch.topk's (and so HF's) choice arbitrary.
        w, di = layer.indexer.index_qk_proj.weight, config.indexer_head_dim
        w[:-di] = 0.5 * w[:-di] + w[-di:].repeat(config.indexer_n_heads, 1)
    return layer.eval()


def hf_reference(layer: Qwen4ExpTextAttention, x: torch.Tensor) -> torch.Tensor:
    L = x.shape[0]
    cos, sin = Qwen4ExpTextRotaryEmbedding(layer.config)(x[None], torch.arange(L)[None])
    mask = torch.full((L, L), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad():
        return layer(x[None], (cos, sin), mask)[0][0]


def main() -> None:
    hf = tiny_hf_layer()
    qsa = QSAAttention.from_hf(hf)
    runner = Runner([qsa], page_size=16, num_pages=64, max_requests=4, shuffle_pages=True)
    g = torch.Generator().manual_seed(1)
    lengths = {"a": 90, "b": 40, "c": 64}
    prompts = {k: torch.randn(n, 256, generator=g) + torch.randn(256, generator=g) for k, n in lengths.items()}
    schedule = [{"a": 37, "b": 11}, {"a": 30, "b": 1, "c": 50}, {"a": 23, "b": 28, "c": 1}]
    schedule += [{"b": 0, "c": 1}] * 13
    done = {k: 0 for k in lengths}
    outputs: dict[str, list[torch.Tensor]] = {k: [] for k in lengths}
    for step in schedule:
        chunks = {k: prompts[k][done[k] : done[k] + n] for k, n in step.items() if n}
        for k, out in runner.step(chunks).items():
            outputs[k].append(out)
            done[k] += out.shape[0]
    print(f"{len(schedule)} steps, budget {qsa.config.token_topk} tokens, "
          f"{qsa.config.block_topk} groups of {qsa.config.compress_ratio}")
    worst = 0.0
    for k, n in lengths.items():
        ours = torch.cat(outputs[k])
        ref = hf_reference(hf, prompts[k])
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        print(f"request {k}: {n} tokens, max relative error vs HF {err:.1e}")
    assert worst < 1e-4, f"standalone QSA disagrees with HF: {worst:.2e}"
    print("standalone QSA matches transformers' Qwen4ExpTextAttention")


if __name__ == "__main__":
    main()
