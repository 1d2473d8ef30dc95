"""L2 warm of the attention's K/V by the decode top-k.

A decode step is a chain of latency-bound launches over cold caches (the other layers evict
this layer's data): the attention's K/V gathers wait on DRAM. On the per-row-samples decode
route (`select_prefill`, tile `row_s`), a row's segment programs compact their candidates (a
superset of the row's choice) and only the last to arrive resolves the row; the others then
issue `cp.async.bulk.prefetch.L2` (sm_90's bulk copy engine: one instruction a contiguous run,
no registers, no value, no wait) for their candidates' K and V rows, off the step's critical
path, so those DRAM reads overlap the resolve and the attention's launch (a faster attention
and step on the H200, see NOTES.md (Kernels)).

A hint changes no value anywhere: outputs are bit-equal with it on or off
(`KernelOptions.l2_warm`, read at binding). Only compiled kernels on sm_90+ issue it.
Tried and dropped (NOTES.md (Kernels), Tried and not landed): prepare warming the score
launch's first keys (prepare grew by about what the score launch gained: no consistent gain on
top of this warm), and the decode attention warming its V rows before loading K and the
combine's gate rows (slower everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .options import DEFAULT, KernelOptions

# The top-k warms the attention's K/V only where the step's chosen groups' K and V take at most
# this: beyond a fraction of the H200's 60 MB L2 the lines are evicted before the attention reads
# them (bf16, D 256, Hkv 2: up to 5 rows; MTP rows and large batches stay cold).
KV_WARM_BYTES = 24 << 20


@triton.jit
def l2_warm(ptr, nbytes, mask):
    """Hint: bring nbytes (int32, a multiple of 16) from ptr into L2, for each element where
    mask holds and ptr is 16-byte aligned (the bulk prefetch's rule; others are skipped).
    Tensors of one shape; an element the layout replicates is hinted twice."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 a; and.b64 a, $1, 15; setp.eq.u64 p, a, 0; setp.ne.and.b32 p, $3, 0, p;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; }\n\tmov.u32 $0, 0;",
        "=r,l,r,r", [ptr, nbytes, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def warm_kv_groups(groups, mask, req, bt_ptr, stride_btr, stride_btp, kc_ptr, vc_ptr, stride_kp, stride_ks, stride_vp,
                   stride_vs, PAGE: tl.constexpr, R: tl.constexpr, K_BYTES: tl.constexpr, V_BYTES: tl.constexpr):
    """L2 hint of the K and V rows of groups [N] (int32, where mask) of request req, through
    its block table row: K_BYTES from each group's first K row (its R tokens, all KV heads,
    contiguous), and V_BYTES from its first V row (0: K's run holds V too)."""
    tok = groups * R
    page = tl.load(bt_ptr + req.to(tl.int64) * stride_btr + (tok // PAGE) * stride_btp, mask=mask, other=-1)
    ok = mask & (page >= 0)
    row = (tok % PAGE).to(tl.int64)
    l2_warm(kc_ptr + page.to(tl.int64) * stride_kp + row * stride_ks, tl.zeros_like(groups) + K_BYTES, ok)
    if V_BYTES:
        l2_warm(vc_ptr + page.to(tl.int64) * stride_vp + row * stride_vs, tl.zeros_like(groups) + V_BYTES, ok)


@dataclass(frozen=True)
class KVWarm:
    """What a decode top-k launch binds to warm the attention's K/V (`warm_kv_groups`): the
    layer's K / V caches [pages, page_size, Hkv, D], token_to_req int32 [T] and the bytes of
    a group's K and V runs (`kv_warm`); the block table comes per call (`args`)."""

    k: torch.Tensor
    v: torch.Tensor
    token_to_req: torch.Tensor
    k_bytes: int
    v_bytes: int

    def args(self, block_table: torch.Tensor) -> tuple:
        """The kernels' (req, bt, its strides, K, V, their page and token strides)."""
        k, v = self.k, self.v
        return (self.token_to_req, block_table, block_table.stride(0), block_table.stride(1), k, v, k.stride(0),
                k.stride(1), v.stride(0), v.stride(1))


def warm_enabled(device: torch.device, options: KernelOptions = DEFAULT) -> bool:
    """Whether launches bound now on `device` issue the K/V warm: `options.l2_warm`, Triton
    compiles (not `options.interpreter`) and the device is a CUDA GPU of capability >= 9."""
    return (options.l2_warm and not options.interpreter and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def kv_warm(k: torch.Tensor, v: torch.Tensor, token_to_req: torch.Tensor, compress_ratio: int, rows: int,
            block_topk: int, options: KernelOptions = DEFAULT) -> KVWarm | None:
    """The `KV` warm of a decode top-k over `rows` rows, or None: off (`warm_enabled`), more
    than KV_WARM_BYTES of chosen K and V, or a layout where a group's rows are not contiguous.
    Two layouts warm: K and V each [pages, page, Hkv, D] contiguous (a run each), and one
    [pages, page, Hkv, 2D] buffer with K its first D and V its last (`QSACacheLayout`: one run)."""
    _, page, hkv, d = k.shape
    size = k.element_size()
    run = compress_ratio * hkv * d * size  # one group's K (or V) rows
    same = k.stride() == v.stride() and k.stride(3) == 1
    separate = same and k.stride(2) == d and k.stride(1) == hkv * d
    paired = same and k.stride(2) == 2 * d and k.stride(1) == 2 * hkv * d and v.data_ptr() == k.data_ptr() + d * size
    if (not warm_enabled(k.device, options) or not (separate or paired) or page % compress_ratio or run % 16
            or 2 * rows * block_topk * run > KV_WARM_BYTES):
        return None
    return KVWarm(k, v, token_to_req, run, run) if separate else KVWarm(k, v, token_to_req, 2 * run, 0)
