"""Triton sparse paged attention: GQA over each row's selected tokens, gated.

Contract: `qsa_core/reference/attention.py`. One program per (row, KV head[, split]) holds
the head group's queries as a [GP, D] tile (GP = group size padded to a power of two >= 16
for tl.dot) and runs an online softmax (fp32, exp2) over blocks of selection columns,
gathering K/V rows through the block table. Many rows: one pass (`_attn_kernel`, SPLIT off)
that also applies the gate. Few rows (decode): flash-decoding, each split writes (m, l, acc)
partials and `_combine_kernel` merges them and applies the gate. Entries < 0, >= the
request's seq_len or at columns >= the count column are ignored; rows with none left are 0.
`AttentionLaunch` binds the launches once per (schedule, layer cache) (`launch.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_common import LOG2E, attend, dot_dtype, gated_store, launch_config, store_row
from .attention_prefill import PrefillAttentionLaunch, PrefillSchedule, plan_prefill_attention
from .launch import BoundLaunch, Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

_MAX_SPLITS = 64
# Programs per SM the decode split count aims at: 3 was fastest on the H200 at 128K B64 and 1M B4
# with 4 rows per request, see NOTES.md (Kernels). Measure: `python benchmarks/bench_qsa.py
# --only decode-131072-64-1-bf16 decode-1048576-4-4-bf16 --out DIR`.
_PROGRAMS_PER_SM = 3
# Rows above which the one-pass kernel already fills the GPU.
_SPLIT_MAX_ROWS = 128


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(do_not_specialize=["n_splits", "W"])
def _attn_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    n_splits, W, qk_scale, v_scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (rows, KV heads, splits). SPLIT off: out [T, HQ*D] directly. SPLIT on: partials
    ml fp32 [T, HQ, n_splits, 2] (m, l) and acc fp32 [T, HQ, n_splits, D]."""
    pdl_start(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    m, l, acc = attend(
        q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, row, kvh, split, n_splits, W, qk_scale,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_btr, stride_btp, stride_st, stride_sc,
        G, GP, D, DP, PAGE, BLOCK_N, DOT_DTYPE, INTERPRET,
    )
    if SPLIT:
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        heads = kvh * G + g
        slot = (row.to(tl.int64) * HQ + heads) * n_splits + split
        tl.store(part_ml_ptr + slot * 2, m, mask=g < G)
        tl.store(part_ml_ptr + slot * 2 + 1, l, mask=g < G)
        tl.store(part_acc_ptr + slot[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])
    else:
        store_row(acc, l, row, kvh, v_scale, gate_ptr, out_ptr, stride_gt, stride_gh, stride_ot, G, GP, D, DP)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(
    gate_ptr, out_ptr, part_ml_ptr, part_acc_ptr, n_splits, v_scale, stride_gt, stride_gh, stride_ot,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (rows, HQ): merge the splits' (m, l, acc) of one head, normalise, gate, store."""
    pdl_start(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    slot = (row.to(tl.int64) * HQ + head) * n_splits + sp
    m = tl.load(part_ml_ptr + slot * 2, mask=sp < n_splits, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=sp < n_splits, other=0.0)
    acc = tl.load(part_acc_ptr + slot[:, None] * D + d[None, :], mask=(sp < n_splits)[:, None] & (d < D)[None, :],
                  other=0.0)
    m_all = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty splits: weight 0
    l_all = tl.sum(w * l, 0)
    has_any = l_all > 0.0
    o = tl.sum(w[:, None] * acc, 0) / tl.where(has_any, l_all, 1.0) * v_scale
    mask = d < D
    g_off = row.to(tl.int64) * stride_gt + head * stride_gh + d
    o_off = row.to(tl.int64) * stride_ot + head * D + d
    gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)
    pdl_end(PDL)


def _num_splits(rows: int, kv_heads: int, width: int, block_n: int, device: torch.device) -> int:
    """Splits of the selection per (row, KV head): enough programs for about _PROGRAMS_PER_SM
    per SM when rows are few; 1 (one pass) when rows alone fill the GPU. The count is balanced so
    that a full row leaves no split empty (W 2051 in 64-column blocks: 33 splits of one
    block, or 17 of two, never 32 with 15 empty). Host ints only."""
    if rows > _SPLIT_MAX_ROWS:
        return 1
    want = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), max(rows, 1) * kv_heads)
    blocks = triton.cdiv(width, block_n)
    n = max(1, min(_MAX_SPLITS, blocks, want))
    return triton.cdiv(blocks, triton.cdiv(blocks, n))


def _split_block_n(dp: int, options: KernelOptions) -> int:
    """Columns per block of the split (decode) kernel, which the split count is planned in."""
    return launch_config(dp, True, 0, options.small_tiles)[0]


@dataclass(frozen=True)
class AttentionSchedule:
    """How one sparse-attention call runs, fixed when the step is planned.

    n_splits > 1: flash-decoding partials part_ml fp32 [T, Hq, n_splits, 2] and part_acc
    fp32 [T, Hq, n_splits, D] (views), merged by the combine kernel; else one pass.
    """

    num_rows: int
    n_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    options: KernelOptions
    part_ml: torch.Tensor | None
    part_acc: torch.Tensor | None
    prefill: PrefillSchedule | None = None  # its kernels run instead


def partials_size(max_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
                  device: torch.device | str, options: KernelOptions = DEFAULT) -> int:
    """Elements of part_acc any `plan_attention` with num_rows <= max_rows (and these options)
    needs (part_ml: 2 / head_dim of it)."""
    dev = torch.device(device)
    block_n = _split_block_n(triton.next_power_of_2(head_dim), options)
    most = 0
    for rows in range(1, min(max_rows, _SPLIT_MAX_ROWS) + 1):
        most = max(most, rows * _num_splits(rows, num_kv_heads, width, block_n, dev))
    return most * num_heads * head_dim


def plan_attention(
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    width: int,
    *,
    device: torch.device | str,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    compress_ratio: int | None = None,
    prefill_workspace: torch.Tensor | None = None,
    context: int = 0,
    options: KernelOptions = DEFAULT,
) -> AttentionSchedule:
    """Schedule of a sparse attention over num_rows rows of W = width selection columns.

    context: about the step's longest request in tokens (the planner's column bound x r; 0:
    unknown), which picks the one pass's launch shape (`attention_common.launch_config`).

    partials: flat fp32 (ml, acc) buffers of a workspace (`partials_size`), else allocated.
    With compress_ratio given, options.shared_prefill and at least
    options.shared_prefill_min_rows rows (one pass): the shared-tile prefill kernels
    (`attention_prefill.plan_prefill_attention`, on prefill_workspace if given).
    """
    dev = torch.device(device)
    dp = triton.next_power_of_2(head_dim)
    n_splits = _num_splits(num_rows, num_kv_heads, width, _split_block_n(dp, options), dev)
    block_n, num_warps, num_stages = launch_config(dp, n_splits > 1, context, options.small_tiles)
    part_ml = part_acc = None
    if n_splits > 1:
        n = num_rows * num_heads * n_splits
        if partials is None:
            partials = (torch.empty(n * 2, dtype=torch.float32, device=dev),
                        torch.empty(n * head_dim, dtype=torch.float32, device=dev))
        ml, acc = partials
        if ml.numel() < n * 2 or acc.numel() < n * head_dim:
            raise ValueError(f"attention partials hold {acc.numel()} < {n * head_dim} elements")
        part_ml = ml[: n * 2].view(num_rows, num_heads, n_splits, 2)
        part_acc = acc[: n * head_dim].view(num_rows, num_heads, n_splits, head_dim)
    prefill = None
    if (options.shared_prefill and compress_ratio is not None and n_splits == 1
            and num_rows >= options.shared_prefill_min_rows):
        prefill = plan_prefill_attention(num_rows, num_heads, num_kv_heads, head_dim, width, compress_ratio,
                                         device=dev, workspace=prefill_workspace, context=context, options=options)
    return AttentionSchedule(num_rows, n_splits, block_n, num_warps, num_stages, options, part_ml, part_acc, prefill)


_FREE = ("q_ptr", "gate_ptr", "bt_ptr", "req_ptr", "seq_ptr", "sel_ptr", "out_ptr", "stride_qt", "stride_qh",
         "stride_gt", "stride_gh", "stride_ot", "stride_btr", "stride_btp", "stride_st", "stride_sc")
_COMBINE_FREE = ("gate_ptr", "out_ptr", "stride_gt", "stride_gh", "stride_ot")


class AttentionLaunch:
    """The reference's `qsa_sparse_attention` as a launch bound once to a schedule, a layer's K/V cache and its scales
    (`qsa_kernels.launch`); `__call__(q, gate, block_table, token_to_req, seq_lens, selection,
    out)` relaunches with those tensors only (same shapes, any strides as in the op)."""

    def __init__(self, q: torch.Tensor, gate: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                 selection: torch.Tensor, *, softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 out: torch.Tensor, schedule: AttentionSchedule) -> None:
        T, Hq, D = q.shape
        _, page, Hkv, _ = k_cache.shape
        W = selection.shape[1] - 1
        if T != schedule.num_rows:
            raise ValueError(f"the attention schedule was planned for {schedule.num_rows} rows, got {T}")
        self.num_rows = T
        self._launches: list[tuple[BoundLaunch, bool]] = []  # (launch, combine: fewer free args)
        self._prefill = None
        if T == 0:
            return
        if schedule.prefill is not None:
            self._prefill = PrefillAttentionLaunch(
                q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, softmax_scale=softmax_scale,
                k_scale=k_scale, v_scale=v_scale, out=out, schedule=schedule.prefill)
            return
        G = Hq // Hkv
        DP = triton.next_power_of_2(D)
        n_splits = schedule.n_splits
        split = n_splits > 1
        part_ml, part_acc = (schedule.part_ml, schedule.part_acc) if split else (out, out)
        options = schedule.options
        common = dict(G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP, PAGE=page,
                      DOT_DTYPE=dot_dtype(q, k_cache, options.interpreter), INTERPRET=options.interpreter)
        qk_scale = softmax_scale * k_scale * LOG2E
        tensors = (q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, out)
        strides = (q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                   block_table.stride(0), block_table.stride(1), selection.stride(0), selection.stride(1))
        self._launches.append((_per_row.bind(
            (T, Hkv, n_splits), *tensors, part_ml, part_acc, n_splits, W, qk_scale, v_scale, *strides,
            free=_FREE, options=options, HQ=Hq, BLOCK_N=schedule.block_n, SPLIT=split,
            num_warps=schedule.num_warps, num_stages=schedule.num_stages, **common,
        ), False))
        if split:
            self._launches.append((_combine.bind(
                (T, Hq), gate, out, part_ml, part_acc, n_splits, v_scale, gate.stride(0), gate.stride(1),
                out.stride(0), free=_COMBINE_FREE, options=options, HQ=Hq, D=D, DP=DP, SP=max(2, triton.next_power_of_2(n_splits)),
            ), True))

    def __call__(self, q: torch.Tensor, gate: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                 seq_lens: torch.Tensor, selection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_rows or out.shape[0] != self.num_rows:
            raise ValueError(f"attention bound for {self.num_rows} rows, got q {tuple(q.shape)}, out {tuple(out.shape)}")
        if self._prefill is not None:
            return self._prefill(q, gate, block_table, token_to_req, seq_lens, selection, out)
        qs, gs, bs, ss, os = q.stride(), gate.stride(), block_table.stride(), selection.stride(), out.stride()
        for launch, combine in self._launches:
            if combine:
                launch(gate, out, gs[0], gs[1], os[0])
            else:
                launch(q, gate, block_table, token_to_req, seq_lens, selection, out, qs[0], qs[1], gs[0], gs[1], os[0],
                       bs[0], bs[1], ss[0], ss[1])
        return out


_per_row = Launcher(_attn_kernel)
_combine = Launcher(_combine_kernel)
