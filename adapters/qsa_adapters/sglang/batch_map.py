"""SGLang's `ForwardBatch` -> the core's `QSAStepInputs` (design.md §3).

Host ints come from SGLang's host lists only (no device reads). Mapping, per mode
(R requests, T rows; IDLE steps carry no metadata):

| mode | rows per request | core seq_lens | decodes first |
|---|---|---|---|
| EXTEND, MIXED | extend_seq_lens (prefix may be cached) | seq_lens | none: every request is a prefill |
| DRAFT_EXTEND_V2 | extend_seq_lens (or num_tokens_per_req) | seq_lens (window included) | none |
| DECODE | 1 | seq_lens | all R |
| TARGET_VERIFY | draft_token_num (chain drafts) | seq_lens + draft_token_num | all R |

MIXED is prefill-first in SGLang; the core wants decodes first, so MIXED steps run every
request (the running decodes too, one row each) through the prefill path, which serves any
query length. `block_table = req_to_token[req, ::page_size] // page_size` (eager: 16-column aligned),
`slot_mapping = out_cache_loc`, `ring_index = req_pool_indices` (SGLang's ring row
`req_pool_idx * r + p % r`), rope positions = `mrope_positions` for MRoPE models, else
`positions`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from qsa_core import QSAStepInputs
from qsa_core.warmup import aligned_pages
from sglang.srt.model_executor.forward_batch_info import ForwardMode

EXTEND_LIKE = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2)
DECODE_LIKE = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
SUPPORTED = EXTEND_LIKE + DECODE_LIKE


def draft_token_num(forward_batch: Any) -> int:
    """Rows per request of a TARGET_VERIFY step; chain drafts only (topk 1)."""
    spec = forward_batch.spec_info
    if spec is None:
        raise ValueError("TARGET_VERIFY forward_batch.spec_info is None; expected an EagleVerifyInput")
    topk = int(getattr(spec, "topk", 1) or 1)
    if topk != 1:
        raise NotImplementedError(
            f"qsa_core verifies chain drafts only: spec_info.topk must be 1, got {topk} "
            "(use --speculative-eagle-topk 1)"
        )
    return int(spec.draft_token_num)


def _extend_lens(forward_batch: Any) -> list[int]:
    lens = forward_batch.extend_seq_lens_cpu
    if lens is not None:
        return [int(n) for n in lens]
    if forward_batch.forward_mode == ForwardMode.DRAFT_EXTEND_V2 and forward_batch.spec_info is not None:
        n = int(forward_batch.spec_info.num_tokens_per_req)
        return [n] * forward_batch.batch_size
    raise ValueError(
        f"{forward_batch.forward_mode.name} forward_batch.extend_seq_lens_cpu is None; "
        "expected one host int per request"
    )


def _host_max_seq_len(forward_batch: Any, extra: int, bound: int) -> int:
    """max(seq_lens) + extra from the host copy; the context bound when SGLang sent none."""
    cpu = forward_batch.seq_lens_cpu
    if cpu is None or cpu.numel() == 0:
        return bound
    return int(cpu.max()) + extra


def block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """int32 [R, pages]: physical page of each request-relative page (stale past seq_len;
    columns past req_to_token's width repeat its last page)."""
    width = -(-req_to_token.shape[1] // page_size)
    req = req_pool_indices.long()
    if pages <= width:  # a strided view of req_to_token, one gather
        return (req_to_token[:, : pages * page_size : page_size][req] // page_size).to(torch.int32)
    cols = torch.arange(pages, device=req_to_token.device).clamp_(max=width - 1) * page_size
    return (req_to_token[req[:, None], cols[None, :]] // page_size).to(torch.int32)


def rope_positions(forward_batch: Any, num_tokens: int, mrope: bool) -> torch.Tensor:
    """A view of the positions the layer's RoPE uses: [3, T] for MRoPE models, else [T].

    A view, never a copy: CUDA graphs keep reading SGLang's own static position buffers.
    """
    mrope_src = getattr(forward_batch, "mrope_positions", None) if mrope else None
    src = forward_batch.positions if mrope_src is None else mrope_src
    if src is None or src.dtype != torch.int64:
        got = None if src is None else src.dtype
        raise ValueError(f"{forward_batch.forward_mode.name} forward_batch positions must be int64, got {got}")
    return src[..., :num_tokens]


def step_inputs(
    forward_batch: Any,
    req_to_token: torch.Tensor,
    *,
    page_size: int,
    mrope: bool,
    max_seq_len_bound: int,
    fixed_max_seq_len: bool = False,
) -> QSAStepInputs:
    """Map one non-IDLE SGLang step. `fixed_max_seq_len` (CUDA graphs) uses the bound.

    max_seq_len_bound: the longest context a request can have (the width of req_to_token).
    The block table has ceil(max_seq_len / page_size) columns under CUDA graphs (the planner
    copies it into its own table), else that rounded up to a multiple of 16
    (`qsa_core.warmup.aligned_pages`): every eager step's table then specializes the kernels
    alike, whatever its max_seq_len, and the eager warm-up compiles one stride class.
    """
    mode = forward_batch.forward_mode
    if mode not in SUPPORTED:
        raise NotImplementedError(
            f"qsa_core does not serve ForwardMode.{mode.name}; supported: "
            f"{', '.join(m.name for m in SUPPORTED)} (and IDLE)"
        )
    R = forward_batch.batch_size
    dev = forward_batch.seq_lens.device
    seq = forward_batch.seq_lens[:R].to(torch.int32)
    if mode in EXTEND_LIKE:
        lens = _extend_lens(forward_batch)
        if len(lens) != R:
            raise ValueError(f"extend_seq_lens_cpu must have batch_size = {R} entries, got {len(lens)}")
        qsl = torch.zeros(R + 1, dtype=torch.int32, device=dev)
        qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0).to(dev)
        T, num_decodes, qlen, max_q, extra = sum(lens), 0, 1, max(lens, default=0), 0
    else:
        qlen = 1 if mode == ForwardMode.DECODE else draft_token_num(forward_batch)
        extra = 0 if mode == ForwardMode.DECODE else qlen  # verify seq_lens exclude the window
        qsl = torch.arange(R + 1, dtype=torch.int32, device=dev) * qlen
        seq = seq + extra
        T, num_decodes, max_q = R * qlen, R, qlen
    bound = max_seq_len_bound
    max_seq = bound if fixed_max_seq_len else _host_max_seq_len(forward_batch, extra, bound)
    pages = max(1, math.ceil(max_seq / page_size))
    pages = pages if fixed_max_seq_len else aligned_pages(pages)
    return QSAStepInputs(
        query_start_loc=qsl,
        seq_lens=seq,
        block_table=block_table(req_to_token, forward_batch.req_pool_indices[:R], page_size, pages),
        slot_mapping=forward_batch.out_cache_loc[:T].to(torch.int64),
        ring_index=forward_batch.req_pool_indices[:R].to(torch.int32),
        rope_positions=rope_positions(forward_batch, T, mrope),
        num_decodes=num_decodes,
        decode_query_len=qlen,
        max_query_len=max_q,
        max_seq_len=max_seq,
    )
