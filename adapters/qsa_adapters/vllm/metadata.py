"""vLLM's per-step `CommonAttentionMetadata` (+ the ring group's block table) -> `QSAStepInputs` -> `QSAPlan`.

vLLM hands each KV-cache group its own `CommonAttentionMetadata`: the main K/V and the
compressed keys share one group (one block table and slot mapping); the raw-key rings
live in a group of their own with one block per request. This module maps the two onto the core's
step inputs. It derives nothing QSA itself: `QSAPlanner` does that.

Index maps (`PagedGeometry`): vLLM may pack several layers' pages into one block (block
stride > one layer's page). The core addresses compressed keys as flat rows
`main slot // r`, so the adapter numbers core pages as `vLLM block * page_scale`
(page_scale = compressed rows per block stride / (page_size / r)) and core ring rows as
`vLLM ring block * ring_stride * C + p % C`. Unpacked layouts give page_scale = ring_stride = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from qsa_core import QSAConfig, QSAPlan, QSAPlanner, QSAStepInputs, check_page_size


@dataclass(frozen=True)
class PagedGeometry:
    """How core page / ring indices address vLLM's blocks (fixed once the caches are bound).

    compress_ratio r; page_size: tokens per vLLM block (a multiple of r); ring_capacity C;
    page_scale: core page of vLLM block b is b * page_scale; ring_stride: core ring index
    of vLLM ring block b is b * ring_stride.
    """

    compress_ratio: int
    page_size: int
    ring_capacity: int
    page_scale: int = 1
    ring_stride: int = 1

    def __post_init__(self) -> None:
        check_page_size(self.page_size, self.compress_ratio)
        for name in ("page_scale", "ring_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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


def core_block_table(block_table: torch.Tensor, num_reqs: int, geometry: PagedGeometry) -> torch.Tensor:
    """int32 [R, P] core pages of vLLM's block table (rows past num_reqs dropped)."""
    table = block_table[:num_reqs]
    return table if geometry.page_scale == 1 else table * geometry.page_scale


def core_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, geometry: PagedGeometry) -> torch.Tensor:
    """int64 [T] core main slots of vLLM's slot mapping; negative slots (padding) stay -1."""
    slots = slot_mapping[:num_tokens]
    if geometry.page_scale == 1:
        return slots
    page = geometry.page_size
    return torch.where(slots >= 0, slots + (slots // page) * ((geometry.page_scale - 1) * page), -1)


def core_ring_index(ring_block_table: torch.Tensor, num_reqs: int, geometry: PagedGeometry) -> torch.Tensor:
    """int32 [R] ring base row index per request: the ring group's block * ring_stride."""
    if ring_block_table.dim() != 2 or ring_block_table.shape[0] < num_reqs:
        raise ValueError(
            f"ring_block_table must be [>= num_reqs = {num_reqs}, blocks], got {tuple(ring_block_table.shape)}"
        )
    return (ring_block_table[:num_reqs, 0] * geometry.ring_stride).to(torch.int32)


class QSAMetadataMapper:
    """Maps one step's vLLM metadata onto a `QSAPlan` for one `PagedGeometry`.

    Owns the `QSAPlanner` of its geometry (config: the layer's `QSAConfig`, dtype: the
    model dtype); the planner is rebuilt larger when a step exceeds its sizes (eager only).
    """

    def __init__(
        self, geometry: PagedGeometry, config: QSAConfig, dtype: torch.dtype, device: torch.device | str,
        *, max_num_tokens: int = 256, max_model_len: int = 4096,
    ) -> None:
        self.geometry = geometry
        self.config, self.dtype, self.device = config, dtype, device
        self.planner = self._planner(max_num_tokens, max_model_len)

    def _planner(self, max_num_tokens: int, max_model_len: int) -> QSAPlanner:
        g = self.geometry
        return QSAPlanner(
            self.config, dtype=self.dtype, page_size=g.page_size, ring_capacity=g.ring_capacity,
            max_num_tokens=max_num_tokens, max_model_len=max_model_len, device=self.device,
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
        g = self.geometry
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
            block_table=core_block_table(common.block_table_tensor, R, g),
            slot_mapping=core_slot_mapping(common.slot_mapping, T, g),
            ring_index=core_ring_index(ring_block_table, R, g),
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
        p = self.planner
        if inputs.num_tokens > p.max_num_tokens or inputs.max_seq_len > p.max_model_len:
            self.planner = self._planner(
                max(inputs.num_tokens, p.max_num_tokens), max(inputs.max_seq_len, p.max_model_len)
            )
        return self.planner.plan(inputs)
