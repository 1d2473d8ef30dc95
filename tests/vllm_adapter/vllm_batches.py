"""Real vLLM `CommonAttentionMetadata` for the batches a core `Runner` step ran.

The standalone Runner already orders decodes first, as vLLM's reorder does; this states the
same step the way vLLM's model runner would hand it to a backend (the main group: block table
and slot mapping; the ring group: one block per request), optionally with CUDA-graph
padding (zero-length padding requests on the null block, -1 slots).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from qsa_core import QSAForwardMetadata


def common_metadata(
    meta: QSAForwardMetadata, *, block_offset: int = 0, ring_offset: int = 0, pad_reqs: int = 0,
    pad_tokens: int = 0,
) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """(main-group metadata, ring block table int32 [R, 1]) for the step `meta` describes.

    vLLM block id = runner page + block_offset; ring block = runner ring row + ring_offset
    (vLLM's KV-cache groups share one block pool, so a real allocation keeps them apart).
    pad_reqs / pad_tokens: FULL-CUDA-graph padding on top of the runner's own padding rows.
    """
    R = meta.num_reqs
    real_tokens = meta.num_tokens - meta.num_padding_rows
    qsl = torch.cat((meta.query_start_loc, meta.query_start_loc[-1:].repeat(pad_reqs)))
    seq_lens = torch.cat((meta.seq_lens, torch.zeros(pad_reqs, dtype=torch.int32)))
    table = torch.where(meta.block_table >= 0, meta.block_table + block_offset, 0).to(torch.int32)
    table = torch.cat((table, torch.zeros(pad_reqs, table.shape[1], dtype=torch.int32)))
    slots = meta.slot_mapping.clone()
    slots[slots >= 0] += block_offset * meta.page_size
    slots = torch.cat((slots, torch.full((pad_tokens,), -1, dtype=torch.int64)))
    positions = torch.cat((meta.positions.clamp(min=0), torch.zeros(pad_tokens, dtype=torch.int64)))
    ring = torch.cat((meta.ring_index + ring_offset, torch.zeros(pad_reqs, dtype=torch.int32)))
    qlens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=R + pad_reqs,
        num_actual_tokens=meta.num_tokens + pad_tokens,
        max_query_len=int(qlens.max()) if R else 0,
        max_seq_len=int(meta.seq_lens.max()) if R else 0,
        block_table_tensor=table,
        slot_mapping=slots,
        positions=positions,
        is_prefilling=torch.zeros(R + pad_reqs, dtype=torch.bool),
    )
    assert int(qsl[-1]) == real_tokens
    return common, ring[:, None].to(torch.int32)
