"""transformers' Qwen4-Exp as the oracle: greedy tokens and the top-k boundary gaps of its selections."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def selection_gaps() -> Iterator[list[float]]:
    """Record the top-k boundary gap of every selection HF's indexer makes inside the block.

    HF ranks a query's group scores with `scores.topk(k, dim=0)` on a 1-D vector. For each
    call with k < len(scores) this appends (s[k-1] - s[k]) / max|s| of the sorted scores:
    the margin by which the k-th chosen group beats the first one left out. A gap well
    above rounding means any correct implementation picks the same set (design.md §6.10).
    """
    gaps: list[float] = []
    original = torch.Tensor.topk

    def recording(self, k, *args, **kwargs):
        if self.dim() == 1 and k < self.numel():
            s = self.detach().float().sort(descending=True).values
            gaps.append(float((s[k - 1] - s[k]) / s.abs().max().clamp(min=1e-30)))
        return original(self, k, *args, **kwargs)

    torch.Tensor.topk = recording
    try:
        yield gaps
    finally:
        torch.Tensor.topk = original


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """HF `generate` greedy continuation of each prompt (one at a time, no padding)."""
    out = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        out.append(gen[0, len(prompt):].tolist())
    return out
