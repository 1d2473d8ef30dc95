"""vLLM 0.33.0's upstream QSA ops and its bundled FlashAttention-3 as peers, imported from an
installed vLLM GPU wheel (`bench_qsa.py peers --vllm`), on the benchmark's own caches.

Upstream's ops, called by module path the way its layer calls them
(`vllm/models/qwen4_exp/nvidia/indexer_qsa.py`, `QSAIndexer.forward`, and `qsa.py`,
`Qwen4ExpQSAFlashAttentionImpl.forward_qsa`):

- prepare: `ops.qsa_prepare.qsa_prepare`, its fused launch (index q norm + RoPE, group
  compression from this step's raw keys and its ring, the ring store, main q/k norm + RoPE, the
  gate copy and the K/V write), on the step's own projections. It writes into its own copies
  (VLLMPrepare): a ring laid out as its CircularBufferSpec (block b + 1 is request b's, block 0
  the null block), compact compressed-key and [pages, Hkv, page, 2D] K|V caches holding just
  this step's rows, so our caches stay as our prepare left them. Its `k_work_metadata` is built
  by its metadata builder's rule (`k_work_metadata`), its cos/sin table as its RotaryEmbedding
  builds one (fp32 angles, cast to the model dtype).
- scoring + top-k: `ops.qsa_indexer.qsa_select_paged_decode` (a request-major decode batch,
  `decode_query_len` rows per request: its Triton scoring packs rows x heads into one MMA) or
  `qsa_select_paged_prefill` (row chunks under VLLM_SPARSE_INDEXER_MAX_LOGITS_MB); both end in
  `torch.ops._C.cooperative_topk` (<= 64 rows on sm_90) or `persistent_topk`, writing group
  indices [T, budget / r];
- expansion: `ops.qsa_indexer.expand_qsa_block_indices` into the packed [T, W + 1] selection
  (count last: the core's layout, design.md §5);
- attention: `ops.qsa.qsa_sparse_paged_attention` (Triton split-K, sigmoid gate fused; decode
  config while the step's rows per request are <= 1 + MTP tokens, as `use_prefill_config`).

Upstream's compressed-key cache is [blocks, page / r, 1, Di] sharing the main block table (a
KV-cache spec with r tokens per state): the core's [pages, page / r, Di] with a unit head axis,
same block table. Its main K/V kernel takes any strides with a unit last stride: the core's
[pages, page, Hkv, D] K and V go in as they are. So no copy: the same bytes as ours.

FA3 dense: `vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3)` over the same paged K/V
(block table, `seqused_k`, causal aligned bottom-right: MTP row j of a request sees its prefix).
"""

from __future__ import annotations

import importlib
import types

import torch

from qsa_core.cache import ring_store_fuses

UPSTREAM = "vllm.models.qwen4_exp.nvidia.ops"


def load() -> types.SimpleNamespace:
    """vLLM's QSA op modules (raises naming what does not import). FA3 that cannot run here is
    recorded in `.missing["fa3"]` (and `.fa3` is None) instead of raising."""
    stable = importlib.import_module("vllm._C_stable_libtorch")  # registers torch.ops._C.*_topk
    absent = [op for op in ("cooperative_topk", "persistent_topk") if not hasattr(torch.ops._C, op)]
    if absent:
        raise ImportError(f"{stable.__file__} loaded but registers no torch.ops._C.{', '.join(absent)}")
    mods = types.SimpleNamespace(
        indexer=importlib.import_module(f"{UPSTREAM}.qsa_indexer"),
        attn=importlib.import_module(f"{UPSTREAM}.qsa"),
        prepare=importlib.import_module(f"{UPSTREAM}.qsa_prepare"),
        fa3=None, missing={},
    )
    try:
        fa = importlib.import_module("vllm.vllm_flash_attn")
        why = fa.fa_version_unsupported_reason(3)
        if why:
            mods.missing["fa3"] = why
        else:
            mods.fa3 = fa.flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - FA3's column records it; the QSA columns still run
        mods.missing["fa3"] = f"{type(e).__name__}: {e}"
    return mods


class VLLMStepInputs:
    """A benchmark step's data the way upstream's layer hands it to its ops (built once, views
    where the layouts agree). step: bench_qsa.Step; ratio, token_topk: the indexer's r and budget.

    q_idx [T, Hi, Di]; k_cache [pages, page / r, 1, Di]; page_table = block_table [B, pages per
    request] int32; visible [T] int32 complete groups a row sees ((pos + 1) // r); positions [T]
    int64; token_to_req [T] int32; query_start_loc [B + 1] int32; q, gate [T, Hq, D] contiguous;
    block_indices [T, budget / r] and packed [T, W + 1] int32 outputs."""

    def __init__(self, step, *, ratio: int, token_topk: int) -> None:
        self.step, self.ratio, self.token_topk = step, ratio, token_topk
        self.decode = step.decode
        self.rows, self.batch, self.context = step.rows, step.batch, step.context
        T = step.batch * step.rows
        dev = step.q.device
        self.q_idx = step.q_idx.contiguous()
        self.k_cache = step.cache.compressed.unsqueeze(2)
        self.page_table = step.block_table.contiguous()
        self.positions = step.meta.positions[:T].to(torch.int64)
        self.visible = ((self.positions + 1) // ratio).to(torch.int32)
        self.token_to_req = step.meta.token_to_req[:T].to(torch.int32).contiguous()
        self.query_start_loc = torch.arange(0, T + 1, step.rows, device=dev, dtype=torch.int32)
        self.q = step.q.contiguous()
        self.gate = step.gate.contiguous()
        self.k, self.v = step.cache.k, step.cache.v
        self.block_indices = torch.empty(T, token_topk // ratio, device=dev, dtype=torch.int32)
        self.packed_out = torch.empty(T, token_topk + ratio, device=dev, dtype=torch.int32)
        self.out = torch.empty_like(self.q)


class VLLMPath(VLLMStepInputs):
    """Upstream's indexer and attention on one benchmark step (inputs built once; launches only).
    `gated`: attention() returns the gated output (upstream fuses the gate)."""

    gated = True

    def __init__(self, mods, step, *, ratio: int, token_topk: int) -> None:
        super().__init__(step, ratio=ratio, token_topk=token_topk)
        self.m = mods
        # upstream: max_query_len > 1 + num_speculative_tokens; a decode case's rows are 1 + its MTP tokens
        self.use_prefill_config = not step.decode
        self.routes = self._routes()

    def _routes(self) -> dict[str, str]:
        rows = self.batch * self.rows if self.decode else min(self.batch * self.rows, self._prefill_chunk())
        coop = rows <= 64 and self.q.is_cuda and torch.cuda.get_device_capability(self.q.device) >= (9, 0)
        return {"scoring": "qsa_select_paged_decode (Triton, rows x heads in one MMA)" if self.decode
                else f"qsa_select_paged_prefill (Triton, row chunks of {self._prefill_chunk()})",
                "top-k": "torch.ops._C.cooperative_topk" if coop else "torch.ops._C.persistent_topk",
                "attention": "qsa_sparse_paged_attention (Triton split-K, gate fused, "
                f"{'prefill' if self.use_prefill_config else 'decode'} config)"}

    def _prefill_chunk(self) -> int:
        """Rows per prefill scoring chunk, as qsa_select_paged_prefill derives them."""
        import vllm.envs as envs

        groups = -(-self.context // self.ratio)
        width = min(max(64, -(-groups // 64) * 64), self.page_table.shape[1] * self.k_cache.shape[1])
        return max(1, envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024 // (width * 4))

    def select(self) -> torch.Tensor:
        """Scoring + top-k: group indices [T, budget / r] (self.block_indices)."""
        ix = self.m.indexer
        if self.decode:
            ix.qsa_select_paged_decode(self.q_idx, self.k_cache, self.page_table, self.visible, self.token_topk,
                                       self.ratio, self.rows, self.block_indices)
        else:
            ix.qsa_select_paged_prefill(self.q_idx, self.k_cache, self.page_table, self.query_start_loc, self.visible,
                                        self.token_topk, self.ratio, self.rows, self.block_indices, self.context)
        return self.block_indices

    def expand(self) -> torch.Tensor:
        self.m.indexer.expand_qsa_block_indices(self.block_indices, self.positions, self.visible, self.ratio,
                                                self.token_topk, self.packed_out)
        return self.packed_out

    def indexer(self) -> torch.Tensor:
        """Scoring, top-k and expansion: logical token indices [T, W] (valid first, -1 after)."""
        self.select()
        return self.expand()[:, :-1]

    def packed(self) -> torch.Tensor:
        return self.packed_out

    def attention(self) -> torch.Tensor:
        """Gated sparse attention over self.packed_out: [T, Hq, D] bf16."""
        return self.m.attn.qsa_sparse_paged_attention(self.q, self.k, self.v, self.packed_out, self.page_table,
                                                      self.token_to_req, self.use_prefill_config, self.out,
                                                      output_gate=self.gate)

    def full(self) -> torch.Tensor:
        self.indexer()
        return self.attention()


def k_work_metadata(batch: int, rows: int, context: int, ratio: int, device: torch.device) -> torch.Tensor:
    """Upstream's prepare work list for `batch` requests whose last `rows` tokens of `context`
    are this step's: one (request, item) per group the step closes, at least one per request
    (item 0 also stores the ring), as its metadata builder lays it out: int32 [n, 2]."""
    n = max(context // ratio - (context - rows) // ratio, 1)
    req = torch.arange(batch, device=device).repeat_interleave(n)
    return torch.stack([req, torch.arange(n, device=device).repeat(batch)], 1).to(torch.int32)


class VLLMPrepare:
    """Upstream's fused prepare on one step (inputs and its output caches built once).

    Reads the step's index_qk [T, (Hi + 1) Di] (q | raw key, upstream's split), q_gate / k / v
    as its fused main projection [T, (2 Hq + 2 Hkv) D] (per head q | gate, then K, then V), the
    step's norm weights (the `w` of 1 + w, as its GemmaRMSNorm) and the step's ring rows as
    history. Writes q_out [T, Hi, Di], q / gate [T, Hq, D] (returned), its ring `state`, its
    compressed rows `comp` [groups closed / 16 pages, 16, 1, Di] and `kv` [pages, page, Hkv, 2D]."""

    def __init__(self, mods, step, *, ratio: int, page_size: int) -> None:
        self.m, self.step, cfg, m = mods, step, step.cfg, step.meta
        T, B, rows, ctx = step.batch * step.rows, step.batch, step.rows, step.context
        dev = step.q.device
        Hi, Di, Hkv, D = cfg.index_n_heads, cfg.index_head_dim, cfg.num_kv_heads, cfg.head_dim
        self.q_in, self.k_in = step.index_qk[:, : Hi * Di], step.index_qk[:, Hi * Di:]
        self.positions = m.positions[:T].to(torch.int64)
        angles = torch.arange(ctx, device=dev, dtype=torch.float32)[:, None] * cfg.inv_freq().to(dev)[None, :]
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], 1).to(step.q.dtype).contiguous()  # [ctx, Rd]
        self.q_out = torch.empty(T, Hi, Di, device=dev, dtype=step.q_idx.dtype)
        ring = step.cache.ring
        C = ring.shape[1]
        if (ctx - rows) % ratio and not ring_store_fuses(rows, C, ratio):
            raise ValueError(f"rows={rows} at context {ctx}: the step starts inside a group and its ring stores "
                             f"(capacity {C}) replaced that group's earlier raw keys when our prepare ran; upstream's "
                             "prepare reads them from the ring")
        self.state = torch.cat([ring.new_zeros(1, C, Di), ring]).contiguous()
        self.state_table = torch.arange(1, B + 1, device=dev, dtype=torch.int32)[:, None]
        j = torch.arange(T, device=dev) % rows  # row within its request
        req = m.token_to_req[:T].long()
        self.state_slots = torch.where(j >= rows - C, (req + 1) * C + self.positions % C, -1)
        self.query_start_loc = torch.arange(0, T + 1, rows, device=dev, dtype=torch.int32)
        closing = (self.positions + 1) % ratio == 0
        per_page = page_size // ratio
        n_groups = int(closing.sum())
        self.comp = torch.zeros(n_groups // per_page + 1, per_page, 1, Di, device=dev, dtype=step.cache.compressed.dtype)
        self.comp_slots = torch.where(closing, closing.long().cumsum(0) - 1, -1)
        self.k_work = k_work_metadata(B, rows, ctx, ratio, dev)
        self.main_qkv = torch.cat([step.q_gate, step.k, step.v], 1).contiguous()
        self.kv = torch.zeros(T // page_size + 1, Hkv, page_size, 2 * D, device=dev, dtype=step.cache.k.dtype)
        self.kv_slots = torch.arange(T, device=dev, dtype=torch.int64)
        self.ratio, self.eps = ratio, cfg.rms_norm_eps

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.step.norms
        return self.m.prepare.qsa_prepare(
            self.q_in, self.k_in, self.positions, self.cos_sin, n.index_q, n.index_k, self.eps, self.q_out,
            self.state, self.state_slots, self.state_table, self.query_start_loc, self.positions, self.comp,
            self.comp_slots, self.k_work, compress_ratio=self.ratio, mrope_section=None, rope_pos_offset=None,
            main_qkv=self.main_qkv, main_q_norm_weight=n.q, main_k_norm_weight=n.k, main_eps=self.eps,
            main_kv_cache=self.kv.transpose(1, 2), main_slot_mapping=self.kv_slots, main_k_scale=1.0,
            main_v_scale=1.0)

    def errors(self, q: torch.Tensor, gate: torch.Tensor) -> dict[str, float]:
        """Each output of one call (q, gate: its return) against what our prepare left in the
        step (relative max error; raw keys, V and the gate are copies: 0 when right)."""
        step, m = self.step, self.step.meta
        T, D = q.shape[0], q.shape[-1]
        rel = _rel_error
        slots = m.slot_mapping[:T].long()
        k_ours, v_ours = step.cache.k.flatten(0, 1)[slots], step.cache.v.flatten(0, 1)[slots]
        kv = self.kv.transpose(1, 2).flatten(0, 1)[:T]
        closing = self.comp_slots >= 0
        if not torch.equal(closing, m.compressed_slot[:T] >= 0):
            raise AssertionError("the groups closing in this step differ from the ones our plan compresses")
        comp_ours = step.cache.compressed.flatten(0, 1)[m.compressed_slot[:T][closing].long()]
        comp = self.comp.flatten(0, 2)[: int(closing.sum())]
        kept = self.state_slots >= 0
        ring = self.state.flatten(0, 1)[self.state_slots[kept]]
        return {"q_idx": rel(self.q_out, step.q_idx), "q": rel(q, step.q), "gate": rel(gate, step.gate),
                "K": rel(kv[:, :, :D], k_ours), "V": rel(kv[:, :, D:], v_ours), "compressed": rel(comp, comp_ours),
                "ring": rel(ring, self.k_in[kept])}


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32 (0 for two empty tensors)."""
    if want.numel() == 0 and got.numel() == 0:
        return 0.0
    got, want = got.float().reshape(want.shape), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def fa3_dense(mods, step):
    """FA3 dense causal attention of every row of step over its whole prefix (ungated, [T, Hq, D]),
    on the same paged K/V, as a callable (raises naming why FA3 cannot run here)."""
    if mods.fa3 is None:
        raise RuntimeError(f"FA3 cannot run here: {mods.missing.get('fa3')}")
    q = step.q.contiguous()
    cu_q, seqused = dense_lengths(step.batch, step.rows, step.context, q.device)
    out = torch.empty_like(q)
    table, scale = step.block_table.contiguous(), step.cfg.softmax_scale

    def run() -> torch.Tensor:
        return mods.fa3(q, step.cache.k, step.cache.v, max_seqlen_q=step.rows, cu_seqlens_q=cu_q,
                        max_seqlen_k=step.context, seqused_k=seqused, softmax_scale=scale, causal=True,
                        block_table=table, out=out, fa_version=3)

    return run


def dense_lengths(batch: int, rows: int, context: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention varlen inputs for `batch` requests whose last `rows` tokens attend
    causally to their whole `context`: cu_seqlens_q [B + 1] and seqused_k [B] int32 (its causal
    mask is aligned bottom-right, so row j of a request sees context - rows + 1 + j keys)."""
    cu_q = torch.arange(0, batch * rows + 1, rows, device=device, dtype=torch.int32)
    return cu_q, torch.full((batch,), context, device=device, dtype=torch.int32)


def dense_reference(step, rows: list[int]) -> torch.Tensor:
    """fp32 dense causal attention (ungated) of the given rows over their whole prefix: [n, Hq, D]."""
    cfg, m = step.cfg, step.meta
    Hkv, D = step.cache.k.shape[-2:]
    out = []
    for r in rows:
        req, L = int(m.token_to_req[r]), int(m.positions[r]) + 1
        pages = step.block_table[req].long()
        k = step.cache.k[pages].reshape(-1, Hkv, D)[:L].float()
        v = step.cache.v[pages].reshape(-1, Hkv, D)[:L].float()
        q = step.q[r].float().view(Hkv, -1, D)  # query heads h * G .. h * G + G - 1 share KV head h
        p = torch.softmax(torch.einsum("hgd,lhd->hgl", q, k) * cfg.softmax_scale, -1)
        out.append(torch.einsum("hgl,lhd->hgd", p, v).reshape(-1, D))
        del k, v, p
    return torch.stack(out)
