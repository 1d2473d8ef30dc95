"""SGLang 0.5.23's default CUDA QSA path as a peer, imported from an installed SGLang (its own
stack: torch 2.14.1, triton 3.8, sglang-kernel, flash-attn-4), on the benchmark's caches.

- indexer: `QSAIndexer.select_decode_tokens` / `select_prefill_tokens`, SGLang's own methods,
  called on the benchmark's inputs laid out as SGLang's metadata holds them (a token-slot table
  per request; decode: full-KV page ids per row and compressed lengths; prefill: the packed
  compressed keys of `gather_qsa_compressed_keys` and per-row ranges). Its scoring is
  `qsa/mqa.py` (TileLang where importable, else SGLang's own torch fallback: `routes` says which),
  its top-k for 512 blocks the JIT `sglang.kernels.ops.attention.fast_topk` (decode directly,
  with `min_scored_len` 512; prefill through `qsa_fast_topk`), its expansion Triton. Where
  `qsa_indexer` does not import, the same steps are called from `kernel.py` / `mqa.py` and
  `routes` says so.
- attention, decode: `QwenSparseAttnBackend._forward_paged_attention`'s route on a GPU without
  trtllm-gen (Hopper): valid counts + cu_seqlens and the K/V compaction into a scratch buffer
  (Triton), then `flash_attn_varlen_func` as `_resolve_flash_attn_varlen_func` picks it (FA2
  where installed, else flash-attn-4's cute interface); buffers static, as under its CUDA graphs.
  Prefill: `forward_extend`'s CUDA route: `sparse_gqa_fwd_interface_triton` on the chunk's own
  K/V when nothing precedes it, else `pack_qsa_prefill_kv` + `sparse_gqa_fwd_interface_triton_ck`
  (given `max_q`, which SGLang reads back with `.item()`: a graph cannot). Its output is ungated
  (the gate is the model layer's).
- `sgl_kernel.top_k.fast_topk_v2` on the same logits, where that build serves k = 512.

On a CPU (the dry run) SGLang's own CPU routes run: torch scoring, the CPU `qsa_fast_topk`,
torch expansion, and the backend's `qsa_sparse_attention` over physical slots.
"""

from __future__ import annotations

import functools
import importlib
import types

import torch
from bench_sglang import SGLangStepInputs

QSA = "sglang.srt.layers.attention.qsa"


def load() -> types.SimpleNamespace:
    """SGLang's modules (raises ImportError naming what is missing). Optional parts that do
    not import are recorded in `.missing` (name -> error) instead of raising."""
    mods = types.SimpleNamespace(
        mqa=importlib.import_module(f"{QSA}.mqa"),
        kernel=importlib.import_module(f"{QSA}.kernel"),
        sa=importlib.import_module(f"{QSA}.sparse_attn"),
        indexer=None, fast_topk=None, varlen=None, topk_v2=None, missing={},
    )
    try:
        mods.indexer = importlib.import_module(f"{QSA}.qsa_indexer").QSAIndexer
    except Exception as e:  # noqa: BLE001 - its import chain is the serving stack's; the steps still run
        mods.missing["qsa_indexer"] = f"{type(e).__name__}: {e}"
    if torch.cuda.is_available():
        try:
            mods.fast_topk = importlib.import_module("sglang.kernels.ops.attention.fast_topk").fast_topk
        except Exception as e:  # noqa: BLE001
            mods.missing["fast_topk"] = f"{type(e).__name__}: {e}"
        mods.varlen = resolve_varlen(mods.missing)
        try:
            top_k = importlib.import_module("sgl_kernel.top_k")
            supported = tuple(getattr(top_k, "_FAST_TOPK_SUPPORTED_K", (2048,)))
            if 512 in supported:
                mods.topk_v2 = top_k.fast_topk_v2
            else:
                mods.missing["fast_topk_v2"] = f"not applicable: sgl_kernel.top_k serves k in {supported}, not 512"
        except Exception as e:  # noqa: BLE001
            mods.missing["fast_topk_v2"] = f"{type(e).__name__}: {e}"
    return mods


PREFILL_KERNELS = ("_tilelang_qsa_mqa_prefill_kernel", "_tilelang_qsa_mqa_prefill_relative_kernel")


def single_stage_prefill(mods) -> bool:
    """Rebuild SGLang's TileLang prefill scoring kernels with num_stages=1 (once; False when
    already done or without TileLang). At its default 3 (and at 2) TileLang 0.1.15 failed in CUDA
    codegen on the H200 machine ("Downcast from tirx.Sub to ir.IntImm failed"; bench_sglang.py)."""
    mqa = mods.mqa
    if not mqa.HAS_TILELANG or getattr(mqa, "_qsa_bench_single_stage", False):
        return False
    for name in PREFILL_KERNELS:
        setattr(mqa, name, functools.partial(getattr(mqa, name), num_stages=1))
    mqa._qsa_bench_single_stage = True
    return True


def resolve_varlen(missing: dict[str, str]):
    """The varlen attention SGLang's backend resolves (its `_resolve_flash_attn_varlen_func`);
    where the backend module does not import, the same order: FA2, then flash-attn-4's cute."""
    try:
        backend = importlib.import_module("sglang.srt.layers.attention.qwen_sparse_attn_backend")
        return backend._resolve_flash_attn_varlen_func()
    except Exception as e:  # noqa: BLE001
        missing["qwen_sparse_attn_backend"] = f"{type(e).__name__}: {e}"
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    except ImportError:
        pass
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func as cute
    except Exception as e:  # noqa: BLE001
        missing["flash_attn_varlen_func"] = f"{type(e).__name__}: {e}"
        return None

    def varlen(*args, **kwargs):
        out = cute(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return varlen


def varlen_name(fn) -> str:
    mod = getattr(fn, "__module__", "") or ""
    cute = "cute" in mod or "qwen_sparse" in mod or mod == __name__  # the backend's wrapper, or ours of it
    return "flash-attn-4 cute varlen" if cute else f"{mod}.{fn.__name__}"


class SGLangCudaPath(SGLangStepInputs):
    """SGLang's indexer and attention for one benchmark step (inputs built once; then launches).

    step: bench_qsa.Step (caches, block table, prepared q_idx / q / k). `selection` [T, W] int32
    holds the last `indexer()` output (logical token indices, valid first, -1 after)."""

    def __init__(self, mods, step, *, page_size: int, ratio: int, token_topk: int, softmax_scale: float) -> None:
        super().__init__(step, page_size=page_size, ratio=ratio, token_topk=token_topk, softmax_scale=softmax_scale)
        self.m = mods
        self.cuda = step.q.is_cuda
        dev = step.q.device
        B, rows, ctx = step.batch, step.rows, step.context
        T = B * rows
        i32 = dict(device=dev, dtype=torch.int32)
        Hkv, D = step.cache.k.shape[-2:]
        # the sequence length SGLang's metadata gives each row: decode rows their own, prefill rows their request's
        self.seq_rows = self.row_seq if self.decode else torch.full((T,), ctx, **i32)
        # SGLang's own methods read only these attributes of the indexer
        self.ns = types.SimpleNamespace(token_topk=token_topk, compress_ratio=ratio, block_topk=self.block_topk)
        self.selection = torch.full((T, self.width), -1, **i32)
        if self.decode:
            self.counts = torch.empty(T, **i32)
            self.cu_k = torch.empty(T + 1, **i32)
            self.cu_q = torch.arange(T + 1, **i32)
            # zeroed once, as SGLang's scratch
            self.pk = torch.zeros(T * self.width, Hkv, D, device=dev, dtype=step.cache.k.dtype)
            self.pv = torch.zeros_like(self.pk)
        else:
            self.cu_q = torch.arange(0, T + 1, rows, **i32)
            self.seq = torch.full((B,), ctx, **i32)
            self.cu_k = torch.arange(0, B * ctx + 1, ctx, **i32)
            self.req_idx = torch.arange(B, device=dev, dtype=torch.int64)
            self.prefix = ctx > rows
            if not self.prefix:  # the chunk's own K/V rows, as the layer hands them to forward_extend
                self.k_new = self.k_flat[self.req_to_token.reshape(-1).long()].contiguous()
                self.v_new = self.v_flat[self.req_to_token.reshape(-1).long()].contiguous()
        self.routes = self._routes()

    def _routes(self) -> dict[str, str]:
        m = self.m
        scoring = "TileLang" if self.cuda and m.mqa.HAS_TILELANG else "torch fallback (mqa.torch_qsa_mqa_*)"
        if not self.decode and getattr(m.mqa, "_qsa_bench_single_stage", False):
            scoring += " (prefill kernels at num_stages=1, not SGLang's default)"
        r = {"scoring": scoring,
             "orchestration": "QSAIndexer.select_*_tokens" if m.indexer is not None
             else "kernel.py / mqa.py steps (qsa_indexer does not import: " + m.missing.get("qsa_indexer", "") + ")"}
        if self.cuda:
            r["top-k"] = "JIT fast_topk (sglang.kernels)"
            if self.decode:
                r["attention"] = "Triton compaction + " + (varlen_name(m.varlen) if m.varlen else "no varlen kernel")
            else:
                r["attention"] = ("pack_qsa_prefill_kv + sparse_gqa_fwd_interface_triton_ck" if self.prefix
                                  else "sparse_gqa_fwd_interface_triton")
        else:
            r["top-k"], r["attention"] = "CPU qsa_fast_topk", "qsa_sparse_attention (CPU)"
        return r

    # -- indexer --

    def _fast_decode(self) -> bool:
        from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

        return self.cuda and self.block_topk == 512 and not is_batch_invariant_mode_enabled()

    def _keys(self) -> torch.Tensor:
        """Every request's compressed keys, packed (SGLang's get_prefill_mqa_inputs)."""
        if self.cuda:
            return self.m.kernel.gather_qsa_compressed_keys(self.comp_slots, self.req_to_token, self.cu_blocks,
                                                            self.total_blocks, self.max_blocks, self.ratio)
        first = self.req_to_token[:, :: self.ratio][:, : self.max_blocks].long() // self.ratio  # its gather is Triton
        return self.comp_slots[first.reshape(-1)]

    def select(self) -> torch.Tensor:
        """SGLang's selection: logical token indices [T, W] (a new tensor)."""
        ix = self.m.indexer
        if self.decode:
            args = (self.q_idx, self.k_cache, self.page_table, self.lengths, self.max_model_len, self.positions,
                    self.seq_rows)
            if ix is not None:
                return ix.select_decode_tokens(self.ns, *args)
            blocks = self.topk(self.score())[0]
        else:
            keys = self._keys()
            if ix is not None:
                return ix.select_prefill_tokens(self.ns, self.q_idx, keys, self.row_starts, self.row_ends,
                                                self.positions, self.seq_rows, max_row_keys=self.max_blocks)
            blocks = torch.cat(self.topk(self.score(keys)))
        return self.m.kernel.expand_qsa_block_indices(blocks, self.positions, self.seq_rows, self.ratio, self.token_topk)

    def indexer(self) -> torch.Tensor:
        self.selection.copy_(self.select())
        return self.selection

    def _relative(self) -> bool:
        return self.cuda and self.m.mqa.HAS_TILELANG

    def chunks(self) -> list[tuple[int, int]]:
        """Row chunks of SGLang's prefill scoring (its 128 MiB logits budget)."""
        T = self.q_idx.shape[0]
        if self.decode:
            return [(0, T)]
        from_keys = self.max_blocks if self._relative() else self.total_blocks
        block_q = max(1, 128 // self.q_idx.shape[1])
        per = max(block_q, (128 << 20) // (from_keys * 4))
        size = min(T, max(block_q, per // block_q * block_q))
        return [(a, min(a + size, T)) for a in range(0, T, size)]

    def score(self, keys: torch.Tensor | None = None) -> list[torch.Tensor]:
        """SGLang's logits, one fp32 tensor per row chunk (decode: one)."""
        mqa = self.m.mqa
        if self.decode:
            return [mqa.qsa_mqa_decode(self.q_idx, self.k_cache, self.page_table, self.lengths, self.max_model_len,
                                       min_scored_len=self.block_topk if self._fast_decode() else 0)]
        keys = self._keys() if keys is None else keys
        out = []
        for a, b in self.chunks():
            if self._relative():
                out.append(mqa.qsa_mqa_prefill_relative(self.q_idx[a:b], keys, self.row_starts[a:b],
                                                        self.row_ends[a:b], self.max_blocks))
            else:
                out.append(mqa.qsa_mqa_prefill(self.q_idx[a:b], keys, self.row_starts[a:b], self.row_ends[a:b]))
        return out

    def topk(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """SGLang's top-k on score()'s logits: block indices [rows, 512] per chunk, relative to
        each row's first group (= group indices), -1 after a short row's groups."""
        if self.decode:
            if self._fast_decode():
                if self.m.fast_topk is None:
                    raise RuntimeError(f"no JIT fast_topk: {self.m.missing.get('fast_topk')}")
                return [self.m.fast_topk(logits[0], self.lengths, topk=self.block_topk, row_starts=None)]
            return [self.m.kernel.qsa_fast_topk(logits[0], torch.zeros_like(self.lengths), self.lengths,
                                                topk=self.block_topk)]
        out = []
        for (a, b), lg in zip(self.chunks(), logits):
            starts, ends = self.row_starts[a:b], self.row_ends[a:b]
            if self._relative():
                out.append(self.m.kernel.qsa_fast_topk(lg, torch.zeros_like(starts), ends - starts, topk=self.block_topk))
            else:
                out.append(self.m.kernel.qsa_fast_topk(lg, starts, ends, topk=self.block_topk))
        return out

    def topk_v2(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """sgl_kernel's fast_topk_v2 on the same logits (relative indices, as topk())."""
        if self.decode:
            return [self.m.topk_v2(logits[0], self.lengths, self.block_topk)]
        out = []
        for (a, b), lg in zip(self.chunks(), logits):
            starts, ends = self.row_starts[a:b], self.row_ends[a:b]
            if self._relative():
                out.append(self.m.topk_v2(lg, ends - starts, self.block_topk, torch.zeros_like(starts)))
            else:
                out.append(self.m.topk_v2(lg, ends - starts, self.block_topk, starts))
        return out

    # -- attention --

    def attend(self, idx: torch.Tensor) -> torch.Tensor:
        """SGLang's sparse attention of every row over idx [T, W] (ungated): [T, Hq, D]."""
        sa, T, W = self.m.sa, idx.shape[0], idx.shape[1]
        if not self.cuda:  # the backend's CPU route: logical -> physical slots, then its reference
            valid = (idx >= 0) & (idx < self.seq_rows[:, None])
            slots = self.req_to_token[self.row_req[:, None], idx.clamp(0, self.req_to_token.shape[1] - 1).long()]
            slots = torch.where(valid, slots, torch.full_like(slots, -1))
            return self.m.kernel.qsa_sparse_attention(self.q, self.k_flat, self.v_flat, slots, self.scale)
        if self.decode:
            if self.m.varlen is None:
                raise RuntimeError("no varlen attention: " + "; ".join(
                    f"{k}: {v}" for k, v in self.m.missing.items() if k in ("qwen_sparse_attn_backend", "flash_attn_varlen_func")))
            sa.qwen_sparse_fa2_cu_seqlens_triton(self.row_seq, idx, self.counts, self.cu_k, T, W)
            sa.qwen_sparse_kv_extraction_compact_triton(self.k_flat, self.v_flat, self.req_to_token, self.row_req, idx,
                                                         self.row_seq, self.cu_k, self.pk, self.pv, T, W)
            return self.m.varlen(q=self.q, k=self.pk, v=self.pv, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                                 max_seqlen_q=1, max_seqlen_k=W, softmax_scale=self.scale, causal=True)
        if not self.prefix:
            return sa.sparse_gqa_fwd_interface_triton(self.q, self.k_new, self.v_new, self.step.context, idx, self.cu_q,
                                                      self.scale)
        B, ctx = self.step.batch, self.step.context
        pk, pv = sa.pack_qsa_prefill_kv(k=self.k_flat, v=self.v_flat, req_to_token=self.req_to_token,
                                        req_indices=self.req_idx, cu_k=self.cu_k, total_k=B * ctx, max_k=ctx,
                                        output_dtype=self.q.dtype)
        return sa.sparse_gqa_fwd_interface_triton_ck(self.q, pk, pv, idx, self.cu_q, self.cu_k, self.seq, self.scale,
                                                     max_q=self.step.rows)

    def attention(self) -> torch.Tensor:
        return self.attend(self.selection)

    def full(self) -> torch.Tensor:
        return self.attend(self.select())

    def packed(self) -> torch.Tensor:
        """selection in the core's packed layout [T, W + 1] (count last), for the reference."""
        sel = self.selection
        return torch.cat([sel, (sel >= 0).sum(1, dtype=torch.int32)[:, None]], 1)
