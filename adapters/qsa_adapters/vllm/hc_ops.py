"""PyTorch kernels of vLLM's five Qwen4-Exp HyperConnection ops, for devices without Triton.

Upstream registers `vllm::qwen4_exp_{grouped_gemma_rmsnorm, hc_silu, hc_gate_mix, hc_combine,
hc_combine_norm}` with Triton bodies under the platform's dispatch key; on the CPU those
bodies cannot run. `register_torch_hc_ops(dispatch_key)` registers these functions for that
key instead (the dispatcher's override: no upstream file is touched). Layouts: the
multi-stream state is [N, hc * H] with the stream outer; every op computes in fp32 and
returns the input's dtype.
"""

from __future__ import annotations

import torch

_LIBRARIES: list[torch.library.Library] = []


def grouped_gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int) -> torch.Tensor:
    """GemmaRMSNorm `y * (1 + w)` of each of `num_groups` equal slices of x [N, DIM].

    weight: [DIM] (one affine per element) or [DIM / num_groups] (shared by the groups).
    """
    groups = x.float().unflatten(-1, (num_groups, -1))
    y = groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)
    w = weight.float().reshape(-1, groups.shape[-1]) if weight.numel() != groups.shape[-1] else weight.float()
    return (y * (1.0 + w)).flatten(-2).to(x.dtype)


def hc_silu(x: torch.Tensor, hc_count: int) -> torch.Tensor:
    """silu(x / hc_count), x [N, R]."""
    return torch.nn.functional.silu(x.float() / hc_count).to(x.dtype)


def hc_gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    """Mean over the hc streams of sigmoid(gate) * x: [N, hc * H] x2 -> [N, H]."""
    mixed = torch.sigmoid(gate.float()) * x.float()
    return mixed.unflatten(-1, (hc_count, -1)).mean(-2).to(x.dtype)


def _combined(
    residual: torch.Tensor, block_output: torch.Tensor, injection_logits: torch.Tensor | None, hc_count: int
) -> torch.Tensor:
    """fp32 [N, hc, H]: residual + block_output into every stream, weighted by
    2 * sigmoid(injection / hc) per stream (weight 1 without injection)."""
    block = block_output.float()[:, None, :]
    if injection_logits is not None:
        block = block * (2.0 * torch.sigmoid(injection_logits.float() / hc_count))[:, :, None]
    return residual.float().unflatten(-1, (hc_count, -1)) + block


def hc_combine(
    residual: torch.Tensor, block_output: torch.Tensor, injection_logits: torch.Tensor | None, hc_count: int
) -> torch.Tensor:
    """residual [N, hc * H] + block_output [N, H] (injection_logits [N, hc] or None) -> [N, hc * H]."""
    return _combined(residual, block_output, injection_logits, hc_count).flatten(-2).to(residual.dtype)


def hc_combine_norm(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hc_combine`, then the grouped GemmaRMSNorm of the (rounded) result: (state, normed)."""
    state = hc_combine(residual, block_output, injection_logits, hc_count)
    return state, grouped_gemma_rmsnorm(state, norm_weight, eps, hc_count)


OPS = {
    "qwen4_exp_grouped_gemma_rmsnorm": grouped_gemma_rmsnorm,
    "qwen4_exp_hc_silu": hc_silu,
    "qwen4_exp_hc_gate_mix": hc_gate_mix,
    "qwen4_exp_hc_combine": hc_combine,
    "qwen4_exp_hc_combine_norm": hc_combine_norm,
}


def register_torch_hc_ops(dispatch_key: str) -> None:
    """Make `torch.ops.vllm.qwen4_exp_*` run these functions on `dispatch_key` tensors.

    Call after upstream's `ops/hc.py` defined the ops (importing upstream's model does);
    a later call is a no-op.
    """
    if _LIBRARIES:
        return
    lib = torch.library.Library("vllm", "IMPL")
    for name, fn in OPS.items():
        lib.impl(name, fn, dispatch_key)
    _LIBRARIES.append(lib)
