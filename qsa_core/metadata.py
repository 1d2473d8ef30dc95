"""`QSAForwardMetadata`: the schema of one step's record, shared by every QSA layer.

It is the engine's `QSAStepInputs` plus the fields design.md §3 derives on the device
and the engine geometry. `QSAPlanner.plan` builds it (validation there, derivation by the
metadata-build op); nothing here computes anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import QSAStepInputs


@dataclass(frozen=True, kw_only=True)
class QSAForwardMetadata(QSAStepInputs):
    """A step's inputs (rope_positions resolved: never None) and, all [T]:

    token_to_req int32, positions int64 (logical; -1 = padding or inert), visible_blocks
    int32, ring_slot int64 and compressed_slot int64 (-1 = no write). Geometry:
    compress_ratio r, page_size, ring_capacity C.
    """

    compress_ratio: int
    page_size: int
    ring_capacity: int
    token_to_req: torch.Tensor
    positions: torch.Tensor
    visible_blocks: torch.Tensor
    ring_slot: torch.Tensor
    compressed_slot: torch.Tensor
