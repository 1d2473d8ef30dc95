"""Per-rank QSA kernel times under tensor parallelism, next to TP 1, on one CUDA GPU.

Production geometry (bf16, Hq 24 / Hkv 2 / D 256, indexer 4 x 128, r 4, budget 2048, page 64).
A rank of TP n runs the same kernels on its heads only (`QSAConfig.for_rank`: Hq / n query
heads, max(1, 2 / n) KV heads; the indexer whole), so one GPU measures what every rank runs.
Each rank's step is built from the TP 1 step (its KV heads of the caches, its heads of the
projections) and checked against it before it is timed: the selection bitwise equal to TP 1's,
the attention equal to TP 1's columns of those heads. Times: medians of CUDA-graph replays, us.

    python benchmarks/bench_qsa.py tp [--out DIR] [--tp 1 2 4 8] [--quick]

Prints a line per configuration and writes DIR/tp_results.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from qsa_core import (
    QSAConfig, QSAIndexed, QSALayerCache, QSANormWeights, QSAPlanner, QSAStepInputs, qsa_attention, qsa_indexer,
    ring_capacity,
)

CONFIG = QSAConfig(
    hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
    token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
)
PAGE = 64
BF16 = torch.bfloat16


class Step:
    """One TP 1 step on the GPU: `batch` requests at `context` tokens, the last `rows` of each
    computed now; `rank(tp, r)` cuts rank r's share of it."""

    def __init__(self, context: int, batch: int, rows: int, seed: int = 0, device: str = "cuda") -> None:
        self.device = dev = torch.device(device)
        torch.manual_seed(seed)
        cfg = CONFIG
        D, Hq, Hkv, Di, Hi = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.index_head_dim, cfg.index_n_heads
        self.context, self.batch, self.rows = context, batch, rows
        pages_per_req = math.ceil(context / PAGE)
        num_pages = pages_per_req * batch + 1
        self.decode = rows <= 4
        self.C = ring_capacity(cfg.compress_ratio, rows - 1 if self.decode else 0)
        self.k = torch.randn(num_pages, PAGE, Hkv, D, device=dev, dtype=BF16)
        self.v = torch.randn(num_pages, PAGE, Hkv, D, device=dev, dtype=BF16)
        self.compressed = torch.randn(num_pages, PAGE // cfg.compress_ratio, Di, device=dev, dtype=BF16)
        self.ring = torch.randn(batch, self.C, Di, device=dev, dtype=BF16)
        table = (torch.randperm(num_pages - 1, device=dev).to(torch.int32) + 1)[: pages_per_req * batch]
        table = table.view(batch, pages_per_req)
        pos = torch.arange(context - rows, context, device=dev)
        slots = table.long()[:, pos // PAGE] * PAGE + pos % PAGE
        self.T = T = batch * rows
        self.inputs = QSAStepInputs(
            query_start_loc=torch.arange(0, T + 1, rows, device=dev, dtype=torch.int32),
            seq_lens=torch.full((batch,), context, device=dev, dtype=torch.int32),
            block_table=table,
            slot_mapping=slots.reshape(-1),
            ring_index=torch.arange(batch, device=dev, dtype=torch.int32),
            num_decodes=batch if self.decode else 0,
            decode_query_len=rows if self.decode else 1,
            max_query_len=rows,
            max_seq_len=context,
        )
        self.index_qk = torch.randn(T, (Hi + 1) * Di, device=dev, dtype=BF16)
        self.q_gate = torch.randn(T, Hq * 2 * D, device=dev, dtype=BF16)
        self.k_new = torch.randn(T, Hkv * D, device=dev, dtype=BF16)
        self.v_new = torch.randn(T, Hkv * D, device=dev, dtype=BF16)
        self.norms = QSANormWeights(*(torch.randn(n, device=dev) * 0.1 for n in (Di, Di, D, D)))

    def rank(self, tp: int, r: int) -> "RankStep":
        shard = CONFIG.head_shard(tp, r)
        q, kv = shard.query_heads, shard.kv_heads
        D, T = CONFIG.head_dim, self.T
        cache = QSALayerCache(
            k=self.k[:, :, kv.start : kv.stop].clone(), v=self.v[:, :, kv.start : kv.stop].clone(),
            compressed=self.compressed.clone(), ring=self.ring.clone(), ring_positions=None,
        )
        q_gate = self.q_gate.view(T, CONFIG.num_heads, 2 * D)[:, q.start : q.stop].reshape(T, -1)
        k = self.k_new.view(T, CONFIG.num_kv_heads, D)[:, kv.start : kv.stop].reshape(T, -1)
        v = self.v_new.view(T, CONFIG.num_kv_heads, D)[:, kv.start : kv.stop].reshape(T, -1)
        return RankStep(self, CONFIG.for_rank(tp, r), cache, q_gate, k, v, slice(q.start * D, q.stop * D))


class RankStep:
    """One rank's planner, caches and projections of a `Step`."""

    def __init__(self, step: Step, cfg: QSAConfig, cache, q_gate, k, v, columns: slice) -> None:
        self.step, self.cfg, self.cache, self.columns = step, cfg, cache, columns
        self.q_gate, self.k, self.v = q_gate, k, v
        planner = QSAPlanner(cfg, dtype=BF16, page_size=PAGE, ring_capacity=step.C, max_num_tokens=step.T,
                             max_model_len=step.context, device=step.device)
        self.plan = planner.plan(step.inputs)
        self.selection = torch.empty(step.T, cfg.packed_width, dtype=torch.int32, device=step.device)
        self.indexed: QSAIndexed | None = None

    def indexer(self) -> QSAIndexed:
        s = self.step
        self.indexed = qsa_indexer(self.plan, s.norms, s.index_qk, self.q_gate, self.k, self.v, self.cache,
                                   selection_out=self.selection)
        return self.indexed

    def attention(self) -> torch.Tensor:
        return qsa_attention(self.plan, self.indexed, self.cache)


def bench_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def check_ranks(step: Step, tp: int, want: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[RankStep], float]:
    """Every rank of TP `tp`: the selection bitwise equal to TP 1's (`want[0]`), the attention
    equal to TP 1's columns of its heads (`want[1]`, bf16: relative max error <= 2e-2)."""
    ranks = [step.rank(tp, r) for r in range(tp)]
    errs = []
    for rs in ranks:
        rs.indexer()
        if not torch.equal(rs.selection, want[0]):
            raise AssertionError(f"TP {tp}: a rank's selection differs from TP 1's")
        ref = want[1][:, rs.columns].float()
        errs.append(((rs.attention().float() - ref).abs().max() / ref.abs().max()).item())
    if max(errs) > 2e-2:
        raise AssertionError(f"TP {tp}: rank attention differs from TP 1's heads: {max(errs):.2e}")
    return ranks, max(errs)


def tp1_result(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    full = step.rank(1, 0)
    full.indexer()
    return full.selection.clone(), full.attention().clone()


def measure(context: int, batch: int, rows: int, tps: list[int]) -> list[dict]:
    step = Step(context, batch, rows)
    want = tp1_result(step)
    results = []
    for tp in tps:
        ranks, err = check_ranks(step, tp, want)
        r0 = ranks[0]
        row = dict(tp=tp, kind="decode" if step.decode else "prefill", context=context, batch=batch, rows=rows,
                   num_heads=r0.cfg.num_heads, num_kv_heads=r0.cfg.num_kv_heads,
                   indexer_us=bench_us(r0.indexer), attention_us=bench_us(r0.attention),
                   check=f"ok: selections equal TP 1 on {tp} ranks, attention err {err:.1e}")
        print(f"tp {tp}  {row['kind']:7s} ctx {context:>7d} B{batch:<3d} rows {rows:<5d} Hq {row['num_heads']:>2d} "
              f"Hkv {row['num_kv_heads']}  indexer {row['indexer_us']:8.1f} us  attention {row['attention_us']:8.1f} us  "
              f"{row['check']}", flush=True)
        results.append(row)
        del ranks
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--quick", action="store_true", help="decode B4 at 128K and the prefill only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times the kernels under CUDA graphs")
    configs = [(131072, 4, 1), (32768, 1, 4096)] if args.quick else [
        (8192, 4, 1), (131072, 4, 1), (131072, 64, 1), (32768, 1, 4096)]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for context, batch, n in configs:
        rows += measure(context, batch, n, args.tp)
        (args.out / "tp_results.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
