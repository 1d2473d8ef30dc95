"""How often the prefill top-k's candidate lists overflow on served scores (CPU, no GPU needed).

The sample-bounded prefill top-k (`qsa_kernels.select_prefill`) bounds a row's Kb-th largest
score from below by the Kb-th largest of its samples (maxima of S-column subsets, to `lbits`
high key bits), compacts the columns at or above the bound, resolves a row of more than `cap`
candidates in a wider second tier (`lists` entries, rows from 8192 columns) and a row of more than
`lists` in the exact whole-row resolve (one program a row: one sweep of its scores compacts its
candidates, 16 sweeps of those follow, or of its scores where they overflow its list scratch):
exact, much slower. Random scores, the benchmark's default data, rarely overflow; scores
whose top groups cluster, as a recency bias makes them, do (`bench_qsa.py --prefill-data recency`
makes such data).

This scores the last `--rows` rows of a random prompt with layer 0's indexer of the checkpoint
`scripts/gpu_vllm.py` serves (`full`: production attention geometry, `qwen4_checkpoint.randomize`
weights, fp32, transformers' modules), applies the kernel's own tiles for that context
(`select.score_block_g`, `select_prefill.prefill_tiles`), and prints the candidate counts of
the scores as they are and with their visible columns shuffled (the benchmark's case).

    python benchmarks/select_overflow.py [--contexts 16384,131072] [--rows 64] [--decode [--batch 4]]
                                         [--top-m M] [--narrow N] [--data served|recency]

--decode adds the decode route's counts for the same rows (`decode_tiles`: per-row samples of
one per 2^shift columns, a 16-bit bound, a list per `seg` columns of at most `cap`; a row of
more than cap candidates, at most cap2 and no list past its length resolves from its lists, any other
in the whole-row resolve). What-ifs
the kernels do not implement: `--top-m M` samples the M largest of each window, `--narrow N`
takes windows N times narrower (both N or M times the samples). `--data recency` scores the
last rows of `bench_qsa.py --prefill-data recency`'s prefill step instead of the checkpoint's
(`Step.add_recency`, one request; no model forward, so 1M contexts fit in a few GB).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT / "tests" / "vllm_adapter")]


def layer0_index_inputs(context: int, rows: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_idx fp32 [rows, Hi, Di] of the prompt's last rows, group keys fp32 [context / r, Di]),
    rotated as the indexer rotates them, for a random prompt of `context` tokens."""
    from gpu_vllm import VOCAB, production_config
    from qwen4_checkpoint import randomize
    from transformers import Qwen4ExpForCausalLM
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    cfg = production_config("full")
    cfg.max_position_embeddings = context + 128
    torch.manual_seed(7)
    model = Qwen4ExpForCausalLM(cfg).float().eval()
    randomize(model, 7)  # the served checkpoint's weights (gpu_vllm.write: seed 7)
    text = model.model
    ids = torch.randint(0, VOCAB, (1, context), generator=torch.Generator().manual_seed(seed))
    emb = text.embed_tokens(ids)
    cos, sin = text.rotary_emb(emb, torch.arange(context).view(1, 1, -1).expand(3, 1, -1))
    x, _, _ = text.layers[0].attn_hyper_connection(emb.repeat(1, 1, cfg.hc_count))
    ix = text.layers[0].self_attn.indexer
    Hi, Di, r = ix.index_n_heads, ix.index_head_dim, ix.compress_ratio
    qk = ix.index_qk_proj(x[:, :])[0]
    q = ix.q_layernorm(qk[-rows:, : Hi * Di].reshape(rows, Hi, Di))
    q = apply_rotary_pos_emb(q[None], cos=cos[:, -rows:], sin=sin[:, -rows:], unsqueeze_dim=2)[0]
    G = context // r
    pooled = ix.k_layernorm(qk[: G * r, Hi * Di :].reshape(G, r, Di).mean(1))
    starts = torch.arange(G) * r
    keys = apply_rotary_pos_emb(pooled[:, None], cos=cos[0, starts], sin=sin[0, starts])[:, 0]
    return q, keys


def recency_index_scores(context: int, rows: int) -> tuple[int, torch.Tensor]:
    """(compress ratio r, fp32 scores [rows, context / r]: each row's reference scores over the
    groups it sees, 0 past them) of the last rows of bench_qsa's recency prefill step."""
    import bench_qsa

    step = bench_qsa.Step(bench_qsa.Case("prefill", context, 1, rows), torch.device("cpu"), prefill_data="recency")
    r = step.cfg.compress_ratio
    scores = torch.zeros(rows, context // r)
    for t in range(rows):
        row = step.ref_scores(t)
        scores[t, : row.shape[0]] = row
    return r, scores


def sample_bound(keys: torch.Tensor, window: int, block_topk: int, lbits: int, top_m: int = 1) -> int:
    """The sample bound of one row's int32 score keys: the block_topk-th largest of the samples
    (the top_m largest keys of each `window` consecutive columns: distinct columns, so at least
    block_topk columns reach it), to `lbits` high bits."""
    n = -(-keys.shape[0] // window)
    padded = torch.full((n * window,), -1, dtype=torch.int32)
    padded[: keys.shape[0]] = keys
    samples = padded.view(n, window).topk(min(top_m, window), dim=1).values.flatten()
    return int(samples.topk(block_topk).values[-1]) & ~((1 << (32 - lbits)) - 1)


def candidates(scores: torch.Tensor, visible: int, samples_of: int, block_topk: int, lbits: int,
               top_m: int = 1) -> int:
    """Columns of one row's fp32 scores [>= visible] at or above the sample bound (`sample_bound`:
    one sample per samples_of columns, the kernel's; top_m > 1: that many a window)."""
    keys = scores[:visible].contiguous().view(torch.int32)  # scores >= 0: the bits order like the values
    return int((keys >= sample_bound(keys, samples_of, block_topk, lbits, top_m)).sum())


def decode_candidates(scores: torch.Tensor, visible: int, tiles, block_topk: int, top_m: int = 1,
                      narrow: int = 1) -> tuple[int, int]:
    """(candidates in all, the most in one segment) of one decode row's fp32 scores [>= visible]:
    per-row samples of one per 2^`sample_shift` columns (`decode_tiles`' row_s, log_g; narrow:
    windows that many times narrower; top_m: that many samples a window), the bound their
    block_topk-th largest to `lbits` high bits, lists per `seg` columns."""
    shift = 0
    while shift < tiles.log_g and visible > 1 << (tiles.row_s + shift):
        shift += 1
    keys = scores[:visible].contiguous().view(torch.int32)
    over = keys >= sample_bound(keys, max(1, (1 << shift) // narrow), block_topk, tiles.lbits, top_m)
    segs = -(-visible // tiles.seg)
    per_seg = torch.zeros(segs * tiles.seg, dtype=torch.int32)
    per_seg[:visible] = over.to(torch.int32)
    return int(over.sum()), int(per_seg.view(segs, tiles.seg).sum(1).max())


def prompt_rows(scores: torch.Tensor, context: int, r: int, data: str) -> Iterator[tuple[int, torch.Tensor]]:
    """(visible columns, fp32 scores [visible]) of each scored row (the prompt's last
    scores.shape[0] rows); data "shuffled": each row's visible columns permuted (seed 0 a pass)."""
    rows = scores.shape[0]
    shuffle = torch.Generator().manual_seed(0)
    for i in range(rows):
        visible = (context - rows + i + 1) // r
        row = scores[i, :visible]
        yield visible, row[torch.randperm(visible, generator=shuffle)] if data == "shuffled" else row


def main(argv: list[str] | None = None) -> None:
    from qsa_core.planner import column_bucket
    from qsa_core.reference.select import group_scores
    from qsa_kernels import select, select_prefill

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16384,131072", help="prompt lengths, comma separated")
    ap.add_argument("--rows", type=int, default=64, help="last rows of the prompt scored")
    ap.add_argument("--decode", action="store_true", help="also the decode route's counts for the same rows")
    ap.add_argument("--batch", type=int, default=4, help="decode rows a chunk (decode_tiles' rows)")
    ap.add_argument("--top-m", type=int, default=1, help="what-if: the m largest of each sample window (the "
                    "kernels take 1)")
    ap.add_argument("--narrow", type=int, default=1, help="what-if: sample windows this many times narrower "
                    "(as many samples as --top-m of the same factor)")
    ap.add_argument("--data", choices=("served", "recency"), default="served",
                    help="whose scores: the served checkpoint's layer 0, or bench_qsa's recency data")
    args = ap.parse_args(argv)
    decode = []
    torch.set_grad_enabled(False)
    Kb = 512
    print("| context | route | S | cap | lists | data | candidates median | p90 | max | rows over cap | "
          "rows over lists (whole-row resolve) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        if args.data == "served":
            q, keys = layer0_index_inputs(context, args.rows)
            r, scores = context // keys.shape[0], group_scores(q, keys)
        else:
            r, scores = recency_index_scores(context, args.rows)
        n_cols = column_bucket(context // r)
        block_g = select.score_block_g(n_cols)
        tiles = select_prefill.prefill_tiles(n_cols, Kb, block_g, small=False)
        route = select_prefill.prefill_route(n_cols, Kb, tiles, block_g)
        S = select_prefill.sample_cols(tiles, block_g)
        for data in (args.data, "shuffled"):
            c = torch.tensor([candidates(row, visible, max(1, S // args.narrow), Kb, tiles.lbits, args.top_m)
                              for visible, row in prompt_rows(scores, context, r, data)], dtype=torch.float32)
            over, whole = int((c > tiles.cap).sum()), int((c > tiles.lists).sum())
            print(f"| {context} | {'sample-bounded' if route else 'radix'} | {S} | {tiles.cap} | {tiles.lists} | "
                  f"{data} | {c.median():.0f} | {c.quantile(0.9):.0f} | {c.max():.0f} | {over} of {args.rows} | "
                  f"{whole} of {args.rows} |", flush=True)
        decode.append((context, n_cols, r, scores))
    if not args.decode:
        return
    print("\nDecode rows (the same rows as decode steps of --batch requests, `decode_tiles`):\n")
    print("| context | seg | cap | cap2 | data | candidates median | p90 | max | most in one list (max) | rows over cap | "
          "rows with a list over cap | rows to the whole-row resolve |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    block_g = select.decode_block_g()
    for context, n_cols, r, scores in decode:
        tiles = select_prefill.decode_tiles(n_cols, Kb, block_g, False, args.batch)
        for data in (args.data, "shuffled"):
            counts = torch.tensor([decode_candidates(row, visible, tiles, Kb, args.top_m, args.narrow)
                                   for visible, row in prompt_rows(scores, context, r, data)])
            c, m = counts[:, 0].float(), counts[:, 1]
            whole = (c > max(tiles.cap, tiles.cap2)) | (m > tiles.lists)  # past the second tier, if any
            print(f"| {context} | {tiles.seg} | {tiles.cap} | {tiles.cap2} | {data} | {c.median():.0f} | "
                  f"{c.quantile(0.9):.0f} | {c.max():.0f} | {int(m.max())} | {int((c > tiles.cap).sum())} of {args.rows} | "
                  f"{int((m > tiles.cap).sum())} of {args.rows} | {int(whole.sum())} of {args.rows} |", flush=True)


if __name__ == "__main__":
    main()
