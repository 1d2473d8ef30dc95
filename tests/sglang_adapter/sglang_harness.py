"""Real SGLang 0.5.23 objects on the CPU for the adapter tests.

`Env` owns a real `ReqToTokenPool`, `QSATokenToKVPool` (page 64) and paged allocator, a real
`Qwen4ExpAttentionDecoderLayer` whose weights are those of an HF `Qwen4ExpTextAttention`, and
the `qsa_core` backend built by SGLang's registry. It builds `ForwardBatch` objects the way
the scheduler fills them and runs the layer's `self_attention` under a forward context.
"""

from __future__ import annotations

import functools
import types

import torch
from hf_oracle import TINY
from sglang.srt import runtime_context
from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

PAGE = 64
BUDGET = 2048  # the production budget (SGLang's QSA accepts only budget / r of 512 or 2048)
ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


def ensure_plugin() -> None:
    """Load SGLang's plugins (ours through its entry point), as every scheduler process does."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert "qsa_core" in ATTENTION_BACKENDS, "the sglang.srt.plugins entry point did not register qsa_core"


@functools.cache
def publish_cpu_context() -> None:
    """What a scheduler process publishes before building a model (TP 1, CPU device); once."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--device", "cpu"])
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    # o_proj asks the TP group for its size only (world size 1: no collective runs).
    runtime_context.get_parallel().override_permanently(tp_group=types.SimpleNamespace(world_size=1, rank_in_group=0))
    # RotaryEmbedding wants vllm's CUDA ops unless it believes it runs on a CPU build of
    # SGLang (the layer's own RoPE is not used by qsa_core; it only has to construct).
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True


def sglang_config(mrope_section: list[int] | None = None, **overrides) -> Qwen4ExpTextConfig:
    """SGLang's Qwen4-Exp text config: the HF oracle's tiny geometry at the production budget."""
    rope = dict(ROPE)
    if mrope_section is not None:
        rope.update(mrope_section=list(mrope_section), mrope_interleaved=True)
    fields = {**TINY, "full_attention_interval": 4, "indexer_budget": BUDGET, **overrides}
    return Qwen4ExpTextConfig(**fields, rope_parameters=rope)


def sglang_layer(hf_attn, layer_id: int, dtype: torch.dtype, mrope_section: list[int] | None = None):
    """A real Qwen4ExpAttentionDecoderLayer carrying the HF layer's weights."""
    from sglang.srt.layers.layer_boundary.factories import layer_stack
    from sglang.srt.models.qwen4_exp import Qwen4ExpAttentionDecoderLayer

    publish_cpu_context()
    with layer_stack():  # the decoder stack a model builds its layers in
        layer = Qwen4ExpAttentionDecoderLayer(sglang_config(mrope_section), layer_id)
    sd = hf_attn.state_dict()
    with torch.no_grad():
        layer.qkv_proj.weight.copy_(torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]))
        layer.o_proj.weight.copy_(sd["o_proj.weight"])
        for name in ("q_norm", "k_norm"):
            getattr(layer, name).weight.copy_(sd[f"{name}.weight"])
        for name in ("index_qk_proj", "q_layernorm", "k_layernorm"):
            getattr(layer.indexer, name).weight.copy_(sd[f"indexer.{name}.weight"])
    return layer.to(dtype).eval()


class Env:
    """Pools, allocator, backend and request bookkeeping of one SGLang scheduler (CPU)."""

    def __init__(self, layer=None, *, layer_id=3, config=None, slots=2048, max_reqs=6, max_ctx=512, dtype=torch.bfloat16,
                 spec_algorithm=None):
        """layer: the Qwen4ExpAttentionDecoderLayer `run` drives (None: metadata-only tests);
        spec_algorithm: the runner's `SpeculativeAlgorithm` (None: no speculative decoding)."""
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        publish_cpu_context()  # the scheduler's published config (the backend sizes its eager planner from it)
        config = config or sglang_config()
        self.layer, self.layer_id = layer, (layer.attn.layer_id if layer is not None else layer_id)
        self.r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_ctx, device="cpu", enable_memory_saver=False)
        self.pool = QSATokenToKVPool(
            size=slots, dtype=dtype, page_size=PAGE, head_num=config.num_key_value_heads,
            head_dim=config.head_dim, full_attention_layer_ids=[self.layer_id], device="cpu",
            mamba_pool=None, qsa_index_kv_heads=1, qsa_index_head_dim=config.indexer_head_dim,
            qsa_compress_ratio=config.indexer_compress_ratio, qsa_token_topk=config.indexer_budget,
            num_request_slots=self.r2t.req_to_token.shape[0],
        )
        self.alloc = PagedTokenToKVPoolAllocator(
            size=slots, page_size=PAGE, dtype=dtype, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.runner = types.SimpleNamespace(
            token_to_kv_pool=self.pool, req_to_token_pool=self.r2t, device="cpu", is_draft_worker=False,
            spec_algorithm=spec_algorithm,
            model_config=types.SimpleNamespace(hf_text_config=config, hf_config=config, context_len=max_ctx),
        )
        self.backend = ATTENTION_BACKENDS["qsa_core"](self.runner)
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}
        self.mapped: dict[str, int] = {}
        self.owned: dict[str, list[torch.Tensor]] = {}
        self.rope: dict[str, torch.Tensor] = {}  # MRoPE models: [3, L] positions per request

    # -- requests -------------------------------------------------------------------

    def admit(self, rid: str, prefix_from: str | None = None, prefix: int = 0, rope: torch.Tensor | None = None) -> None:
        """A new request; `prefix_from` shares that request's first `prefix` slots (radix hit).

        rope: the request's [3, L] MRoPE positions (MRoPE models only).
        """
        (row,) = self.r2t.alloc_rows(1)
        if rope is not None:
            self.rope[rid] = rope
        self.rows[rid], self.lens[rid], self.mapped[rid], self.owned[rid] = row, 0, 0, []
        if prefix_from is not None:
            self.r2t.req_to_token[row, :prefix] = self.r2t.req_to_token[self.rows[prefix_from], :prefix]
            self.lens[rid] = self.mapped[rid] = prefix

    def _map(self, rid: str, length: int) -> None:
        row, have = self.rows[rid], self.mapped[rid]
        if length <= have:
            return
        start = -(-have // PAGE) * PAGE  # positions below are on an allocated page
        if have < start:
            base = int(self.r2t.req_to_token[row, have - 1]) + 1
            n = min(start, length) - have
            self.r2t.req_to_token[row, have : have + n] = torch.arange(base, base + n, dtype=torch.int32)
        if length > start:
            pages = -(-(length - start) // PAGE)
            loc = self.alloc.alloc(pages * PAGE)
            self.owned[rid].append(loc)
            self.r2t.req_to_token[row, start:length] = loc[: length - start].to(torch.int32)
        self.mapped[rid] = length

    def free(self, rid: str) -> None:
        for loc in self.owned.pop(rid):
            self.alloc.free(loc)
        self.r2t.free_rows([self.rows.pop(rid)])
        self.lens.pop(rid), self.mapped.pop(rid), self.rope.pop(rid, None)

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        self._map(rid, end)
        return self.r2t.req_to_token[self.rows[rid], start:end].long()

    # -- batches --------------------------------------------------------------------

    def _mrope(self, spans: list[tuple[str, int, int]]) -> torch.Tensor | None:
        """[3, T] positions of the given (rid, start, end) spans, or None for 1-D RoPE."""
        if not self.rope:
            return None
        return torch.cat([self.rope[r][:, a:b] for r, a, b in spans], dim=1)

    def extend(self, chunks: dict[str, int], mode=ForwardMode.EXTEND) -> ForwardBatch:
        """Each request extends by chunks[rid] tokens after its current length."""
        rids = list(chunks)
        prefix = [self.lens[r] for r in rids]
        ext = [chunks[r] for r in rids]
        seq = [p + e for p, e in zip(prefix, ext)]
        loc = torch.cat([self.slots(r, p, s) for r, p, s in zip(rids, prefix, seq)])
        pos = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)])
        starts = torch.tensor([0] + ext[:-1], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        for r, s in zip(rids, seq):
            self.lens[r] = s
        return ForwardBatch(
            forward_mode=mode, batch_size=len(rids), input_ids=torch.zeros(sum(ext), dtype=torch.int64),
            req_pool_indices=torch.tensor([self.rows[r] for r in rids]), seq_lens=torch.tensor(seq),
            out_cache_loc=loc, seq_lens_sum=sum(seq), seq_lens_cpu=torch.tensor(seq), positions=pos,
            extend_num_tokens=sum(ext), extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32), extend_start_loc=starts,
            extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=prefix, rids=rids,
            mrope_positions=self._mrope(list(zip(rids, prefix, seq))),
        )

    def decode(self, rids: list[str]) -> ForwardBatch:
        seq = [self.lens[r] + 1 for r in rids]
        loc = torch.cat([self.slots(r, s - 1, s) for r, s in zip(rids, seq)])
        for r, s in zip(rids, seq):
            self.lens[r] = s
        s = torch.tensor(seq)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(rids), input_ids=torch.zeros(len(rids), dtype=torch.int64),
            req_pool_indices=torch.tensor([self.rows[r] for r in rids]), seq_lens=s, out_cache_loc=loc,
            seq_lens_sum=int(s.sum()), seq_lens_cpu=s.clone(), positions=s - 1, rids=list(rids),
            mrope_positions=self._mrope([(r, n - 1, n) for r, n in zip(rids, seq)]),
        )

    def verify(self, rids: list[str], draft_tokens: int) -> ForwardBatch:
        """TARGET_VERIFY of chain drafts; seq_lens exclude the window (all drafts accepted here)."""
        seq = [self.lens[r] for r in rids]
        loc = torch.cat([self.slots(r, s, s + draft_tokens) for r, s in zip(rids, seq)])
        pos = torch.cat([torch.arange(s, s + draft_tokens) for s in seq])
        for r, s in zip(rids, seq):
            self.lens[r] = s + draft_tokens
        s = torch.tensor(seq)
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(rids),
            input_ids=torch.zeros(pos.numel(), dtype=torch.int64),
            req_pool_indices=torch.tensor([self.rows[r] for r in rids]), seq_lens=s, out_cache_loc=loc,
            seq_lens_sum=int(s.sum()), seq_lens_cpu=s.clone(), positions=pos,
            spec_info=types.SimpleNamespace(draft_token_num=draft_tokens, topk=1, positions=pos),
        )

    # -- running --------------------------------------------------------------------

    def run(self, fb, hidden: torch.Tensor, *, init: bool = True) -> torch.Tensor:
        """Init the step metadata (eager) and run the layer's self_attention on `hidden`."""
        with forward_context(ForwardContext(attn_backend=self.backend)), torch.no_grad():
            if init:
                self.backend.init_forward_metadata(fb)
            positions = fb.positions if fb.mrope_positions is None else fb.mrope_positions
            return self.layer.self_attention(positions=positions, hidden_states=hidden, forward_batch=fb)
