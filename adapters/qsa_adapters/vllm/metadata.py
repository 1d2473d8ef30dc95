"""vLLM's per-step `CommonAttentionMetadata` (+ the ring group's block table) -> `QSAStepInputs` -> `QSAPlan`.

vLLM hands each KV-cache group its own `CommonAttentionMetadata`: the main K/V pages (which
hold the compressed keys too) are one group (one block table and slot mapping); the raw-key
rings live in a group of their own with one block per request. This module maps the two onto the core's
step inputs. It derives nothing QSA itself: `QSAPlanner` does that.

The core's paged cache views keep vLLM's block strides (core page = vLLM block, core ring
row = the ring group's block), so block tables and slots pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from qsa_core import QSAConfig, QSAPlan, QSAPlanner, QSAStepInputs, check_page_size


@dataclass(frozen=True)
class PagedGeometry:
    """The cache geometry a step is planned for (fixed once the caches are bound).

    compress_ratio r; page_size: tokens per vLLM block (a multiple of r); ring_capacity C.
    """

    compress_ratio: int
    page_size: int
    ring_capacity: int

    def __post_init__(self) -> None:
        check_page_size(self.page_size, self.compress_ratio)


def uniform_decode_split(query_start_loc_cpu: torch.Tensor, decode_threshold: int) -> tuple[int, int]:
    """(num_decodes, decode_query_len) of a batch that vLLM reordered decodes first.

    query_start_loc_cpu int32 [R+1] (host copy: no device read). Decodes are the leading
    requests that share the first request's query length, when that is 1..decode_threshold.
    Zero-length CUDA-graph padding requests are not decodes.
    """
    qlens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    if qlens.numel() == 0:
        return 0, 1
    q = int(qlens[0])
    if not 1 <= q <= decode_threshold:
        return 0, 1
    other = (qlens != q).nonzero()
    return (int(other[0, 0]) if other.numel() else qlens.numel()), q


# vLLM's null block: its block pool's first block, never allocated to a request; its dummy runs
# (memory profiling, CUDA-graph capture) give every request this block, in the ring group too, and
# so do the draft steps' padding requests (`QSAStep.add_draft`). The planner makes their rows inert
# without flagging them (`QSAPlanner` null_ring_row).
NULL_BLOCK = 0


def core_ring_index(ring_block_table: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """int32 [R] ring row per request: the ring group's block (one per request)."""
    if ring_block_table.dim() != 2 or ring_block_table.shape[0] < num_reqs:
        raise ValueError(
            f"ring_block_table must be [>= num_reqs = {num_reqs}, blocks], got {tuple(ring_block_table.shape)}"
        )
    return ring_block_table[:num_reqs, 0].to(torch.int32)


class QSAMetadataMapper:
    """Maps one step's vLLM metadata onto a `QSAPlan` for one `PagedGeometry`.

    Owns the `QSAPlanner` of its geometry (config: the layer's `QSAConfig`, dtype: the
    model dtype). With `max_num_reqs` (an engine's mapper) every step is planned static:
    its tensors are copied into the planner's persistent buffers, so a CUDA graph captured
    on one uniform decode batch replays on the next; a step beyond the sizes is refused.
    Without it (tests), the planner is rebuilt larger when a step exceeds its sizes.
    num_slots / num_ring_rows: the bound caches' main K/V slots and ring rows; the planner
    checks (CPU) or guards (GPU) every step's slot_mapping, block table and ring_index
    against them.
    """

    def __init__(
        self, geometry: PagedGeometry, config: QSAConfig, dtype: torch.dtype, device: torch.device | str,
        *, max_num_tokens: int = 256, max_model_len: int = 4096, max_num_reqs: int | None = None,
        num_slots: int | None = None, num_ring_rows: int | None = None,
    ) -> None:
        self.geometry = geometry
        self.config, self.dtype, self.device = config, dtype, device
        self.max_num_reqs = max_num_reqs
        self.num_slots, self.num_ring_rows = num_slots, num_ring_rows
        self.planner = self._planner(max_num_tokens, max_model_len)

    def _planner(self, max_num_tokens: int, max_model_len: int) -> QSAPlanner:
        g = self.geometry
        return QSAPlanner(
            self.config, dtype=self.dtype, page_size=g.page_size, ring_capacity=g.ring_capacity,
            max_num_tokens=max_num_tokens, max_model_len=max_model_len, device=self.device,
            max_num_reqs=self.max_num_reqs, num_slots=self.num_slots, num_ring_rows=self.num_ring_rows,
            null_ring_row=NULL_BLOCK,
        )

    def step_inputs(
        self,
        common: CommonAttentionMetadata,
        ring_block_table: torch.Tensor,
        *,
        decode_threshold: int = 1,
        rope_positions: torch.Tensor | None = None,
    ) -> QSAStepInputs:
        """The core's inputs of a step.

        common: the main group's metadata (block table, slot_mapping int64 [>= T]) with
        T = num_actual_tokens rows, CUDA-graph padding included (padding requests have query
        length 0 and seq_len 0; padding rows slot -1). ring_block_table: the ring group's
        int32 [>= R, 1]. rope_positions: int64 [T] or [3, T]; default common.positions, else
        the logical positions.
        """
        R, T = common.num_reqs, common.num_actual_tokens
        qsl_cpu = common.query_start_loc_cpu
        num_decodes, decode_query_len = uniform_decode_split(qsl_cpu, decode_threshold)
        if rope_positions is None and common.positions is not None:
            rope_positions = common.positions
        if rope_positions is not None:
            rope_positions = rope_positions[..., :T]
        return QSAStepInputs(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            # vLLM sizes its table for the block size it started with: plan only the
            # columns max_model_len can use
            block_table=common.block_table_tensor[:R, : self.planner.max_pages],
            slot_mapping=common.slot_mapping[:T],
            ring_index=core_ring_index(ring_block_table, R),
            rope_positions=rope_positions,
            num_decodes=num_decodes,
            decode_query_len=decode_query_len,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            num_padding_rows=T - int(qsl_cpu[-1]),
        )

    def map(
        self,
        common: CommonAttentionMetadata,
        ring_block_table: torch.Tensor,
        *,
        decode_threshold: int = 1,
        rope_positions: torch.Tensor | None = None,
    ) -> QSAPlan:
        """Plan the step (see `step_inputs`)."""
        inputs = self.step_inputs(
            common, ring_block_table, decode_threshold=decode_threshold, rope_positions=rope_positions
        )
        p, static = self.planner, self.max_num_reqs is not None
        if not static and (inputs.num_tokens > p.max_num_tokens or inputs.max_seq_len > p.max_model_len):
            self.planner = self._planner(
                max(inputs.num_tokens, p.max_num_tokens), max(inputs.max_seq_len, p.max_model_len)
            )
        return self.planner.plan(inputs, static=static)
