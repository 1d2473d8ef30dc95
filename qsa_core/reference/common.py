"""Numerics shared by the reference ops: GemmaRMSNorm, RoPE (1-D and interleaved MRoPE).

Both follow the HF reference's dtype path: the norm computes in fp32 and casts back; RoPE
applies the fp32 cos/sin table cast to the tensor's dtype.
"""

from __future__ import annotations

import torch


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w) over the last dim, in fp32, cast to x.dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, rope_axes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Rd] fp32 for positions int64 [T] (1-D) or [3, T] (MRoPE axes T, H, W).

    Frequency j uses the position of axis rope_axes[j]; the table is repeated twice (NeoX).
    """
    if positions.dim() == 1:
        pos = positions.float()[:, None].expand(-1, inv_freq.shape[0])
    else:
        pos = positions.float()[rope_axes.long(), :].T
    freqs = pos * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on the leading Rd dims of x [T, H, Dx]; cos/sin [T, Rd] fp32."""
    rd = cos.shape[-1]
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    rotated = xr * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rotated, xp), dim=-1)
