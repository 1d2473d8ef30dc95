"""Per-layer QSA step on the GPU against dense FlashInfer and SGLang 0.5.23's sparse kernels.

Production geometry (bf16, Hq 24 / Hkv 2 / D 256, indexer 4 x 128, r 4, budget 2048,
page 64), synthetic random data. Every configuration is checked against the reference
before it is timed. Times are medians of CUDA-graph replays (`do_bench_cudagraph`).
Needs a CUDA GPU; the plot needs matplotlib (`pip install -e '.[bench]'`), the dense
column FlashInfer (`.[flashinfer]`), the SGLang column SGLang's installed files.

    python benchmarks/bench_qsa.py [--out DIR] [--quick] [--sglang-dir SITE_PACKAGES] [--no-plot]
    python benchmarks/bench_qsa.py --sweep-attention

Writes DIR/results.json (after every configuration), DIR/table.md and DIR/latency.png, and
prints a line per configuration, then the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qsa_core import (
    QSAConfig, QSAIndexed, QSALayerCache, QSANormWeights, QSAPlanner, QSAStepInputs, ops, qsa_attention,
    qsa_indexer, qsa_prepare, qsa_select, ring_capacity,
)
from qsa_core.reference import qsa_select_decode as ref_select, qsa_sparse_attention as ref_attention
from qsa_core.reference.select import compressed_rows, group_scores, paged_rows

PEAK_BYTES_PER_S = 4.3e12  # device-to-device copy measured on this machine kind
PAGE = 64
CONFIG = QSAConfig(
    hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
    token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
)
DEV = torch.device("cuda")
BF16 = torch.bfloat16


@dataclass
class Row:
    kind: str  # decode | prefill
    context: int
    batch: int
    rows_per_req: int
    ms: dict[str, float] = field(default_factory=dict)
    qsa_bytes: float = 0.0
    dense_bytes: float = 0.0
    check: str = ""


class Step:
    """Caches, metadata and projections of one step: `batch` requests at `context` tokens,
    the last `rows` of each computed in this step."""

    def __init__(self, context: int, batch: int, rows: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        cfg = CONFIG
        self.context, self.batch, self.rows = context, batch, rows
        pages_per_req = math.ceil(context / PAGE)
        num_pages = pages_per_req * batch + 1
        D, Hkv, Di = cfg.head_dim, cfg.num_kv_heads, cfg.index_head_dim
        C = ring_capacity(cfg.compress_ratio, max(0, rows - 1) if rows <= 4 else 0)
        self.cache = QSALayerCache(
            k=torch.randn(num_pages, PAGE, Hkv, D, device=DEV, dtype=BF16),
            v=torch.randn(num_pages, PAGE, Hkv, D, device=DEV, dtype=BF16),
            compressed=torch.randn(num_pages, PAGE // 4, Di, device=DEV, dtype=BF16),
            ring=torch.randn(batch, C, Di, device=DEV, dtype=BF16),
            ring_positions=None,
        )
        perm = torch.randperm(num_pages - 1, device=DEV).to(torch.int32) + 1  # page 0 unused
        self.block_table = perm[: pages_per_req * batch].view(batch, pages_per_req)
        pos = torch.arange(context - rows, context, device=DEV)
        slots = self.block_table.long()[:, pos // PAGE] * PAGE + pos % PAGE
        T = batch * rows
        decode = rows <= 4
        planner = QSAPlanner(cfg, dtype=BF16, page_size=PAGE, ring_capacity=C, max_num_tokens=T,
                             max_model_len=context, device=DEV)
        self.plan = planner.plan(QSAStepInputs(
            query_start_loc=torch.arange(0, T + 1, rows, device=DEV, dtype=torch.int32),
            seq_lens=torch.full((batch,), context, device=DEV, dtype=torch.int32),
            block_table=self.block_table,
            slot_mapping=slots.reshape(-1),
            ring_index=torch.arange(batch, device=DEV, dtype=torch.int32),
            num_decodes=batch if decode else 0,
            decode_query_len=rows if decode else 1,
            max_query_len=rows,
            max_seq_len=context,
        ))
        self.meta = self.plan.meta
        Hi, Hq = cfg.index_n_heads, cfg.num_heads
        self.index_qk = torch.randn(T, (Hi + 1) * Di, device=DEV, dtype=BF16)
        self.q_gate = torch.randn(T, Hq * 2 * D, device=DEV, dtype=BF16)
        self.k = torch.randn(T, Hkv * D, device=DEV, dtype=BF16)
        self.v = torch.randn(T, Hkv * D, device=DEV, dtype=BF16)
        self.norms = QSANormWeights(*(torch.randn(n, device=DEV) * 0.1 for n in (Di, Di, D, D)))
        self.selection = torch.empty(T, cfg.packed_width, dtype=torch.int32, device=DEV)
        self.q_idx, self.q, self.gate = self.prepare()

    def prepare(self):
        return qsa_prepare(self.plan, self.norms, self.index_qk, self.q_gate, self.k, self.v, self.cache)

    def select(self):
        return qsa_select(self.plan, self.q_idx, self.cache, out=self.selection)

    def attention(self):
        return qsa_attention(self.plan, QSAIndexed(self.selection, self.q, self.gate), self.cache)

    def full(self):
        indexed = qsa_indexer(self.plan, self.norms, self.index_qk, self.q_gate, self.k, self.v, self.cache,
                              selection_out=self.selection)
        return qsa_attention(self.plan, indexed, self.cache)

    def check(self, rows: int = 2) -> str:
        """Kernel vs reference on request 0's first rows: selected scores and attention."""
        rows = min(rows, self.rows)
        sel = self.select()
        picked = rows_in(self, sel, rows)
        Kb = CONFIG.block_topk
        ref_blocks = torch.empty(rows, Kb, dtype=torch.int32, device=DEV)
        ref_select(self.q_idx[:rows], self.cache.compressed, self.meta.block_table,
                   self.meta.token_to_req[:rows], self.meta.visible_blocks[:rows], page_size=PAGE,
                   compress_ratio=4, block_topk=Kb, out=ref_blocks)
        vis = int(self.meta.visible_blocks[:rows].max())
        keys = paged_rows(self.cache.compressed, compressed_rows(self.meta.block_table, 0, vis, PAGE, 4))
        scores = group_scores(self.q_idx[:rows], keys)
        for r in range(rows):
            want = scores[r, ref_blocks[r][ref_blocks[r] >= 0].long()].sort().values
            got = scores[r, picked[r]].sort().values
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
                raise AssertionError(f"selection differs from the reference at row {r}")
        out = self.attention()[:rows].float()
        ref = ref_attention(self.q[:rows], self.gate[:rows], self.cache.k, self.cache.v, self.meta.block_table,
                            self.meta.token_to_req[:rows], self.meta.seq_lens, sel[:rows],
                            softmax_scale=CONFIG.softmax_scale).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise AssertionError(f"attention differs from the reference: {err:.2e}")
        return f"ok (attn err {err:.1e})"


def rows_in(step: Step, sel: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Chosen groups of the first rows, from the packed selection."""
    out = []
    for r in range(rows):
        vis = int(step.meta.visible_blocks[r])
        toks = sel[r, : int(sel[r, -1])].long()
        out.append(torch.unique(toks[toks < vis * 4] // 4))
    return out


def bench(fn) -> float:
    """Median ms of CUDA-graph replays (launch overhead excluded, as in a graph-served step)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def flashinfer_dense(step: Step):
    """Dense paged attention over the whole context with FlashInfer's decode kernel (same KV
    pages). With several rows per request (MTP), row j of a request is its own decode entry
    over the first context - rows + j + 1 tokens: exactly the causal dense attention."""
    import flashinfer

    B, rows, ctx = step.batch, step.rows, step.context
    cfg = CONFIG
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=DEV)
    q = step.q.contiguous()
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, PAGE)
    if rows > 4:  # a prefill chunk of one request: FlashInfer's causal paged prefill
        ppr = step.block_table.shape[1]
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        i32 = dict(device=DEV, dtype=torch.int32)
        w.plan(torch.tensor([0, rows], **i32), torch.tensor([0, ppr], **i32), step.block_table[0].contiguous(),
               torch.tensor([ctx - (ppr - 1) * PAGE], **i32), *heads, causal=True,
               q_data_type=BF16, kv_data_type=BF16)
        return lambda: w.run(q, (step.cache.k, step.cache.v))
    lens = (ctx - rows + 1 + torch.arange(rows, device=DEV)).repeat(B)  # [B * rows]
    pages = (lens + PAGE - 1) // PAGE
    kv_indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    table = step.block_table.repeat_interleave(rows, 0)
    keep = torch.arange(table.shape[1], device=DEV)[None, :] < pages[:, None]
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(kv_indptr, table[keep].contiguous(), (lens - (pages - 1) * PAGE).to(torch.int32), *heads,
           q_data_type=BF16, kv_data_type=BF16)
    return lambda: w.run(q, (step.cache.k, step.cache.v))


def load_sglang_sparse_attn(root: Path):
    """SGLang 0.5.23's sparse attention module, loaded from its installed files.

    Its only SGLang import (the batch-invariant switch) is stubbed to "off", so the
    package's heavy __init__ chain (CUDA kernels this machine lacks) is not needed.
    """
    stub = types.ModuleType("sglang.srt.batch_invariant_ops")
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules.setdefault("sglang.srt.batch_invariant_ops", stub)
    path = root / "sglang/srt/layers/attention/qsa/sparse_attn.py"
    spec = importlib.util.spec_from_file_location("sglang_qsa_sparse_attn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_attention(step: Step, sa):
    """SGLang's own sparse attention path on our selection (its decode gathers the chosen
    K/V into scratch, then runs a packed kernel; its prefill reads the pool in place)."""
    cfg = CONFIG
    B, rows, ctx = step.batch, step.rows, step.context
    W = cfg.selection_width
    T = B * rows
    k_flat = step.cache.k.view(-1, cfg.num_kv_heads, cfg.head_dim)
    v_flat = step.cache.v.view(-1, cfg.num_kv_heads, cfg.head_dim)
    pos = torch.arange(ctx, device=DEV)
    req_to_token = (step.block_table.long()[:, pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
    indices = step.selection[:, :W].contiguous()
    q = step.q.contiguous()
    seq = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    if rows == 1:
        counts = torch.empty(B, dtype=torch.int32, device=DEV)
        cu_k = torch.empty(B + 1, dtype=torch.int32, device=DEV)
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=DEV)
        pk = torch.empty(B * W, cfg.num_kv_heads, cfg.head_dim, device=DEV, dtype=BF16)
        pv = torch.empty_like(pk)
        rel = torch.arange(W, dtype=torch.int32, device=DEV).expand(B, -1).contiguous()
        req_idx = torch.arange(B, device=DEV, dtype=torch.int32)

        def run():
            sa.qwen_sparse_fa2_cu_seqlens_triton(seq, indices, counts, cu_k, B, W)
            sa.qwen_sparse_kv_extraction_compact_triton(k_flat, v_flat, req_to_token, req_idx, indices, seq,
                                                         cu_k, pk, pv, B, W)
            return sa.sparse_gqa_packed_decode_triton(q, pk, pv, rel, cu_q, cu_k, counts, cfg.softmax_scale)
        return run
    cu_q = torch.arange(0, T + 1, rows, device=DEV, dtype=torch.int32)
    return lambda: sa.sparse_gqa_paged_prefill_triton(q, k_flat, v_flat, req_to_token, indices, cu_q, seq,
                                                      cfg.softmax_scale, max_q=rows)


def measure(kind: str, context: int, batch: int, rows: int, sa) -> Row:
    row = Row(kind, context, batch, rows)
    step = Step(context, batch, rows)
    step.select()
    row.check = step.check()
    row.ms["prepare"] = bench(step.prepare)
    row.ms["select+expand"] = bench(step.select)
    blocks = torch.empty(step.q.shape[0], CONFIG.block_topk, dtype=torch.int32, device=DEV)
    blocks.copy_(torch.arange(CONFIG.block_topk, device=DEV, dtype=torch.int32))
    row.ms["expand"] = bench(lambda: ops.expand(blocks, step.meta.positions, step.meta.visible_blocks,
                                                compress_ratio=4, out=step.selection))
    step.select()
    row.ms["attention"] = bench(step.attention)
    row.ms["qsa (no prepare)"] = bench(lambda: (step.select(), step.attention()))
    row.ms["qsa (all)"] = bench(step.full)
    step.select()
    try:
        row.ms["flashinfer dense"] = bench(flashinfer_dense(step))
    except Exception as e:  # noqa: BLE001 - report, keep measuring the rest
        row.check += f"; flashinfer: {type(e).__name__}: {e}"[:200]
    if sa is not None:
        try:
            row.ms["sglang attention"] = bench(sglang_attention(step, sa))
        except Exception as e:  # noqa: BLE001
            row.check += f"; sglang: {type(e).__name__}: {e}"[:200]
    cfg = CONFIG
    T = batch * rows
    vis = context // 4
    kv_row = cfg.num_kv_heads * cfg.head_dim * 2 * 2  # K and V, bf16
    row.qsa_bytes = batch * vis * cfg.index_head_dim * 2 + T * cfg.selection_width * kv_row
    row.dense_bytes = batch * context * kv_row
    return row


def configs(quick: bool):
    ctxs = [8192, 32768, 131072] if quick else [8192, 32768, 65536, 131072, 1 << 20]
    for ctx in ctxs:
        for batch in (1, 4, 64):
            if batch * ctx > (16 << 20):
                continue
            for rows in (1, 4):
                yield "decode", ctx, batch, rows
    for ctx in ([16384, 131072] if quick else [16384, 131072, 1 << 20]):
        yield "prefill", ctx, 1, 16384


def table(rows: list[Row]) -> str:
    cols = ["prepare", "select+expand", "attention", "qsa (no prepare)", "qsa (all)", "flashinfer dense",
            "sglang attention"]
    head = ["kind", "ctx", "B", "q/req"] + [f"{c} us" for c in cols] + ["dense/qsa", "qsa GB/s", "% of 4.3 TB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        us = [f"{r.ms[c] * 1e3:.1f}" if c in r.ms else "-" for c in cols]
        qsa = r.ms.get("qsa (no prepare)")
        dense = r.ms.get("flashinfer dense")
        ratio = f"{dense / qsa:.1f}x" if qsa and dense else "-"
        gbs = r.qsa_bytes / (qsa * 1e-3) / 1e9 if qsa else 0
        ctx = f"{r.context // 1024}K"
        lines.append("| " + " | ".join([r.kind, ctx, str(r.batch), str(r.rows_per_req)] + us +
                                        [ratio, f"{gbs:.0f}", f"{100 * gbs * 1e9 / PEAK_BYTES_PER_S:.0f}"]) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (kind, batch, q) in zip(axes, [("decode", 4, 1), ("prefill", 1, 16384)]):
        sel = sorted((r for r in rows if (r.kind, r.batch, r.rows_per_req) == (kind, batch, q)),
                     key=lambda r: r.context)
        for name in ("qsa (no prepare)", "qsa (all)", "flashinfer dense", "sglang attention"):
            pts = [(r.context, r.ms[name] * 1e3) for r in sel if name in r.ms]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="us per layer",
               title=f"{kind}, batch {batch}, {q} row(s)/request")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SGLANG_SPARSE_ATTN = Path("sglang/srt/layers/attention/qsa/sparse_attn.py")
SWEEP_CASES = [("prefill 16K rows @128K", 131072, 1, 16384), ("decode B64 x4 @128K", 131072, 64, 4),
               ("decode B4 @128K", 131072, 4, 1)]


def sweep_attention() -> None:
    """Time every (BLOCK_N, num_warps, num_stages) of the sparse attention kernel on three
    128K cases; each output must equal the default configuration's (a tuning aid)."""
    import itertools

    from qsa_kernels import attention

    default = attention._launch_config
    for name, ctx, batch, rows in SWEEP_CASES:
        step = Step(ctx, batch, rows)
        step.select()
        want = step.attention().clone()
        results = []
        for cfg in itertools.product((16, 32, 64), (2, 4, 8), (1, 2)):
            attention._launch_config = lambda r, dp, cfg=cfg: cfg
            try:
                got = step.attention()
                same = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                results.append((bench(step.attention) * 1e3, cfg, same))
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                results.append((float("inf"), cfg, type(e).__name__))
            finally:
                attention._launch_config = default
        results.sort(key=lambda x: x[0])
        print(f"{name}: default {default(step.q.shape[0], 256)} = {bench(step.attention) * 1e3:.1f} us")
        for us, cfg, same in results[:6]:
            print(f"  BLOCK_N {cfg[0]:>2} warps {cfg[1]} stages {cfg[2]}: {us:8.1f} us  same={same}", flush=True)
        del step
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_qsa.py",
        description="Time one QSA layer step (prepare, select + expand, sparse attention) on a CUDA GPU "
        "at production geometry, against dense FlashInfer and SGLang 0.5.23's sparse attention. "
        "Every configuration is checked against the PyTorch reference before it is timed.",
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR",
                    help="folder for results.json, table.md and latency.png; created if missing "
                    "(default: %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="contexts 8K, 32K and 128K only (the full run adds 64K and 1M)")
    ap.add_argument("--sglang-dir", type=Path, default=None, metavar="SITE_PACKAGES",
                    help="the folder that holds SGLang 0.5.23's installed 'sglang' package, i.e. its "
                    "site-packages, e.g. $(python -c 'import sglang, pathlib; "
                    "print(pathlib.Path(sglang.__file__).parents[1])'). Only "
                    f"{SGLANG_SPARSE_ATTN} is loaded from it (no SGLang import chain, so no "
                    "sgl_kernel is needed); its sparse attention is timed on QSA's selection as the "
                    "'sglang attention' column. Without it that column is left out.")
    ap.add_argument("--no-plot", action="store_true",
                    help="do not write latency.png (the plot needs matplotlib: pip install -e '.[bench]')")
    ap.add_argument("--sweep-attention", action="store_true",
                    help="instead of the table: time all 18 launch configs of the sparse attention "
                    "kernel on three 128K cases and check each against the default config")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times the Triton kernels "
                 "under CUDA graphs. Without a GPU, `python -m qsa_core` runs QSA on the CPU.")
    if not args.no_plot and not args.sweep_attention and importlib.util.find_spec("matplotlib") is None:
        ap.error("the plot needs matplotlib: pip install -e '.[bench]' (or pass --no-plot)")
    if args.sglang_dir is not None and not (args.sglang_dir / SGLANG_SPARSE_ATTN).is_file():
        ap.error(f"--sglang-dir {args.sglang_dir}: no {SGLANG_SPARSE_ATTN} there; pass the "
                 "site-packages folder that holds SGLang 0.5.23's 'sglang' package")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.sweep_attention:
        sweep_attention()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    sa = load_sglang_sparse_attn(args.sglang_dir) if args.sglang_dir else None
    todo = list(configs(args.quick))
    rows = []
    for i, (kind, ctx, batch, q) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {kind} ctx {ctx} batch {batch} rows/request {q} ...", flush=True)
        r = measure(kind, ctx, batch, q, sa)
        torch.cuda.empty_cache()  # the step's caches went with measure()
        rows.append(r)
        print(f"    {r.check}; us:", {k: round(v * 1e3, 1) for k, v in r.ms.items()}, flush=True)
        (args.out / "results.json").write_text(json.dumps([asdict(x) for x in rows], indent=1))
    md = table(rows)
    (args.out / "table.md").write_text(md + "\n")
    if not args.no_plot:
        plot(rows, args.out / "latency.png")
    print(md)


if __name__ == "__main__":
    main()
