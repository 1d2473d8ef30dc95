"""Write a tiny random Qwen4-Exp checkpoint with transformers, to try the vLLM setup end to end.

Usage: python examples/vllm/make_tiny_model.py FOLDER [--hybrid]
Two QSA layers (budget 16 tokens in groups of 4), or with --hybrid GDN, QSA, GDN, QSA; no
tokenizer, so serve it with --skip-tokenizer-init and token-id prompts. A real checkpoint
needs none of this: point serve.sh at its folder.
"""

import argparse

import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--hybrid", action="store_true")
    args = parser.parse_args()
    layers = ["linear_attention", "indexed_attention"] * 2 if args.hybrid else ["indexed_attention"] * 2
    config = Qwen4ExpTextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=len(layers), layer_types=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=16, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        hc_count=2, hc_lowrank=8, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=128, linear_value_head_dim=128, output_gate_type="silu",
        architectures=["Qwen4ExpForCausalLM"],
    )
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(config).save_pretrained(args.folder)
    print(f"wrote {args.folder}: layers {layers}, vocab {config.vocab_size}")


if __name__ == "__main__":
    main()
