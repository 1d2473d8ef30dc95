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


@contextlib.contextmanager
def spec_order_boundaries() -> Iterator[list[tuple[float, float, float]]]:
    """HF's indexer top-k with ties broken by design.md §2.7 (higher score first, then lower group
    index), recording each selection's boundary inside the block: (s[k-1], s[k], max |s|) of the
    sorted scores s for every `scores.topk(k, dim=0)` on a 1-D vector with k < len(scores).

    `torch.topk` has no defined order among equal scores (design.md §6.10); ReLU makes exact
    zeros common, so an exact tie at the boundary (both 0.0) is decided by the group index, as
    the core decides it. A boundary that is not an exact tie must have a clear gap instead.
    """
    bounds: list[tuple[float, float, float]] = []
    original = torch.Tensor.topk

    def spec_topk(self, k, *args, **kwargs):
        if self.dim() != 1 or k >= self.numel():
            return original(self, k, *args, **kwargs)
        order = torch.sort(self, descending=True, stable=True)
        s = order.values.detach().float()
        bounds.append((float(s[k - 1]), float(s[k]), float(s.abs().max())))
        return torch.return_types.topk((order.values[:k], order.indices[:k]))

    torch.Tensor.topk = spec_topk
    try:
        yield bounds
    finally:
        torch.Tensor.topk = original


@contextlib.contextmanager
def fp8_kv_cache(model, dtype: torch.dtype, scales: dict[int, tuple[float, float]] | None = None) -> Iterator[None]:
    """HF's attention over an fp8 main KV cache with per-tensor scales, as the core computes it
    (design.md §4): every key and value the attention reads is `fp8(x / scale) * scale`
    (x / scale rounded to `dtype`, nearest even, as a cache store rounds it), so
    q.k * softmax_scale = q.fp8(k / k_scale) * (softmax_scale * k_scale) and the output is
    v_scale * sum p fp8(v / v_scale). scales: (k_scale, v_scale) by layer index (default 1.0).
    Runs HF's eager attention (the function patched here) while inside."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    original, attn_config = hf.eager_attention_forward, getattr(model.config, "text_config", model.config)
    implementation = attn_config._attn_implementation

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return ((x.float() / scale).to(dtype).float() * scale).to(x.dtype)

    def fp8_attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = (scales or {}).get(module.layer_idx, (1.0, 1.0))
        return original(module, query, rounded(key, k_scale), rounded(value, v_scale), *args, **kwargs)

    hf.eager_attention_forward = fp8_attention
    attn_config._attn_implementation = "eager"
    try:
        yield
    finally:
        hf.eager_attention_forward = original
        attn_config._attn_implementation = implementation
