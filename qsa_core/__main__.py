"""`python -m qsa_core`: the standalone demo, checked against transformers.

A tiny transformers `Qwen4ExpTextAttention` (random weights, budget 16 tokens in groups of
4) and a `QSAAttention` with the same weights, run by the standalone `Runner`: three
requests arrive at different times, chunked prefills and decodes share steps, pages are
shuffled. Prints a line per step, then each request's largest difference from transformers
over its whole sequence; exits with status 1 if one exceeds the fp32 tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import QSAAttention
from .standalone import Runner

TOLERANCE = 1e-4  # fp32 against HF: summation order only
HIDDEN = 256
LENGTHS = {"a": 90, "b": 40, "c": 64}
# Rows per request and step: mixed prefill chunks first, then decodes of b and c.
SCHEDULE = [{"a": 37, "b": 11}, {"a": 30, "b": 1, "c": 50}, {"a": 23, "b": 28, "c": 1}] + [{"c": 1}] * 13


def tiny_hf_layer(seed: int):
    """A transformers Qwen4-Exp attention layer small enough for a CPU, every weight random."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention

    config = Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128,
        indexer_budget=16, indexer_compress_ratio=4, num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = Qwen4ExpTextAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():  # HF norm weights start at zero: randomise everything
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
        # Like a trained indexer, let queries resemble keys so that most group scores are
        # above zero: exact ReLU-zero ties make torch.topk's (and so HF's) choice arbitrary.
        w, di = layer.indexer.index_qk_proj.weight, config.indexer_head_dim
        w[:-di] = 0.5 * w[:-di] + w[-di:].repeat(config.indexer_n_heads, 1)
    return layer.eval()


def hf_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """transformers' output for one whole sequence x [L, hidden] under a causal mask."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    L = x.shape[0]
    cos, sin = Qwen4ExpTextRotaryEmbedding(layer.config)(x[None], torch.arange(L)[None])
    mask = torch.full((L, L), torch.finfo(x.dtype).min).triu(1)[None, None]
    with torch.no_grad():
        return layer(x[None], (cos, sin), mask)[0][0]


def run(seed: int = 0) -> float:
    """Run the demo, print a line per step and per request; returns the worst difference."""
    hf = tiny_hf_layer(seed)
    qsa = QSAAttention.from_hf(hf)
    cfg = qsa.config
    print(f"QSA layer: {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}; "
          f"budget {cfg.token_topk} tokens = {cfg.block_topk} groups of {cfg.compress_ratio}")
    runner = Runner([qsa], page_size=16, num_pages=64, max_requests=4, shuffle_pages=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = {k: torch.randn(n, HIDDEN, generator=g) + torch.randn(HIDDEN, generator=g) for k, n in LENGTHS.items()}
    done = {k: 0 for k in LENGTHS}
    outputs: dict[str, list[torch.Tensor]] = {k: [] for k in LENGTHS}
    for i, step in enumerate(SCHEDULE, 1):
        chunks = {k: prompts[k][done[k] : done[k] + n] for k, n in step.items()}
        start = time.perf_counter()
        for k, out in runner.step(chunks).items():
            outputs[k].append(out)
            done[k] += out.shape[0]
        rows = ", ".join(f"{k} {n} row{'s' * (n > 1)} at {done[k] - n}" for k, n in step.items())
        print(f"step {i:2}/{len(SCHEDULE)}: {rows} ({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    worst = 0.0
    for k, n in LENGTHS.items():
        ref = hf_reference(hf, prompts[k])
        err = ((torch.cat(outputs[k]) - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
        print(f"request {k}: {n} tokens, max relative difference from transformers {err:.1e}")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qsa_core",
        description="Run QSA with no engine (the standalone Runner) and compare every output with "
        "transformers' Qwen4ExpTextAttention on the same random weights.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and page shuffle")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("python -m qsa_core compares with transformers: pip install 'qsa[hf]'", file=sys.stderr)
        return 2
    worst = run(args.seed)
    if worst > TOLERANCE:
        print(f"FAIL: standalone QSA differs from transformers by {worst:.2e} (> {TOLERANCE:g})", file=sys.stderr)
        return 1
    print(f"OK: standalone QSA matches transformers' Qwen4ExpTextAttention (within {TOLERANCE:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
