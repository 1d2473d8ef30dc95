"""The raw-key ring qsa_core owns beside SGLang's pool: C rows per request slot and QSA layer.

SGLang's `QSATokenToKVPool` keeps r rows per request (row `req_pool_idx * r + p % r`). A
TARGET_VERIFY step writes a raw key for every row of its draft window; with 3 or more draft
tokens a draft row past the open group lands on a row that still holds a committed raw key of
that group, and when the draft is rejected the group is later compressed from the wrong key
(design.md §6.7). The adapter therefore keeps its own ring (design.md §4):

| buffer | shape, dtype | row of position p of request slot q |
|---|---|---|
| raw keys, per QSA layer | [request slots, C, Di], the pool's ring dtype (bf16) | [q, p % C] |
| MRoPE positions, per QSA layer | [request slots, C, 3] int64 (MRoPE models only) | [q, p % C] |

with C = r * ceil((r + num_speculative_tokens) / r): the open group (at most r - 1 committed
rows) plus a whole draft window never share a row. Without speculation C = r. The pool's own
ring rows are left unused. Request slot 0 is SGLang's dummy request (its rows are never read
for a live request).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def ring_capacity(compress_ratio: int, num_speculative_tokens: int) -> int:
    """C = r * ceil((r + num_speculative_tokens) / r) rows per request."""
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    r = compress_ratio
    return r * math.ceil((r + num_speculative_tokens) / r)


def speculative_tokens(runner: Any) -> int:
    """Draft tokens a TARGET_VERIFY step of `runner` may hold beyond its first row (0 without
    speculative decoding): SGLang's largest draft-token count (adaptive speculation included)
    minus the verified token that heads each window."""
    spec = getattr(runner, "spec_algorithm", None)
    if spec is None or spec.is_none():
        return 0
    from sglang.srt import runtime_context

    draft_tokens = runtime_context.max_speculative_num_draft_tokens()
    if not draft_tokens or draft_tokens < 1:
        raise ValueError(
            f"speculative decoding ({spec.name}) without a draft-token count: "
            f"speculative_num_draft_tokens resolved to {draft_tokens}"
        )
    return int(draft_tokens) - 1


class AdapterRing:
    """Every QSA layer's raw-key ring (and MRoPE position ring), allocated once."""

    def __init__(
        self,
        layer_ids: list[int],
        *,
        num_request_slots: int,
        capacity: int,
        index_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        mrope: bool,
    ) -> None:
        self.capacity = capacity
        shape = (num_request_slots, capacity)
        self.keys = {int(i): torch.zeros(*shape, index_head_dim, dtype=dtype, device=device) for i in layer_ids}
        self.positions = (
            {int(i): torch.zeros(*shape, 3, dtype=torch.int64, device=device) for i in layer_ids} if mrope else None
        )

    @classmethod
    def for_pool(cls, pool: Any, capacity: int, mrope: bool) -> "AdapterRing":
        """Rings for the QSA layers of SGLang's `QSATokenToKVPool`, with its request slots,
        index head dim, raw-key dtype and device."""
        return cls(
            list(pool.full_attention_layer_id_mapping), num_request_slots=pool.qsa_num_request_slots,
            capacity=capacity, index_head_dim=pool.qsa_index_head_dim, dtype=pool.index_state_dtype,
            device=pool.device, mrope=mrope,
        )

    def views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(raw keys [slots, C, Di], positions [slots, C, 3] or None) of QSA layer `layer_id`."""
        keys = self.keys.get(layer_id)
        if keys is None:
            raise KeyError(f"layer {layer_id} is not a QSA layer of this pool (QSA layers: {sorted(self.keys)})")
        return keys, None if self.positions is None else self.positions[layer_id]
