"""Static metadata buffers for SGLang's decode CUDA graphs, refreshed in place before replay.

`init_cuda_graph_state(max_bs, max_num_tokens)` allocates them once; at capture and at every
replay `refresh` maps the (replay view of the) batch with `batch_map.step_inputs` and copies
the result into the static buffers, then the planner re-derives its persistent fields in
place. Every tensor of the metadata a graph captured therefore keeps its address, and the
refresh reads nothing back to the host (host ints come from the batch size, the
`num_padding` of SGLang's replay view and the fixed context bound).

Padded requests (SGLang: request 0, seq_len 1, slot 0) become requests with no rows, so their
rows are the core's inert padding rows: position -1, every slot -1, output 0. RoPE positions
are SGLang's own static position buffers (referenced, not copied).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from qsa_core import QSAPlan, QSAPlanner, QSAStepInputs


class GraphInputs:
    """Persistent step inputs for batches up to max_bs / max_num_tokens, planned by `planner`
    (built for max_num_tokens rows: its workspace addresses are the graphs')."""

    def __init__(
        self,
        *,
        max_bs: int,
        max_num_tokens: int,
        max_seq_len: int,
        page_size: int,
        planner: QSAPlanner,
        device: torch.device,
    ) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.max_seq_len = max_seq_len
        self.query_start_loc = torch.zeros(max_bs + 1, **i32)
        self.seq_lens = torch.zeros(max_bs, **i32)
        self.block_table = torch.zeros(max_bs, math.ceil(max_seq_len / page_size), **i32)
        self.ring_index = torch.zeros(max_bs, **i32)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.planner = planner
        # (forward mode, batch size) -> the RoPE position tensor the capture saw.
        self._rope: dict[tuple[Any, int], torch.Tensor] = {}

    def refresh(self, step: QSAStepInputs, *, mode: Any, num_padding_reqs: int, in_capture: bool) -> QSAPlan:
        """Copy `step` (mapped with the fixed max_seq_len) into the static buffers, in place.

        The last `num_padding_reqs` requests are CUDA-graph padding: they get no rows.
        """
        bs, qlen = step.num_reqs, step.decode_query_len
        T = bs * qlen
        real_rows = (bs - num_padding_reqs) * qlen
        qsl = self.query_start_loc[: bs + 1]
        torch.clamp(step.query_start_loc, max=real_rows, out=qsl)
        self.seq_lens[:bs].copy_(step.seq_lens)
        self.ring_index[:bs].copy_(step.ring_index)
        self.block_table[:bs].copy_(step.block_table)
        slots = self.slot_mapping[:T]
        given = min(step.slot_mapping.shape[0], real_rows)  # SGLang's replay view: real rows only
        slots[:given].copy_(step.slot_mapping[:given])
        slots[given:].fill_(-1)
        key = (mode, bs)
        if in_capture:
            self._rope[key] = step.rope_positions
        elif key not in self._rope:
            raise RuntimeError(f"CUDA-graph replay of {mode.name} batch size {bs} was never captured by qsa_core")
        return self.planner.plan(QSAStepInputs(
            query_start_loc=qsl,
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=slots,
            ring_index=self.ring_index[:bs],
            rope_positions=self._rope[key],
            num_decodes=bs,
            decode_query_len=qlen,
            max_query_len=qlen,
            max_seq_len=self.max_seq_len,
            num_padding_rows=T - real_rows,
        ))
