"""SGLang 0.5.23's whole QSA path as a peer: its TileLang indexer scoring (`qsa/mqa.py`),
FlashInfer's `top_k_ragged_transform` (through SGLang's `qsa_fast_topk`), its expand
(`qsa/kernel.py`) and its Triton sparse attention (`qsa/sparse_attn.py`), on the benchmark's
caches. The three files are loaded by path from an installed SGLang (or a copy of just them),
without SGLang's import chain (which needs sgl_kernel and the serving stack):

- `sglang.srt.utils(.common).is_hip` and `sglang.srt.batch_invariant_ops.
  is_batch_invariant_mode_enabled` come from shim modules put into `sys.modules` (their only
  SGLang imports). The batch-invariant switch reads True only inside `qsa_fast_topk`: that is
  SGLang's FlashInfer top-k route (deterministic, ties to the smaller index); its default route
  for 512 blocks is its own JIT `fast_topk` (sglang.kernels), which is not carried. Everything
  else runs SGLang's default mode (the attention's launch table is its "H20" one on an H200:
  `"H20" in "NVIDIA H200"`).
- `import flashinfer.comm` (an optional all-reduce import at the top of mqa.py) is blocked:
  the benchmark never communicates and the NCCL wheels it needs are not carried.
- TileLang's prefill scoring kernels get `num_stages=1`: at SGLang's default 3 (and at 2) they
  fail in CUDA codegen on the H200 machine (TileLang 0.1.15, "Downcast from tirx.Sub to
  ir.IntImm failed").
- FlashInfer's top-k module must be prebuilt (`flashinfer/data/aot/topk/topk.so`): it is loaded
  with JIT disabled, so a missing module is an error here, not a 13-minute compile.

The calls mirror `QSAIndexer.select_decode_tokens` / `select_prefill_tokens` (its relative
prefill scoring, row-chunked under its 128 MiB logits budget) and its backend's attention
calls; on a CPU (the benchmark's dry run) SGLang's own torch fallbacks run instead.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

QSA_DIR = Path("sglang/srt/layers/attention/qsa")
FILES = ("mqa.py", "kernel.py", "sparse_attn.py")
LOGITS_BUDGET_BYTES = 128 * 1024 * 1024  # SGLang's prefill logits budget per row chunk


class _Switch:
    """The batch-invariant flag SGLang's files read; on only inside the top-k call."""

    on = False

    @classmethod
    def enabled(cls) -> bool:
        return cls.on


def _shim(name: str, **attrs) -> None:
    mod = sys.modules.get(name)
    if mod is None or getattr(mod, "__qsa_bench_shim__", False):
        mod = types.ModuleType(name)
        mod.__qsa_bench_shim__ = True
        mod.__path__ = []  # a package, so submodule shims resolve
        sys.modules[name] = mod
    for k, v in attrs.items():
        setattr(mod, k, v)


def _load(root: Path, fname: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"qsa_bench_sglang_{fname[:-3]}", root / QSA_DIR / fname)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def missing_files(root: Path) -> list[str]:
    return [str(QSA_DIR / f) for f in FILES if not (root / QSA_DIR / f).is_file()]


def _is_hip() -> bool:
    return False  # the benchmark runs CUDA (or the CPU dry run)


def load(root: Path) -> types.SimpleNamespace:
    """SGLang's QSA modules from `root` (a site-packages, or a folder with just the 3 files)."""
    if missing_files(root):
        raise FileNotFoundError(f"{root}: missing {missing_files(root)}")
    for name in ("sglang", "sglang.srt"):
        _shim(name)
    _shim("sglang.srt.utils", is_hip=_is_hip)
    _shim("sglang.srt.utils.common", is_hip=_is_hip)
    _shim("sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=_Switch.enabled)
    try:  # finish FlashInfer's own package import before one of its submodules is blocked
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    blocked = "flashinfer.comm" not in sys.modules
    if blocked:
        sys.modules["flashinfer.comm"] = None  # `import flashinfer.comm` raises ImportError
    try:
        mqa, kernel, sparse_attn = (_load(root, f) for f in FILES)
    finally:
        if blocked:
            del sys.modules["flashinfer.comm"]
    if mqa.HAS_TILELANG:
        for name in ("_tilelang_qsa_mqa_prefill_kernel", "_tilelang_qsa_mqa_prefill_relative_kernel"):
            setattr(mqa, name, functools.partial(getattr(mqa, name), num_stages=1))
    return types.SimpleNamespace(mqa=mqa, kernel=kernel, sa=sparse_attn)


def preload_flashinfer_topk() -> None:
    """Load FlashInfer's prebuilt top-k module now, JIT disabled (raises if it is not there)."""
    from flashinfer import topk

    old = os.environ.get("FLASHINFER_DISABLE_JIT")
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        topk.get_topk_module()
    finally:
        if old is None:
            del os.environ["FLASHINFER_DISABLE_JIT"]
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = old


def _topk(sg, logits, starts, lengths, k):
    _Switch.on = True
    try:
        return sg.kernel.qsa_fast_topk(logits, starts, lengths, topk=k)
    finally:
        _Switch.on = False


class SGLangStepInputs:
    """A benchmark step's inputs the way SGLang's QSA metadata holds them (built once): a
    token-slot table per request (`req_to_token`), each row's position, causal length
    (`row_seq`) and request (`row_req`), flat K/V views, and the indexer's inputs (decode: q_idx
    with heads padded to 8, the compressed-key cache as pages, per-row page tables and group
    counts; prefill: packed compressed-key slots with per-row [start, end) of each request's
    groups). The two SGLang paths (this module's and bench_sglang_cuda's) build on it."""

    def __init__(self, step, *, page_size: int, ratio: int, token_topk: int, softmax_scale: float) -> None:
        self.step = step
        self.ratio, self.token_topk, self.block_topk = ratio, token_topk, token_topk // ratio
        self.width = token_topk + ratio - 1
        self.scale = softmax_scale
        dev = step.q.device
        B, rows, ctx = step.batch, step.rows, step.context
        T = B * rows
        self.decode = step.decode
        i32 = dict(device=dev, dtype=torch.int32)
        table = step.block_table  # [B, pages per request]
        pos = torch.arange(ctx, device=dev)
        self.req_to_token = (table.long()[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)
        self.positions = step.meta.positions[:T].to(torch.int64)
        self.row_seq = (self.positions + 1).to(torch.int32)  # causal length per row
        self.row_req = step.meta.token_to_req[:T].long()
        groups = (self.row_seq // ratio).to(torch.int32)  # complete groups a row sees
        Hkv, D = step.cache.k.shape[-2:]
        self.k_flat = step.cache.k.view(-1, Hkv, D)
        self.v_flat = step.cache.v.view(-1, Hkv, D)
        self.q = step.q.contiguous()
        comp = step.cache.compressed  # [pages, page_size / r, Di]
        if self.decode:
            pad = (-step.q_idx.shape[1]) % 8  # SGLang's decode projection pads heads to 8
            qi = step.q_idx
            wide = qi.to(torch.bfloat16)  # exact for fp8; the padding is built in bf16
            self.q_idx = torch.cat([wide, wide.new_zeros(T, pad, qi.shape[2])], 1).to(qi.dtype) if pad else qi.contiguous()
            self.k_cache = comp.unsqueeze(2)  # [pages, 16, 1, Di]
            self.page_table = table.repeat_interleave(rows, 0).contiguous()  # full-KV page ids per row
            self.lengths = groups
            self.max_model_len = table.shape[1] * comp.shape[1]
        else:
            self.q_idx = step.q_idx.contiguous()
            self.comp_slots = comp.view(-1, 1, comp.shape[-1])  # [slots / r, 1, Di]
            blocks = torch.full((B,), ctx // ratio, **i32)
            self.cu_blocks = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)]).to(torch.int32)
            self.total_blocks, self.max_blocks = B * (ctx // ratio), ctx // ratio
            self.row_starts = self.cu_blocks[self.row_req].contiguous()
            self.row_ends = (self.row_starts + groups).contiguous()


class SGLangPath(SGLangStepInputs):
    """SGLang's indexer and attention for one benchmark step (built once, then launch-only).

    step: the benchmark's Step (caches, block table, prepared q_idx / q); inputs are derived
    here the way SGLang's metadata holds them (a token-slot table per request, per-row
    compressed page tables and lengths for decode, packed compressed keys for prefill).
    """

    def __init__(self, sg, step, *, page_size: int, ratio: int, token_topk: int, softmax_scale: float) -> None:
        super().__init__(step, page_size=page_size, ratio=ratio, token_topk=token_topk, softmax_scale=softmax_scale)
        self.sg = sg
        dev = step.q.device
        B, rows, ctx = step.batch, step.rows, step.context
        T = B * rows
        i32 = dict(device=dev, dtype=torch.int32)
        Hkv, D = step.cache.k.shape[-2:]
        self.seq = torch.full((B,), ctx, **i32)
        if not self.decode:
            block_q = max(1, 128 // self.q_idx.shape[1])
            per = max(block_q, LOGITS_BUDGET_BYTES // (self.max_blocks * 4))
            self.chunk = min(T, max(block_q, per // block_q * block_q))
        self.selection = torch.empty(T, self.width, **i32)
        if self.decode and rows == 1:
            self.counts = torch.empty(B, **i32)
            self.cu_k = torch.empty(B + 1, **i32)
            self.cu_q = torch.arange(B + 1, **i32)
            self.pk = torch.empty(B * self.width, Hkv, D, device=dev, dtype=step.cache.k.dtype)
            self.pv = torch.empty_like(self.pk)
            self.rel = torch.arange(self.width, **i32).expand(B, -1).contiguous()
            self.req_idx = torch.arange(B, **i32)
        else:
            self.cu_q = torch.arange(0, T + 1, rows, **i32)

    def indexer(self) -> torch.Tensor:
        """Scoring, top-k and expansion: logical token indices [T, W] (valid first, -1 after)."""
        sg, k = self.sg, self.block_topk
        if self.decode:
            logits = sg.mqa.qsa_mqa_decode(self.q_idx, self.k_cache, self.page_table, self.lengths, self.max_model_len)
            blocks = _topk(sg, logits, torch.zeros_like(self.lengths), self.lengths, k)
            sel = sg.kernel.expand_qsa_block_indices(blocks, self.positions, self.row_seq, self.ratio, self.token_topk)
            self.selection.copy_(sel)
            return self.selection
        if self.q_idx.is_cuda:
            keys = sg.kernel.gather_qsa_compressed_keys(self.comp_slots, self.req_to_token, self.cu_blocks,
                                                        self.total_blocks, self.max_blocks, self.ratio)
        else:  # the dry run: its gather is Triton-only; the same rows by torch indexing
            first = self.req_to_token[:, :: self.ratio][:, : self.max_blocks].long() // self.ratio
            keys = self.comp_slots[first.reshape(-1)]
        relative = self.q_idx.is_cuda and sg.mqa.HAS_TILELANG
        T = self.q_idx.shape[0]
        for a in range(0, T, self.chunk):
            b = min(a + self.chunk, T)
            starts, ends = self.row_starts[a:b], self.row_ends[a:b]
            if relative:
                logits = sg.mqa.qsa_mqa_prefill_relative(self.q_idx[a:b], keys, starts, ends, self.max_blocks)
                blocks = _topk(sg, logits, torch.zeros_like(starts), ends - starts, k)
            else:
                logits = sg.mqa.qsa_mqa_prefill(self.q_idx[a:b], keys, starts, ends)
                blocks = _topk(sg, logits, starts, ends, k)
            sel = sg.kernel.expand_qsa_block_indices(blocks, self.positions[a:b], self.row_seq[a:b], self.ratio,
                                                     self.token_topk)
            self.selection[a:b].copy_(sel)
        return self.selection

    def attention(self) -> torch.Tensor:
        """SGLang's Triton sparse attention on self.selection: decode gathers the chosen K/V
        into scratch and runs its packed kernel (its path where FlashAttention's varlen kernel
        is absent); several rows per request (MTP) and prefill use its paged chunk kernel."""
        sa, B, idx = self.sg.sa, self.step.batch, self.selection
        if self.decode and self.step.rows == 1:
            sa.qwen_sparse_fa2_cu_seqlens_triton(self.seq, idx, self.counts, self.cu_k, B, self.width)
            sa.qwen_sparse_kv_extraction_compact_triton(self.k_flat, self.v_flat, self.req_to_token, self.req_idx, idx,
                                                         self.seq, self.cu_k, self.pk, self.pv, B, self.width)
            return sa.sparse_gqa_packed_decode_triton(self.q, self.pk, self.pv, self.rel, self.cu_q, self.cu_k,
                                                      self.counts, self.scale)
        return sa.sparse_gqa_paged_prefill_triton(self.q, self.k_flat, self.v_flat, self.req_to_token, idx, self.cu_q,
                                                  self.seq, self.scale, max_q=self.step.rows)

    def full(self) -> torch.Tensor:
        self.indexer()
        return self.attention()

    def packed(self) -> torch.Tensor:
        """self.selection in the core's packed layout [T, W + 1] (count last), for the reference."""
        sel = self.selection
        count = (sel >= 0).sum(1, dtype=torch.int32)
        return torch.cat([sel, count[:, None]], 1)
