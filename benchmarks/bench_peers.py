"""Peer columns beside ours, in one process, on the same caches and data (`bench_qsa.py peers`).

    python benchmarks/bench_qsa.py peers --sglang-cuda --out DIR [--only KEY ...] [--budget-s S] [--config-timeout S]
    python benchmarks/bench_qsa.py peers --vllm --out DIR [...]        # vLLM 0.33's upstream QSA, FA3 dense
    python benchmarks/bench_qsa.py peers --sglang-cuda --dry-run --out DIR   # CPU: SGLang's CPU routes, no timing

On a GPU host with SGLang's stack, in the repository root, in one call of about 8 minutes (a
configuration that hangs ends its process with exit 3; the loop resumes without it):

    export PYTHONPATH=$PWD:$PWD/kernels:$PWD/adapters PYTHONUNBUFFERED=1; mkdir -p $OUT/peers
    for i in 1 2 3; do left=$((470 - SECONDS)); [ $left -gt 60 ] || break
      timeout $left python3 benchmarks/bench_qsa.py peers --sglang-cuda --out $OUT/peers \
          --budget-s $((left - 140)) --config-timeout 240
      rc=$?; echo "exit $rc"; [ $rc = 3 ] || break
    done 2>&1 | tee $OUT/peers/log

Our columns are bench_qsa.py's (`measure`: prepare, select+expand, attention, no prepare, whole
step); `--sglang-cuda` adds SGLang 0.5.23's default CUDA path (bench_sglang_cuda.py): its scoring,
its top-k on those logits, its whole indexer (scoring + top-k + expansion), its attention, and
indexer + attention in one graph; plus sgl_kernel's fast_topk_v2 on the same logits where it
serves 512 blocks. `--vllm` adds vLLM 0.33's upstream ops (bench_vllm.py): its fused prepare
(each output held to ours first), scoring + top-k, expansion, the indexer, its gated attention,
indexer + attention and the whole step in one graph; and FA3 dense beside FlashInfer dense,
each held to a dense fp32 reference first. Before a peer is timed, its selection must be a
valid top-k of the reference scores on rows spread over the step (`valid_topk`: any order among
ties, 1e-4 relative) and its attention on its own selection, gated by ours (vLLM's gates
itself), must be within 2e-2 of the reference; a peer that fails, or cannot run, records the
exact error in the notes and the rest goes on. Every time
is GraphTimer's (bench_qsa.py): one CUDA graph per column, median of replays, L2 flushed before
each. DIR/peers.json is written after every measurement (a rerun resumes), DIR/peers.md after
every configuration.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_qsa as bq  # noqa: E402
import bench_report as rep  # noqa: E402
from bench_report import NO_PREP, WHOLE, Case, Result  # noqa: E402

from qsa_core.reference import qsa_sparse_attention as ref_attention  # noqa: E402

SG = "sglang-cuda"
SG_SCORE, SG_TOPK, SG_TOPK_V2 = f"{SG} score", f"{SG} top-k", "sgl_kernel top-k v2"
SG_INDEXER, SG_ATTN, SG_ALL = f"{SG} indexer", f"{SG} attention", f"{SG} (all)"
VL = "vllm"
VL_PREP, VL_SELECT, VL_EXPAND = f"{VL} prepare", f"{VL} score+top-k", f"{VL} expand"
VL_INDEXER, VL_ATTN, VL_ALL, VL_WHOLE = f"{VL} indexer", f"{VL} attention", f"{VL} (all)", f"{VL} whole step"
FA3, FI_DENSE = "FA3 dense", "FlashInfer dense"
SG_COLUMNS = [SG_SCORE, SG_TOPK, SG_TOPK_V2, SG_INDEXER, SG_ATTN, SG_ALL]
VL_COLUMNS = [VL_PREP, VL_SELECT, VL_EXPAND, VL_INDEXER, VL_ATTN, VL_ALL, VL_WHOLE, FA3, FI_DENSE]
# upstream's prepare against ours, relative to the largest value: normed / rotated outputs to
# bf16 rounding (each side rounds up to three times at 2^-8, upstream's cos/sin table is bf16:
# 4e-2; fp8 index dtype: one e4m3 step, 1.3e-1), copies (gate, V, raw keys into the ring) exactly
PREP_TOL = {"q_idx": 4e-2, "q": 4e-2, "K": 4e-2, "compressed": 4e-2, "gate": 0.0, "V": 0.0, "ring": 0.0}
PREP_TOL_FP8 = 1.3e-1
PEER_COLUMNS = SG_COLUMNS + VL_COLUMNS
OURS = ["select+expand", "attention", NO_PREP, WHOLE]
RTOL_TIE = 1e-4  # scores this close (relative) at the top-k boundary are a tie: either side is right
ATTN_TOL = 2e-2  # bf16 attention against the fp32 reference


def cases() -> list[Case]:
    """The table of record's shapes, in the order a time-limited run should reach them (the MTP
    row, SGLang's TARGET_VERIFY route of the same decode kernels, last)."""
    M = 1 << 20
    return [Case("decode", 8192, 1, 1), Case("decode", 131072, 4, 1), Case("decode", 131072, 64, 1),
            Case("decode", M, 4, 1), Case("prefill", 16384, 1, 16384), Case("prefill", 131072, 1, 16384),
            Case("decode", M, 4, 4)]


def dry_cases() -> list[Case]:
    return [Case("decode", 4096, 2, 1), Case("prefill", 4096, 1, 8)]


class PeerMismatch(AssertionError):
    """A peer's output disagrees with the reference (it is then not timed)."""


# -- checks (no GPU needed) -----------------------------------------------------------------------

def valid_topk(scores: torch.Tensor, chosen: torch.Tensor, k: int, rtol: float = RTOL_TIE) -> str:
    """'' when `chosen` (group indices) is a top-k of `scores` (fp32 [visible]) by design.md §2.7
    up to ties: min(k, visible) distinct groups below visible, none scoring lower than an
    unchosen one by more than rtol (relative to the larger boundary score); else why not."""
    vis, chosen = scores.numel(), chosen.long()
    want = min(k, vis)
    if chosen.numel() != want:
        return f"{chosen.numel()} groups chosen, expected {want} (visible {vis})"
    if want == 0:
        return ""
    if int(chosen.min()) < 0 or int(chosen.max()) >= vis:
        return f"group {int(chosen.max()) if int(chosen.max()) >= vis else int(chosen.min())} outside 0..{vis - 1}"
    if torch.unique(chosen).numel() != want:
        return "a group chosen twice"
    if want == vis:
        return ""
    mask = torch.zeros(vis, dtype=torch.bool, device=scores.device)
    mask[chosen] = True
    low, high = float(scores[mask].min()), float(scores[~mask].max())
    if low < high - rtol * max(abs(low), abs(high), 1e-30):
        return f"chose a group scoring {low:.7g} over one scoring {high:.7g}"
    return ""


def spread_rows(n: int, count: int) -> list[int]:
    return sorted({int(i) for i in torch.linspace(0, n - 1, min(count, n)).round().long()})


def check_selection(step, groups, rows: list[int]) -> dict[str, int]:
    """groups(r): a peer's chosen groups of row r. Each row must be a valid top-k of the
    reference scores (PeerMismatch names the first that is not); counts how many also equal
    ours exactly."""
    ours = step.select()
    Kb = step.cfg.block_topk
    equal = 0
    for r in rows:
        vis = int(step.meta.visible_blocks[r])
        got = groups(r)
        why = valid_topk(step.ref_scores(r), got, Kb)
        if why:
            raise PeerMismatch(f"row {r}: not a top-k of the reference scores: {why}")
        equal += bool(torch.equal(torch.unique(got.long()), bq.chosen_groups(ours[r], vis)))
    return {"rows": len(rows), "valid": len(rows), "equal": equal}


def attention_error(step, out: torch.Tensor, packed: torch.Tensor, rows: list[int], gated: bool = False) -> float:
    """A peer's attention out [T, Hq(*D)] on its own selection (packed [T, W + 1]), gated by
    ours unless `gated` (the peer fused the gate), against the reference on `rows`."""
    idx = torch.tensor(rows, device=out.device)
    Hq = step.cfg.num_heads
    got = out[idx].float().view(len(rows), Hq, -1)
    if not gated:
        got = got * torch.sigmoid(step.gate[idx].float())
    m = step.meta
    want = ref_attention(step.q[idx], step.gate[idx], step.cache.k, step.cache.v, m.block_table, m.token_to_req[idx],
                         m.seq_lens, packed[idx], softmax_scale=step.cfg.softmax_scale)
    return bq.attention_error(got, want)


def check_peer(step, peer, max_rows: int = 32) -> tuple[str, dict[str, int]]:
    """Run the peer's indexer and attention once and hold them to the reference (raises
    PeerMismatch). Returns the check's text and its counts."""
    sel = peer.indexer()
    packed = peer.packed()
    T = sel.shape[0]
    vis = step.meta.visible_blocks
    counts = check_selection(step, lambda r: bq.chosen_groups(packed[r], int(vis[r])), spread_rows(T, max_rows))
    same = bq.group_sets(step.select()[:, :-1], vis[:T]) == bq.group_sets(sel, vis[:T])
    counts.update(all_rows=T, all_equal=int(same.all(1).sum()))
    err = attention_error(step, peer.attention(), packed, spread_rows(T, 4), gated=getattr(peer, "gated", False))
    if not err <= ATTN_TOL:
        raise PeerMismatch(f"attention on its own selection differs from the reference: {err:.2e} > {ATTN_TOL}")
    return (f"selection a top-k of the reference in {counts['valid']}/{counts['rows']} rows "
            f"({counts['equal']} equal to ours; all rows {counts['all_equal']}/{T}); attention err {err:.1e}"), counts


def check_blocks(step, blocks: list[torch.Tensor], rows: list[int]) -> None:
    """Block indices of a top-k alone (per chunk, relative = group index) against the reference."""
    flat = torch.cat(blocks)
    check_selection(step, lambda r: flat[r][flat[r] >= 0], rows)


# -- one configuration ----------------------------------------------------------------------------

def timed(result: Result, name: str, timer, fn, save) -> None:
    """Time one column; a failure is the column's note, not the run's."""
    if name in result.us or any(n.startswith(f"{name}:") for n in result.notes):
        return
    try:
        result.us[name] = timer(fn)
    except Exception as e:  # noqa: BLE001
        result.notes.append(f"{name}: {type(e).__name__}: {e}"[:400])
    save()


def measure_sglang(step, mods, result: Result, timer, save) -> None:
    """SGLang's default CUDA path on step: checked, then timed column by column."""
    from bench_sglang_cuda import SGLangCudaPath, single_stage_prefill

    g = bq.GEOM
    path = SGLangCudaPath(mods, step, page_size=g.page_size, ratio=g.compress_ratio, token_topk=g.token_topk,
                          softmax_scale=step.cfg.softmax_scale)
    notes = [f"{SG} routes: " + "; ".join(f"{k}: {v}" for k, v in path.routes.items())]
    notes += [f"{SG} import {name}: {why}"[:400] for name, why in mods.missing.items()]
    result.notes += [n for n in notes if n not in result.notes]  # a resumed row has them
    try:
        text, counts = check_peer(step, path)
    except Exception as e:  # noqa: BLE001
        if step.decode or isinstance(e, PeerMismatch) or not single_stage_prefill(mods):
            raise
        result.notes.append(f"{SG} prefill scoring failed at TileLang's own num_stages ({type(e).__name__}: "
                            f"{e}"[:400] + "); retried with num_stages=1")
        path.routes = path._routes()
        result.notes.append(f"{SG} routes now: " + "; ".join(f"{k}: {v}" for k, v in path.routes.items()))
        text, counts = check_peer(step, path)
    result.check = "; ".join(filter(None, [result.check, f"{SG}: {text}"]))
    result.agreement = {"rows": counts["rows"], "gapped": counts["rows"], "agree": counts["equal"],
                        "all_rows": counts["all_rows"], "all_agree": counts["all_equal"]}
    save()
    if not step.q.is_cuda:  # the dry run: SGLang's CPU routes, no graphs
        for name, fn in ((SG_INDEXER, path.indexer), (SG_ATTN, path.attention)):
            timed(result, name, timer, fn, save)
        return
    rows = spread_rows(step.batch * step.rows, 32)
    try:  # scoring and top-k alone, on logits of its own scoring; the top-k checked like the indexer
        logits = path.score()
        check_blocks(step, path.topk(logits), rows)
        timed(result, SG_SCORE, timer, path.score, save)
        timed(result, SG_TOPK, timer, lambda: path.topk(logits), save)
        if mods.topk_v2 is not None:
            check_blocks(step, path.topk_v2(logits), rows)
            timed(result, SG_TOPK_V2, timer, lambda: path.topk_v2(logits), save)
    except Exception as e:  # noqa: BLE001 - the split columns' failure leaves the whole path's
        result.notes.append(f"{SG} score / top-k alone: {type(e).__name__}: {e}"[:400])
    logits = None
    timed(result, SG_INDEXER, timer, path.indexer, save)
    path.indexer()
    timed(result, SG_ATTN, timer, path.attention, save)
    timed(result, SG_ALL, timer, path.full, save)


def check_dense(step, out: torch.Tensor, rows: list[int]) -> float:
    """A dense peer's ungated out [T, Hq(*D)] against bench_vllm.dense_reference on `rows`
    (raises PeerMismatch beyond ATTN_TOL); returns the error."""
    from bench_vllm import dense_reference

    idx = torch.tensor(rows, device=out.device)
    err = bq.attention_error(out[idx].float().view(len(rows), step.cfg.num_heads, -1), dense_reference(step, rows))
    if not err <= ATTN_TOL:
        raise PeerMismatch(f"dense attention differs from the reference: {err:.2e} > {ATTN_TOL}")
    return err


def timed_dense(step, result: Result, name: str, build, timer, save) -> None:
    """Build a dense column's callable, check it against the reference, then time it; any
    failure is the column's note."""
    if name in result.us or any(n.startswith(f"{name}:") for n in result.notes):
        return
    try:
        fn = build()
        err = check_dense(step, fn(), spread_rows(step.batch * step.rows, 2))
        result.check = "; ".join(filter(None, [result.check, f"{name}: err {err:.1e} against the dense reference"]))
        result.us[name] = timer(fn)
    except Exception as e:  # noqa: BLE001
        result.notes.append(f"{name}: {type(e).__name__}: {e}"[:400])
    save()


def check_prepare(step, prep) -> str:
    """Run upstream's prepare once and hold each output to ours (raises PeerMismatch naming
    the first output beyond PREP_TOL); returns the errors as text."""
    q, gate = prep()
    errs = prep.errors(q, gate)
    fp8 = step.q_idx.dtype != torch.bfloat16
    for name, err in errs.items():
        tol = PREP_TOL_FP8 if fp8 and name in ("q_idx", "compressed") else PREP_TOL[name]
        if not err <= tol:
            raise PeerMismatch(f"prepare's {name} differs from ours: {err:.2e} > {tol}")
    return "prepare err " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())


def measure_vllm(step, mods, result: Result, timer, save) -> None:
    """vLLM 0.33's upstream QSA ops on step: checked (prepare's outputs against ours, selection
    and gated attention against the reference), then timed column by column; then FA3 and
    FlashInfer dense, each checked first."""
    from bench_vllm import VLLMPath, VLLMPrepare, fa3_dense

    g = bq.GEOM
    notes = [f"{VL} import {name}: {why}"[:400] for name, why in mods.missing.items()]
    result.notes += [n for n in notes if n not in result.notes]
    path = None
    if not any(n.startswith(f"{VL}:") for n in result.notes) and VL_ALL not in result.us:
        try:
            path = VLLMPath(mods, step, ratio=g.compress_ratio, token_topk=g.token_topk)
            routes = f"{VL} routes: " + "; ".join(f"{k}: {v}" for k, v in path.routes.items())
            if routes not in result.notes:
                result.notes.append(routes)
            text, _ = check_peer(step, path)
            result.check = "; ".join(filter(None, [result.check, f"{VL}: {text}"]))
            save()
            for name, fn in ((VL_SELECT, path.select), (VL_EXPAND, path.expand), (VL_INDEXER, path.indexer)):
                timed(result, name, timer, fn, save)
            path.indexer()
            timed(result, VL_ATTN, timer, path.attention, save)
            timed(result, VL_ALL, timer, path.full, save)
        except Exception as e:  # noqa: BLE001 - the peer's failure is its column's, recorded exactly
            result.notes.append(f"{VL}: {type(e).__name__}: {e}"[:600])
            save()
    if VL_ALL in result.us and not any(n.startswith(f"{VL_PREP}:") for n in result.notes) and VL_WHOLE not in result.us:
        try:
            path = path or VLLMPath(mods, step, ratio=g.compress_ratio, token_topk=g.token_topk)
            prep = VLLMPrepare(mods, step, ratio=g.compress_ratio, page_size=g.page_size)
            result.check = "; ".join(filter(None, [result.check, f"{VL} {check_prepare(step, prep)}"]))
            timed(result, VL_PREP, timer, prep, save)

            def whole() -> torch.Tensor:
                prep()
                return path.full()

            timed(result, VL_WHOLE, timer, whole, save)
        except Exception as e:  # noqa: BLE001 - the prepare column's failure leaves the rest
            result.notes.append(f"{VL_PREP}: {type(e).__name__}: {e}"[:600])
            save()
    timed_dense(step, result, FA3, lambda: fa3_dense(mods, step), timer, save)
    timed_dense(step, result, FI_DENSE, lambda: bq.flashinfer_dense(step), timer, save)


def measure(case: Case, device: torch.device, timer, mods, why: str, result: Result, save,
            vllm=None, vllm_why: str = "") -> None:
    """Ours (bench_qsa.measure, on this step) then the peers, on the same step. Where ours fail
    on this stack the failure is noted and the peers still run, on a step prepared and selected
    by the reference ops. mods / why: SGLang's modules or why they are absent (both empty: not
    asked for); vllm / vllm_why likewise for vLLM's."""
    step = None
    try:
        step = bq.Step(case, device)
        bq.measure(case, device, timer, None, dense=False, result=result, save=save, step=step)
    except Exception as e:  # noqa: BLE001 - our failure is this row's finding, not the peers'
        result.notes.append(f"ours FAILED: {type(e).__name__}: {e}"[:600])
        save()
        step = None
    if step is None:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        step = bq.Step(case, device, backend="reference")
    for why_not in (why, vllm_why):
        if why_not and why_not not in result.notes:
            result.notes.append(why_not)
    if mods is not None and not any(n.startswith(f"{SG}:") for n in result.notes) and SG_ALL not in result.us:
        try:
            measure_sglang(step, mods, result, timer, save)
        except Exception as e:  # noqa: BLE001 - the peer's failure is its column's, recorded exactly
            result.notes.append(f"{SG}: {type(e).__name__}: {e}"[:600])
        save()
    if vllm is not None:
        measure_vllm(step, vllm, result, timer, save)
    save()


# -- report -------------------------------------------------------------------------------------

def table(results: list[Result]) -> str:
    """Ours, then every peer column that holds a time or a note in some row."""
    used = [c for c in PEER_COLUMNS if any(c in r.us or any(n.startswith(f"{c}:") for n in r.notes) for r in results)]
    sg = any(c in SG_COLUMNS for c in used) or any(n.startswith(SG) for r in results for n in r.notes)
    ratios = [(c, o) for c, o in ((SG_ALL, NO_PREP), (VL_ALL, NO_PREP), (VL_WHOLE, WHOLE), (FA3, WHOLE))
              if c in used or (c == SG_ALL and sg)]
    head = ["case", "index", *(f"ours {c}" for c in OURS), *used, *(f"{c} / ours {o}" for c, o in ratios)]
    head += [f"{SG} top-k checked rows (equal to ours)"] if sg else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        us = r.us
        a = r.agreement
        cells = [r.case.label, r.case.index_dtype, *(rep._fmt(us.get(c)) for c in OURS),
                 *(rep._fmt(us.get(c)) for c in used),
                 *(f"{us[c] / us[o]:.2f}" if c in us and us.get(o) else "-" for c, o in ratios)]
        cells += [f"{a['gapped']} ({a['agree']})" if a.get("rows") else "-"] if sg else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(out: Path, results: list[Result], meta: dict) -> str:
    head = (f"Run: {meta.get('when', '?')} on {meta.get('device', '?')}, {meta.get('versions', '')}. "
            f"Times in us per layer, medians of {meta.get('method', 'CUDA-graph replays')}. The peer QSA columns "
            f"exclude prepare (set them against ours without prepare); {SG}'s attention is ungated, {VL}'s fuses "
            "the gate; the dense columns attend to every row's whole causal prefix, ungated.")
    checks = "\n".join(f"- {r.case.label} ({r.case.index_dtype}): {r.check or 'not checked'}"
                       + "".join(f"\n  - {n}" for n in r.notes) for r in results)
    text = f"{head}\n\n{table(results)}\n\nChecks and notes:\n{checks}\n"
    (out / "peers.md").write_text(text)
    return text


def versions() -> str:
    out = [bq.versions()]
    for dist in ("sglang", "sglang-kernel", "flash-attn-4", "nvidia-cutlass-dsl", "tilelang", "apache-tvm-ffi", "vllm",
                 "flashinfer-python"):
        try:
            from importlib.metadata import version

            out.append(f"{dist} {version(dist)}")
        except Exception:  # noqa: BLE001 - not installed
            pass
    return ", ".join(out)


# -- command line -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_qsa.py peers",
        description="Peer columns beside ours on the same caches and data, each checked against the reference "
        "before it is timed; writes DIR/peers.json and DIR/peers.md.")
    ap.add_argument("--out", type=Path, default=Path("bench-peers"), metavar="DIR",
                    help="folder for peers.json and peers.md; an existing peers.json there is resumed")
    ap.add_argument("--sglang-cuda", action="store_true",
                    help="SGLang 0.5.23's default CUDA path from the installed sglang (JIT fast_topk, its Hopper "
                    "decode attention through FlashAttention varlen, forward_extend's prefill route)")
    ap.add_argument("--vllm", action="store_true",
                    help="vLLM 0.33's upstream QSA ops from the installed vllm GPU wheel (bench_vllm.py: fused "
                    "prepare, scoring + top-k, expansion, sparse attention with the gate fused), FA3 dense "
                    "(vllm.vllm_flash_attn) and FlashInfer dense where importable")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: tiny shapes, SGLang's CPU routes, wall-clock times that mean nothing")
    ap.add_argument("--only", nargs="+", metavar="KEY", help="only these configurations (keys as in peers.json)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no configuration after this many seconds (0: no limit); rerun to resume")
    ap.add_argument("--config-timeout", type=float, default=0.0, metavar="S",
                    help=f"end the process (exit {bq.EXIT_ABORTED}) when one configuration runs past S seconds, "
                    "noting it in peers.json; a rerun resumes without it (0: no limit)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times the kernels under CUDA graphs; "
                 "--dry-run runs the checks on the CPU")
    if not (args.sglang_cuda or args.vllm):
        ap.error("name at least one peer (--sglang-cuda, --vllm)")
    return args


def load_sglang() -> tuple[object, str]:
    """SGLang's modules, or (None, why) when they do not import here."""
    try:
        import bench_sglang_cuda

        return bench_sglang_cuda.load(), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{SG}: {type(e).__name__}: {e}"[:600]


def load_vllm() -> tuple[object, str]:
    """vLLM's QSA op modules, or (None, why) when they do not import here."""
    try:
        import bench_vllm

        return bench_vllm.load(), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{VL}: {type(e).__name__}: {e}"[:600]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    todo = dry_cases() if args.dry_run else cases()
    if args.only:
        todo = [c for c in todo if c.key in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "peers.json"
    meta, done = rep.load(path) if path.exists() else ({}, [])
    code = bq.code_fingerprint()
    if done and meta.get("code") != code:
        print(f"{path}: written by other code ({meta.get('code')}, now {code}); starting over")
        meta, done = {}, []
    by_key = {r.case.key: r for r in done}
    method = ("one CPU wall-clock call (dry run: not a measurement)" if args.dry_run
              else "CUDA-graph replays, L2 flushed before each replay")
    meta.update(code=code, method=method, versions=versions(), when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)")
    mods, why = load_sglang() if args.sglang_cuda else (None, "")
    vllm, vllm_why = load_vllm() if args.vllm else (None, "")
    timer = bq.WallTimer() if args.dry_run else bq.GraphTimer()
    results = [by_key.get(c.key) or Result(c) for c in todo]
    others = [r for r in done if r.case.key not in {c.key for c in todo}]

    def save() -> None:
        rep.save(path, meta, results + others)

    failed = []
    for i, r in enumerate(results, 1):
        elapsed = time.perf_counter() - t0
        if r.done or any(n.startswith(bq.ABORTED) for n in r.notes):
            continue
        if args.budget_s and elapsed > args.budget_s:
            print(f"[{i}/{len(results)}] {r.case.label}: not started ({elapsed:.0f} s > --budget-s); rerun to resume")
            continue
        print(f"[{i}/{len(results)}] {r.case.label} ({r.case.index_dtype}) at {elapsed:.0f} s ...", flush=True)
        watchdog = None
        if args.config_timeout:
            watchdog = threading.Timer(args.config_timeout, bq.abort, args=(r, args.config_timeout, save))
            watchdog.daemon = True
            watchdog.start()
        try:
            measure(r.case, device, timer, mods, why, r, save, vllm=vllm, vllm_why=vllm_why)
        except Exception as e:  # noqa: BLE001 - our own check failed: this configuration stops
            r.notes.append(f"FAILED: {type(e).__name__}: {e}"[:400])
            failed.append(r.case.key)
        if watchdog is not None:
            watchdog.cancel()
        r.done = True
        save()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        print(f"    {r.check}; us: " + ", ".join(f"{k} {v:.1f}" for k, v in r.us.items())
              + "".join(f"\n    note: {n}" for n in r.notes), flush=True)
        render(args.out, [x for x in results if x.check or x.notes], meta)  # a run cut later keeps its table
    print(render(args.out, [r for r in results if r.check or r.notes], meta))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see the notes above)")
