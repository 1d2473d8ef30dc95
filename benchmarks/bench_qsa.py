"""One QSA layer step on the GPU against dense FlashInfer and SGLang 0.5.23's whole QSA path.

Production geometry (bf16, Hq 24 / Hkv 2 / D 256, indexer 4 x 128, r 4, budget 2048, page 64),
synthetic data (random; --prefill-data overlap or recency: `Step`). Every configuration is checked
against the PyTorch reference before it is timed. Each column is one CUDA graph (captured once)
timed as the median of its replays, L2 flushed before each replay (a layer's caches are cold in a
served step); "whole step" is all of the layer's launches (prepare, select writing packed rows,
attention) in one graph, also timed replayed back to back ("warm L2") and after a 256 MB read
instead of the write ("clean L2": no dirty lines for the step's misses to write back first, as in
a served step). bench_report.py holds the byte/FLOP model, the issue's targets and the table
writers.

    python benchmarks/bench_qsa.py --out DIR [--sglang-dir SITE] [--markdown BENCHMARKS.md --readme README.md]
    python benchmarks/bench_qsa.py --smoke --out DIR ...     # two small configurations
    python benchmarks/bench_qsa.py --dry-run --out DIR       # CPU: tiny shapes, reference ops, no timing
    python benchmarks/bench_qsa.py host [--out DIR]          # host time of plan and the layer halves (bench_host.py)
    python benchmarks/bench_qsa.py launch [--out DIR]        # host us of one launch: Triton's paths vs bound (bench_launch.py)
    python benchmarks/bench_qsa.py tp [--out DIR]            # per-rank kernel times under TP (bench_tp.py)
    python benchmarks/bench_qsa.py report DIR [--markdown BENCHMARKS.md --readme README.md]   # re-render a run
    python benchmarks/bench_qsa.py serving --out DIR [--engine sglang]  # qsa_core vs the engine's QSA (bench_serving)
    python benchmarks/bench_qsa.py peers --sglang-cuda --out DIR   # SGLang's default CUDA path beside ours (bench_peers.py)
    python benchmarks/bench_qsa.py peers --vllm --out DIR          # vLLM's upstream QSA and FA3 dense beside ours

DIR/results.json is written after every measurement; a rerun with the same --out resumes
(configurations already there are skipped), so a run cut by a time limit continues in the next
call (finished configurations are skipped). --budget-s stops starting configurations that would
not fit; --config-timeout ends the process (exit 3) when one configuration hangs, noting it, so a
rerun goes on without it (a loop that reruns while the exit status is 3 finishes the table).
benchmarks/results/ holds the run of record (results.json, table.md, latency.png, host.json).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_report as rep  # noqa: E402
from bench_report import (  # noqa: E402
    DENSE, NO_PREP, SGL_ALL, SGL_ATTN, SGL_INDEXER, WHOLE, WHOLE_CLEAN, WHOLE_WARM, Case, Geometry, Result,
)

from qsa_core import (  # noqa: E402
    QSAConfig, QSAIndexed, QSALayerCache, QSANormWeights, QSAPlanner, QSAStepInputs, qsa_attention,
    qsa_indexer, qsa_prepare, qsa_select, ring_capacity,
)
from qsa_core.reference import qsa_select_decode as ref_select, qsa_sparse_attention as ref_attention  # noqa: E402
from qsa_core.reference.common import apply_rope, gemma_rms_norm, rope_cos_sin  # noqa: E402
from qsa_core.reference.prepare import qsa_store_rows  # noqa: E402
from qsa_core.reference.select import compressed_rows, group_scores, paged_rows  # noqa: E402

GEOM = Geometry()
BF16 = torch.bfloat16
SGLANG_MARK = Path("sglang/srt/layers/attention/qsa/sparse_attn.py")
OVERLAP_PERIOD = 8  # default rows between the anchors of `correlated_rows` (--overlap-period)
PREFILL_DATA = ("random", "overlap", "recency")  # --prefill-data: what the indexer scores (Step)
# --prefill-data recency (`Step.add_recency`): weights of the shared unit direction u in the indexer's raw keys
# and queries (before the norms; noise N(0, 1)), calibrated on the CPU so that prefill rows at 16K overflow the
# sample-bounded top-k's candidate lists (cap 1024) as the served checkpoint's do (select_overflow.py: median
# 1376 candidates, 32 of 32 rows over; here 1360, 32 of 32; random data 650, 0).
RECENCY_KEY = 16.0
RECENCY_QUERY = 16.0
# The benchmark's other commands: `bench_qsa.py NAME ARGS` runs that module's main(ARGS).
TOOLS = {"host": "bench_host", "launch": "bench_launch", "tp": "bench_tp", "report": "bench_report",
         "serving": "bench_serving", "peers": "bench_peers"}


def qsa_config(index_dtype: str) -> QSAConfig:
    g = GEOM
    return QSAConfig(
        hidden_size=2048, num_heads=g.num_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
        index_n_heads=g.index_n_heads, index_head_dim=g.index_head_dim, token_topk=g.token_topk,
        compress_ratio=g.compress_ratio, rotary_dim=64, rope_theta=1e7, index_dtype=index_dtype,
    )


# -- the configurations ------------------------------------------------------------------------

def full_cases() -> list[Case]:
    """The issue's target rows, the fp8 rows, and the decode B4 contexts for the plot."""
    M = 1 << 20
    return [
        Case("decode", 8192, 1, 1), Case("decode", 32768, 4, 1),
        Case("decode", 131072, 4, 1), Case("decode", 131072, 4, 1, "fp8_e4m3"), Case("decode", 131072, 64, 1),
        Case("decode", M, 4, 1), Case("decode", M, 4, 1, "fp8_e4m3"), Case("decode", M, 4, 4),
        Case("prefill", 16384, 1, 16384), Case("prefill", 32768, 1, 16384), Case("prefill", 131072, 1, 16384),
        Case("prefill", M, 1, 16384),
    ]


def smoke_cases() -> list[Case]:
    return [Case("decode", 8192, 1, 1), Case("prefill", 8192, 1, 2048)]


def dry_cases() -> list[Case]:
    """CPU: contexts just above the budget, so the top-k has something to choose."""
    return [Case("decode", 4096, 1, 1), Case("decode", 4096, 1, 2, "fp8_e4m3"), Case("prefill", 4096, 1, 8)]


# -- timing ------------------------------------------------------------------------------------

# How GraphTimer flushes L2 before a replay: "write" zeroes a 256 MB buffer, as torch's and
# Triton's do_bench do, leaving L2 full of dirty lines that the timed work's misses must write
# back to DRAM first; "read" reads the buffer, leaving clean lines (as a served step finds L2
# after the previous layers' weight reads).
FLUSHES = ("write", "read")


class GraphTimer:
    """Median us of CUDA-graph replays of fn, each replay after an L2 flush (not timed; `flush`:
    one of FLUSHES)."""

    def __init__(self, flush_l2: bool = True, reps: int = 25, budget_ms: float = 600.0, flush: str = "write") -> None:
        if flush not in FLUSHES:
            raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
        self.buffer = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
        self.mode = flush
        self.reps, self.budget_ms = reps, budget_ms

    def evict(self) -> None:
        """Evict L2 (enqueued on the current stream; nothing when made with flush_l2=False)."""
        if self.buffer is None:
            return
        if self.mode == "write":
            self.buffer.zero_()
        else:
            torch.amax(self.buffer.view(torch.int64))

    def __call__(self, fn) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles) outside the graph
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        one_ms = (time.perf_counter() - t0) * 1e3
        reps = max(3, min(self.reps, int(self.budget_ms / max(one_ms, 1e-3))))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in ev:
            self.evict()
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        del graph
        return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3


class WallTimer:
    """The CPU dry run: wall-clock time of one call (no graphs; not a benchmark)."""

    def __call__(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6


# -- one step ----------------------------------------------------------------------------------

class Step:
    """Caches, plan and projections of one step of `case` (random data, seeded). prefill_data
    (PREFILL_DATA): "random": every tensor iid N(0, 1). "overlap": the prefill rows' indexer queries
    are correlated along positions (`correlated_rows` with anchors overlap_period rows apart), so
    neighbouring rows choose mostly the same groups. "recency" (prefill and decode): the indexer
    scores carry a recency bias like the served checkpoint's (`add_recency`), so the top groups
    cluster near each row and the prefill top-k's candidate lists overflow
    (benchmarks/select_overflow.py). backend: the ops backend (default: Triton on CUDA, else the
    reference)."""

    def __init__(self, case: Case, device: torch.device, seed: int = 0, prefill_data: str = "random",
                 overlap_period: int = OVERLAP_PERIOD, backend: str | None = None) -> None:
        if prefill_data not in PREFILL_DATA:
            raise ValueError(f"prefill_data must be one of {PREFILL_DATA}, got {prefill_data!r}")
        torch.manual_seed(seed)
        cfg = self.cfg = qsa_config(case.index_dtype)
        self.case = case
        self.context, self.batch, self.rows = case.context, case.batch, case.rows
        self.decode = case.kind == "decode"
        P = GEOM.page_size
        pages_per_req = math.ceil(case.context / P)
        num_pages = pages_per_req * case.batch + 1
        D, Hkv, Di = cfg.head_dim, cfg.num_kv_heads, cfg.index_head_dim
        idt = torch.float8_e4m3fn if case.index_dtype == "fp8_e4m3" else BF16
        C = ring_capacity(cfg.compress_ratio, case.rows - 1 if self.decode else 0)
        dev = device
        self.cache = QSALayerCache(
            k=torch.randn(num_pages, P, Hkv, D, device=dev, dtype=BF16),
            v=torch.randn(num_pages, P, Hkv, D, device=dev, dtype=BF16),
            compressed=torch.randn(num_pages, P // 4, Di, device=dev, dtype=BF16).to(idt),
            ring=torch.randn(case.batch, C, Di, device=dev, dtype=BF16),
            ring_positions=None,
        )
        perm = torch.randperm(num_pages - 1, device=dev).to(torch.int32) + 1  # page 0 unused
        self.block_table = perm[: pages_per_req * case.batch].view(case.batch, pages_per_req)
        pos = torch.arange(case.context - case.rows, case.context, device=dev)
        slots = self.block_table.long()[:, pos // P] * P + pos % P
        T = case.batch * case.rows
        planner = QSAPlanner(cfg, dtype=BF16, page_size=P, ring_capacity=C, max_num_tokens=T,
                             max_model_len=case.context, device=dev,
                             backend=backend or ("triton" if dev.type == "cuda" else "reference"))
        self.plan = planner.plan(QSAStepInputs(
            query_start_loc=torch.arange(0, T + 1, case.rows, device=dev, dtype=torch.int32),
            seq_lens=torch.full((case.batch,), case.context, device=dev, dtype=torch.int32),
            block_table=self.block_table,
            slot_mapping=slots.reshape(-1),
            ring_index=torch.arange(case.batch, device=dev, dtype=torch.int32),
            num_decodes=case.batch if self.decode else 0,
            decode_query_len=case.rows if self.decode else 1,
            max_query_len=case.rows,
            max_seq_len=case.context,
        ))
        self.meta = self.plan.meta
        Hi, Hq = cfg.index_n_heads, cfg.num_heads
        self.index_qk = torch.randn(T, (Hi + 1) * Di, device=dev, dtype=BF16)
        if prefill_data == "overlap" and not self.decode:
            self.index_qk[:, : Hi * Di] = correlated_rows(T, Hi * Di, overlap_period, dev)
        self.q_gate = torch.randn(T, Hq * 2 * D, device=dev, dtype=BF16)
        self.k = torch.randn(T, Hkv * D, device=dev, dtype=BF16)
        self.v = torch.randn(T, Hkv * D, device=dev, dtype=BF16)
        self.norms = QSANormWeights(*(torch.randn(n, device=dev) * 0.1 for n in (Di, Di, D, D)))
        if prefill_data == "recency":
            self.add_recency(seed)
        self.selection = torch.empty(T, cfg.packed_width, dtype=torch.int32, device=dev)
        self.q_idx, self.q, self.gate = self.prepare()

    def add_recency(self, seed: int) -> None:
        """Give the indexer scores a recency bias, as RoPE and a direction shared by queries and keys
        give the served checkpoint's. A unit direction u [Di] (seeded) is added, before the norms, as
        RECENCY_QUERY * u to each query head and RECENCY_KEY * u to the key part of the step's index_qk
        rows [T, (Hi + 1) * Di] bf16 and to the ring's raw keys [B, C, Di] bf16; every cached group key
        of each request (all context / r groups, [pages, P / r, Di] bf16 or fp8) becomes what prepare
        writes for 4 such raw keys: RoPE(GemmaRMSNorm(noise / 2 + RECENCY_KEY * u), the group's first
        position), noise the cache's own N(0, 1) values (the mean of 4 rows' noise is N(0, 1/4)). The
        norms' Gemma weights 1 + w (w ~ 0.1 N(0, 1)) keep u. q . k then carries RoPE(u, p) . RoPE(u, p'),
        smooth along groups and largest near the row: neighbouring groups score alike, so the top
        groups cluster and a row's samples bound its Kb-th score loosely."""
        cfg, r, P, Di = self.cfg, self.cfg.compress_ratio, GEOM.page_size, self.cfg.index_head_dim
        dev = self.index_qk.device
        u = torch.randn(Di, generator=torch.Generator().manual_seed(seed))
        u = (u / u.norm()).to(dev)
        qk = self.index_qk.view(self.index_qk.shape[0], -1, Di)
        qk[:, :-1] += (RECENCY_QUERY * u).to(BF16)
        qk[:, -1] += (RECENCY_KEY * u).to(BF16)
        self.cache.ring += (RECENCY_KEY * u).to(BF16)
        G = self.context // r
        cos, sin = rope_cos_sin(torch.arange(G, device=dev) * r, self.plan.inv_freq, self.plan.rope_axes)
        comp = self.cache.compressed
        for req in range(self.batch):
            rows = compressed_rows(self.block_table, req, G, P, r)
            pooled = (paged_rows(comp, rows).float() / 2 + RECENCY_KEY * u).to(BF16)
            normed = gemma_rms_norm(pooled, self.norms.index_k, cfg.rms_norm_eps)
            qsa_store_rows(comp, rows, apply_rope(normed[:, None], cos, sin)[:, 0])

    def prepare(self):
        return qsa_prepare(self.plan, self.norms, self.index_qk, self.q_gate, self.k, self.v, self.cache)

    def select(self):
        return qsa_select(self.plan, self.q_idx, self.cache, out=self.selection)

    def attention(self):
        return qsa_attention(self.plan, QSAIndexed(self.selection, self.q, self.gate), self.cache)

    def no_prepare(self):
        self.select()
        return self.attention()

    def full(self):
        indexed = qsa_indexer(self.plan, self.norms, self.index_qk, self.q_gate, self.k, self.v, self.cache,
                              selection_out=self.selection)
        return qsa_attention(self.plan, indexed, self.cache)

    # -- reference checks (before timing) --

    def ref_scores(self, row: int) -> torch.Tensor:
        """fp32 reference scores of one row over the groups it sees."""
        req, vis = int(self.meta.token_to_req[row]), int(self.meta.visible_blocks[row])
        keys = paged_rows(self.cache.compressed, compressed_rows(self.meta.block_table, req, vis, GEOM.page_size, 4))
        return group_scores(self.q_idx[row:row + 1], keys)[0]

    def check(self, rows: int = 2) -> str:
        """Kernel vs reference on the first rows: selected scores, then attention to 2e-2."""
        rows = min(rows, self.batch * self.rows)
        sel = self.select()
        Kb = self.cfg.block_topk
        ref_blocks = torch.empty(rows, Kb, dtype=torch.int32, device=sel.device)
        ref_select(self.q_idx[:rows], self.cache.compressed, self.meta.block_table, self.meta.token_to_req[:rows],
                   self.meta.visible_blocks[:rows], page_size=GEOM.page_size, compress_ratio=4, block_topk=Kb,
                   out=ref_blocks)
        for r in range(rows):
            scores = self.ref_scores(r)
            want = scores[ref_blocks[r][ref_blocks[r] >= 0].long()].sort().values
            got = scores[chosen_groups(sel[r], int(self.meta.visible_blocks[r]))].sort().values
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                raise AssertionError(f"{self.case.label}: selection differs from the reference at row {r}")
        err = attention_error(self.attention()[:rows], self.reference_attention(sel, rows))
        if err > 2e-2:
            raise AssertionError(f"{self.case.label}: attention differs from the reference: {err:.2e}")
        overlap = "" if self.decode else f"; neighbour overlap {neighbour_overlap(sel, self.meta.visible_blocks):.2f}"
        return f"ok (attention err {err:.1e} on {rows} rows{overlap})"

    def reference_attention(self, packed: torch.Tensor, rows: int) -> torch.Tensor:
        return ref_attention(self.q[:rows], self.gate[:rows], self.cache.k, self.cache.v, self.meta.block_table,
                             self.meta.token_to_req[:rows], self.meta.seq_lens, packed[:rows],
                             softmax_scale=self.cfg.softmax_scale)

    def traffic(self) -> dict:
        """The byte/FLOP model's inputs from this step's own selection (bench_report.traffic)."""
        sel = self.select()
        W = self.cfg.selection_width
        T = sel.shape[0]
        tok = sel[:, :W].long()
        valid = torch.arange(W, device=sel.device)[None, :] < sel[:, W:].long()
        req = self.meta.token_to_req[:T].long()[:, None].expand(-1, W)
        distinct = torch.unique((req * self.context + tok)[valid]).numel()
        scored = int(self.meta.visible_blocks[:T].long().sum())
        return rep.traffic(self.case, GEOM, float(distinct), float(scored), float(valid.sum()))


def correlated_rows(rows: int, width: int, period: int, device: torch.device) -> torch.Tensor:
    """bf16 [rows, width] standard normal rows correlated along the row index: row t =
    cos(th) U_a + sin(th) U_{a+1}, a = t // period, th = pi/2 (t % period) / period, U iid N(0, 1)
    (neighbours' correlation cos(pi / (2 period)), 0.98 at period 8)."""
    u = torch.randn(rows // period + 2, width, device=device)
    t = torch.arange(rows, device=device)
    th = (t % period).float()[:, None] * (math.pi / 2 / period)
    return (torch.cos(th) * u[t // period] + torch.sin(th) * u[t // period + 1]).to(BF16)


def neighbour_overlap(sel: torch.Tensor, visible: torch.Tensor, max_pairs: int = 4096) -> float:
    """Mean over neighbouring rows t, t+1 (max_pairs pairs spread evenly over the chunk) that both
    choose fewer groups than they see of |chosen(t) & chosen(t+1)| / |chosen(t)| (complete groups,
    tails excluded). Pairs spread over the chunk: its first rows see the fewest groups and overlap most."""
    if sel.shape[0] < 2:
        return float("nan")
    first = torch.linspace(0, sel.shape[0] - 2, min(max_pairs, sel.shape[0] - 1), device=sel.device).long()
    rows = torch.stack([first, first + 1], 1).flatten()
    W = sel.shape[1] - 1
    vis = visible[rows].long()
    ng = int(vis.max()) + 1
    tok = sel[rows, :W].long()
    valid = (torch.arange(W, device=sel.device)[None, :] < sel[rows, W:].long()) & (tok < vis[:, None] * 4)
    m = torch.zeros(rows.numel(), ng + 1, dtype=torch.bool, device=sel.device)
    m.scatter_(1, torch.where(valid, tok // 4, ng), True)
    m = m[:, :ng].view(-1, 2, ng)
    size, vis = m.sum(2), vis.view(-1, 2)
    both = (size < vis).all(1) & (size[:, 0] > 0)
    if not both.any():
        return float("nan")
    return float(((m[:, 0] & m[:, 1]).sum(1)[both].float() / size[both, 0].float()).mean())


def chosen_groups(packed_row: torch.Tensor, visible: int) -> torch.Tensor:
    """Distinct complete groups of one packed selection row (the open tail excluded)."""
    toks = packed_row[: int(packed_row[-1])].long()
    return torch.unique(toks[toks < visible * 4] // 4)


def attention_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().flatten(1), want.float().flatten(1)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


# -- peers -------------------------------------------------------------------------------------

def flashinfer_dense(step: Step):
    """Dense paged attention over the whole context with FlashInfer on the same KV pages:
    decode rows (MTP: row j of a request is its own entry over its causal prefix) with the
    tensor-core decode kernel; a prefill chunk with the causal paged prefill."""
    import flashinfer

    dev, B, rows, ctx, cfg, P = step.q.device, step.batch, step.rows, step.context, step.cfg, GEOM.page_size
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    q = step.q.contiguous()
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, P)
    i32 = dict(device=dev, dtype=torch.int32)
    if not step.decode:
        ppr = step.block_table.shape[1]
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(torch.tensor([0, rows], **i32), torch.tensor([0, ppr], **i32), step.block_table[0].contiguous(),
               torch.tensor([ctx - (ppr - 1) * P], **i32), *heads, causal=True, q_data_type=BF16, kv_data_type=BF16)
        return lambda: w.run(q, (step.cache.k, step.cache.v))
    lens = (ctx - rows + 1 + torch.arange(rows, device=dev)).repeat(B)  # [B * rows]
    pages = (lens + P - 1) // P
    kv_indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    table = step.block_table.repeat_interleave(rows, 0)
    keep = torch.arange(table.shape[1], device=dev)[None, :] < pages[:, None]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(kv_indptr, table[keep].contiguous(), (lens - (pages - 1) * P).to(torch.int32), *heads,
           q_data_type=BF16, kv_data_type=BF16)
    return lambda: w.run(q, (step.cache.k, step.cache.v))


def sglang_agreement(step: Step, path, max_rows: int = 32) -> dict[str, int]:
    """SGLang's chosen groups against ours on up to max_rows rows spread over the step, counted
    where the reference scores have a gap at the top-k boundary (else any tie order is right)."""
    ours, theirs = step.select(), path.packed()
    T, Kb = ours.shape[0], step.cfg.block_topk
    rows = sorted({int(i) for i in torch.linspace(0, T - 1, min(max_rows, T)).round().long()})
    gapped = agree = 0
    for r in rows:
        vis = int(step.meta.visible_blocks[r])
        if vis > Kb:
            s = step.ref_scores(r).sort(descending=True).values
            if float(s[Kb - 1] - s[Kb]) <= 1e-4 * max(abs(float(s[Kb - 1])), 1e-6):
                continue
        gapped += 1
        agree += bool(torch.equal(chosen_groups(ours[r], vis), chosen_groups(theirs[r], vis)))
    same = group_sets(ours[:, :-1], step.meta.visible_blocks[:T]) == group_sets(theirs[:, :-1], step.meta.visible_blocks[:T])
    return {"rows": len(rows), "gapped": gapped, "agree": agree, "all_rows": T, "all_agree": int(same.all(1).sum())}


def group_sets(tokens: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each row's chosen complete groups, sorted, padded with a large value: [T, W] int64."""
    t = tokens.long()
    first = (t >= 0) & (t % 4 == 0) & (t < visible[:, None].long() * 4)
    return torch.where(first, t // 4, torch.iinfo(torch.int64).max).sort(1).values


def sglang_check(step: Step, path, rows: int = 2) -> float:
    """SGLang's attention (ungated) times our gate against the reference on its own selection."""
    rows = min(rows, step.batch * step.rows)
    out = path.attention()[:rows].float().view(rows, step.cfg.num_heads, -1)
    gated = out * torch.sigmoid(step.gate[:rows].float())
    return attention_error(gated, step.reference_attention(path.packed(), rows))


# -- one configuration -------------------------------------------------------------------------

def measure(case: Case, device: torch.device, timer, sg, *, dense: bool, result: Result, save,
            whole_timers: dict[str, GraphTimer | WallTimer] | None = None, prefill_data: str = "random",
            overlap_period: int = OVERLAP_PERIOD, step: Step | None = None) -> Result:
    """Fill result column by column (save() after each, so a killed run keeps what it has);
    `whole_timers`: further whole-step columns, each with its own timer ({WHOLE_WARM: no flush,
    WHOLE_CLEAN: read flush}); `step`: measure on this one (a caller that times peers on the same
    caches) instead of a new one."""
    whole_timers = whole_timers or {}
    if step is None:
        step = Step(case, device, prefill_data=prefill_data, overlap_period=overlap_period)
    step.select()
    if not result.check:
        result.check = step.check()
        result.model = step.traffic()
        save()
    ours = {
        "prepare": step.prepare,
        "select+expand": step.select,
        "attention": step.attention,
        NO_PREP: step.no_prepare,
        WHOLE: step.full,
    }
    step.select()
    ours |= {name: step.full for name in whole_timers}
    for name, fn in ours.items():
        if name in result.us or any(n.startswith(f"{name}:") for n in result.notes):
            continue
        try:
            result.us[name] = whole_timers.get(name, timer)(fn)
        except Exception as e:  # noqa: BLE001 - one column's failure (e.g. an API it relies on moved) is reported
            result.notes.append(f"{name}: {type(e).__name__}: {e}"[:300])
        save()
    step.select()
    if sg is not None and SGL_ALL not in result.us and not any(n.startswith("sglang") for n in result.notes):
        try:
            from bench_sglang import SGLangPath

            path = SGLangPath(sg, step, page_size=GEOM.page_size, ratio=4, token_topk=GEOM.token_topk,
                              softmax_scale=step.cfg.softmax_scale)
            path.indexer()
            result.agreement = sglang_agreement(step, path)
            if device.type == "cuda":
                err = sglang_check(step, path)
                if err > 2e-2:
                    raise AssertionError(f"its attention differs from the reference on its selection: {err:.2e}")
                result.check += f"; sglang attention err {err:.1e}"
            result.us[SGL_INDEXER] = timer(path.indexer)
            save()
            if device.type == "cuda":
                result.us[SGL_ATTN] = timer(path.attention)
                result.us[SGL_ALL] = timer(path.full)
            else:
                result.notes.append("sglang attention: dry run (its Triton kernels need CUDA)")
        except Exception as e:  # noqa: BLE001 - report why, keep measuring the rest
            result.notes.append(f"sglang: {type(e).__name__}: {e}"[:300])
        save()
    if dense and DENSE not in result.us and not any(n.startswith("flashinfer") for n in result.notes):
        try:
            result.us[DENSE] = timer(flashinfer_dense(step))
        except Exception as e:  # noqa: BLE001
            result.notes.append(f"flashinfer: {type(e).__name__}: {e}"[:300])
        save()
    return result


def code_fingerprint() -> str:
    """sha256 (12 hex) of the code the figures depend on: a resumed run must match it."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(p for d in ("qsa_core", "kernels", "benchmarks") for p in (root / d).rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("triton", "flashinfer", "tilelang"):
        try:
            out.append(f"{name} {__import__(name).__version__}")
        except Exception:  # noqa: BLE001 - not installed here
            pass
    return ", ".join(out)


# -- command line ------------------------------------------------------------------------------

ABORTED = "aborted:"
EXIT_ABORTED = 3  # run_bench.sh reruns (resumes) after this exit code


def abort(r: Result, seconds: float, save) -> None:
    """Watchdog: a configuration ran past --config-timeout (a compile or a kernel that hangs).
    Note it, save, and end the process; a rerun resumes and skips this configuration."""
    r.notes.append(f"{ABORTED} not finished within {seconds:.0f} s; the rest of the run went on without it")
    try:
        save()
    finally:
        print(f"    {r.case.label}: {r.notes[-1]}", flush=True)
        os._exit(EXIT_ABORTED)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_qsa.py",
        description="Time one QSA layer step (prepare, select + expand, sparse attention; each alone and all in "
        "one CUDA graph) on a CUDA GPU at production geometry, against dense FlashInfer and SGLang 0.5.23's whole "
        "QSA path. Every configuration is checked against the PyTorch reference before it is timed.",
        epilog="other commands (each has its own --help): `host` times the host side of plan and the layer halves "
        "(bench_host.py); `launch` times one kernel launch through Triton's own paths and the bound launch "
        "(bench_launch.py); `tp` times a rank's kernels under tensor parallelism (bench_tp.py); `report DIR` re-renders "
        "a run's tables and plot from DIR/results.json on any machine (bench_report.py); `serving` serves a model "
        "through vLLM's or SGLang's server with qsa_core and with the engine's own QSA: TTFT, TPOT, tokens/s "
        "(bench_serving.py); `peers --sglang-cuda` / `--vllm` put SGLang's default CUDA path / vLLM's upstream QSA "
        "ops and FA3 dense beside ours, each checked before it is timed (bench_peers.py)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR",
                    help="folder for results.json, table.md and latency.png; an existing results.json there is "
                    "resumed (default: %(default)s)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="two small configurations (decode 8K B1, prefill 2K at 8K)")
    mode.add_argument("--dry-run", action="store_true",
                      help="on the CPU: tiny shapes through the reference ops (and SGLang's torch fallbacks), "
                      "wall-clock times that mean nothing; checks the benchmark's own logic and writers")
    ap.add_argument("--only", nargs="+", metavar="KEY", help="only these configurations (keys as in results.json)")
    ap.add_argument("--sglang-dir", type=Path, metavar="SITE",
                    help="a folder holding SGLang 0.5.23's sglang/srt/layers/attention/qsa/{mqa,kernel,sparse_attn}.py "
                    "(its site-packages, or a copy of just those files): SGLang's QSA path becomes the peer columns. "
                    "Needs tilelang 0.1.15 and FlashInfer with its top-k module prebuilt; without this option the "
                    "peer columns are left out")
    ap.add_argument("--prefill-data", choices=PREFILL_DATA, default="random",
                    help="the indexer's data (Step): iid (random); prefill queries correlated along positions "
                    "(overlap, correlated_rows); or, prefill and decode, scores with a recency bias like the served "
                    "checkpoint's, whose prefill rows overflow the sample-bounded top-k's candidate lists "
                    "(recency, Step.add_recency)")
    ap.add_argument("--overlap-period", type=int, default=OVERLAP_PERIOD, metavar="L",
                    help="with --prefill-data overlap: rows between the anchors of correlated_rows "
                    "(default %(default)s; larger: neighbouring rows' queries closer)")
    ap.add_argument("--no-dense", action="store_true", help="leave out the dense FlashInfer column")
    ap.add_argument("--warm-l2", action="store_true", help="do not flush L2 between replays")
    ap.add_argument("--flush", choices=FLUSHES, default="write",
                    help="how L2 is flushed before a replay: write 256 MB (dirty lines, do_bench's way; the table "
                    "of record so far) or read it (clean lines)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no configuration after this many seconds (0: no limit); rerun to resume")
    ap.add_argument("--config-timeout", type=float, default=0.0, metavar="S",
                    help=f"end the process (exit {EXIT_ABORTED}) when one configuration runs past S seconds, "
                    "noting it in results.json; a rerun resumes without it (0: no limit)")
    ap.add_argument("--markdown", type=Path, help="rewrite the bench section of this file (BENCHMARKS.md) at the end")
    ap.add_argument("--readme", type=Path, help="rewrite the bench section of this file (README.md) at the end")
    ap.add_argument("--no-plot", action="store_true", help="do not write latency.png (needs matplotlib)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times the kernels under CUDA graphs. "
                 "--dry-run checks the benchmark's logic on the CPU; `python -m qsa_core` runs QSA there.")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("the plot needs matplotlib: pip install -e '.[bench]' (or pass --no-plot; "
                 "`bench_qsa.py report DIR` renders it later from results.json)")
    if args.sglang_dir is not None and not (args.sglang_dir / SGLANG_MARK).is_file():
        ap.error(f"--sglang-dir {args.sglang_dir}: no {SGLANG_MARK} there; pass the folder that holds SGLang 0.5.23's "
                 "'sglang' package (its site-packages) or a copy of its qsa files")
    return args


def load_peer(args, device: torch.device):
    """SGLang's modules, or (None, why) when the peer cannot run here."""
    if args.sglang_dir is None:
        return None, ""
    try:
        import bench_sglang

        sg = bench_sglang.load(args.sglang_dir)
        if device.type == "cuda":
            if not sg.mqa.HAS_TILELANG:
                return None, "sglang: tilelang is not importable here (its indexer is TileLang)"
            bench_sglang.preload_flashinfer_topk()
        return sg, ""
    except Exception as e:  # noqa: BLE001
        return None, f"sglang: {type(e).__name__}: {e}"[:300]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        return
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    cases = dry_cases() if args.dry_run else smoke_cases() if args.smoke else full_cases()
    if args.only:
        cases = [c for c in cases if c.key in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    meta, done = rep.load(path) if path.exists() else ({}, [])
    code = code_fingerprint()
    data = args.prefill_data + (f" period {args.overlap_period}" if args.prefill_data == "overlap" else "")
    method = ("one CPU wall-clock call (dry run: not a measurement)" if args.dry_run else
              "CUDA-graph replays" + ("" if args.warm_l2 else ", L2 flushed before each replay"
                                      + ("" if args.flush == "write" else " (by a 256 MB read)")))
    if done and (meta.get("code") != code or meta.get("prefill_data", "random") != data
                 or meta.get("method", method) != method):
        print(f"{path}: written by other code, data or method (code {meta.get('code')}, data "
              f"{meta.get('prefill_data')!r}, {meta.get('method')!r}; now code {code}, data {data!r}, {method!r}); "
              "starting over")
        meta, done = {}, []
    by_key = {r.case.key: r for r in done}
    meta["code"] = code
    meta["prefill_data"] = data
    meta.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
                versions=versions(), when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), method=method)
    sg, why = load_peer(args, device)
    timer = WallTimer() if args.dry_run else GraphTimer(flush_l2=not args.warm_l2, flush=args.flush)
    if args.dry_run:  # the columns' logic, no timing
        whole_timers = {WHOLE_WARM: timer, WHOLE_CLEAN: timer}
    elif args.warm_l2:
        whole_timers = {}
    else:
        whole_timers = {WHOLE_WARM: GraphTimer(flush_l2=False)}
        if args.flush == "write":
            whole_timers[WHOLE_CLEAN] = GraphTimer(flush="read")
    results = [by_key.get(c.key) or Result(c) for c in cases]

    failed: list[str] = []

    keys = {r.case.key for r in results}
    others = [r for r in done if r.case.key not in keys]  # kept in the file, not measured now

    def save() -> None:
        rep.save(path, meta, results + others)

    for i, r in enumerate(results, 1):
        elapsed = time.perf_counter() - t_start
        if r.done or any(n.startswith(ABORTED) for n in r.notes):
            continue  # measured (or aborted) by an earlier call
        if args.budget_s and elapsed > args.budget_s:
            print(f"[{i}/{len(results)}] {r.case.label}: not started ({elapsed:.0f} s > --budget-s); rerun to resume")
            continue
        mem = ""
        if device.type == "cuda":  # what earlier configurations left behind (the allocator's and the driver's view)
            free, total = torch.cuda.mem_get_info(device)
            mem = (f" (GPU memory: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated, "
                   f"{torch.cuda.memory_reserved(device) / 2**30:.2f} reserved, {(total - free) / 2**30:.2f} in use)")
        print(f"[{i}/{len(results)}] {r.case.label} ({r.case.index_dtype}) at {elapsed:.0f} s ...{mem}", flush=True)
        if why and why not in r.notes:
            r.notes.append(why)
        watchdog = None
        if args.config_timeout:
            watchdog = threading.Timer(args.config_timeout, abort, args=(r, args.config_timeout, save))
            watchdog.daemon = True
            watchdog.start()
        try:
            measure(r.case, device, timer, sg, dense=not args.no_dense and not args.dry_run, result=r, save=save,
                    whole_timers=whole_timers, prefill_data=args.prefill_data, overlap_period=args.overlap_period)
        except Exception as e:  # noqa: BLE001 - a failed check stops this configuration only
            r.notes.append(f"FAILED: {type(e).__name__}: {e}"[:300])
            failed.append(r.case.key)
        if watchdog is not None:
            watchdog.cancel()
        r.done = True
        save()
        if device.type == "cuda":  # the next configuration starts from an empty allocator, as a run of it alone
            gc.collect()
            torch.cuda.empty_cache()
        print(f"    {r.check}; us: " + ", ".join(f"{k} {v:.1f}" for k, v in r.us.items())
              + (f"; agreement {r.agreement}" if r.agreement else "") + "".join(f"\n    note: {n}" for n in r.notes),
              flush=True)
    finished = [r for r in results if r.check or r.notes]
    print(rep.render(args.out, finished, meta, markdown=args.markdown, readme=args.readme,
                     with_plot=not args.no_plot))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see the notes above)")


if __name__ == "__main__":
    main()
