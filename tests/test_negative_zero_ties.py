"""design.md §2.7: in the top-k, -0.0 == +0.0; zeros of either sign tie and the lower group wins.

ReLU makes exact zeros, so the rule decides many rows, but the scoring paths seldom emit a
-0.0 (an fp32 sum that starts at +0.0 absorbs it). The scores are therefore injected where
the top-k reads them: straight into the reference's `topk_groups`, and into the Triton score
scratch in place of the score launch (prefill: select_radix's fused kernel and radix passes;
decode: the per-row-samples route, whose sample launch then reads them).
"""

import math
import os
from dataclasses import replace

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402
from kernel_options import OPTS  # noqa: E402

T, G, KB = 24, 40, 8


def tie_scores(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [T, G] that are +0.0 or -0.0 except fewer than Kb positive groups per row, and
    visible [T] > Kb: every row's top-k boundary falls inside a signed-zero tie."""
    g = torch.Generator().manual_seed(seed)
    s = torch.where(torch.rand(T, G, generator=g) < 0.5, -0.0, 0.0)
    for t in range(T):
        idx = torch.randperm(G, generator=g)[: t % KB]
        s[t, idx] = torch.rand(idx.numel(), generator=g) + 0.5
    return s, torch.randint(KB + 1, G + 1, (T,), generator=g).to(torch.int32)


def ranked(s: torch.Tensor, vis: torch.Tensor, key) -> torch.Tensor:
    """int32 [T, Kb]: the first Kb groups of each row by `key(value, group)`, ascending."""
    out = torch.full((T, KB), -1, dtype=torch.int32)
    for t in range(T):
        best = sorted(range(int(vis[t])), key=lambda g: key(float(s[t, g]), g))[:KB]
        out[t, : len(best)] = torch.tensor(sorted(best), dtype=torch.int32)
    return out


def spec_order(v: float, g: int):
    return (-(v + 0.0), g)  # -0.0 + 0.0 == +0.0


def signed_order(v: float, g: int):
    return (-v, math.copysign(1.0, v) < 0, g)  # a wrong rule: +0.0 above -0.0


class InjectedScores:
    """Stands in for `ScoreLaunch` (same constructor): its launches write the given scores
    into the scratch rows."""

    def __init__(self, scores: torch.Tensor) -> None:
        self.scores = scores

    def __call__(self, q_idx, compressed, block_table, token_to_req, visible_blocks, scratch, **kwargs):
        def launch(q_idx, block_table, row0):
            n = min(scratch.shape[0], self.scores.shape[0] - row0)
            scratch[:n, : self.scores.shape[1]] = self.scores[row0 : row0 + n].to(scratch.device)

        return launch


def run_select(sched, vis: torch.Tensor, decode: bool) -> torch.Tensor:
    """The Triton selection int32 [T, Kb] through `sched` over placeholder queries and keys
    (`InjectedScores` stands in for their scores)."""
    page, r = 16, 4
    pages = G * r // page + 1
    q, table = torch.zeros(T, 1, 16, device=DEV), torch.arange(pages, dtype=torch.int32, device=DEV)[None, :]
    out = torch.full((T, KB), 7, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(sched, q, torch.zeros(pages, page // r, 16, device=DEV), table,
                              torch.zeros(T, dtype=torch.int32, device=DEV), vis.to(DEV), out, page_size=page,
                              compress_ratio=r, block_topk=KB)
    return launch(q, table, out).cpu()


def test_reference_topk_ties_signed_zeros():
    s, vis = tie_scores(0)
    want = ranked(s, vis, spec_order)
    assert not torch.equal(ranked(s, vis, signed_order), want)  # the sign of zero reaches the boundary
    assert torch.equal(topk_groups(s, vis, KB), want)


@pytest.mark.parametrize("route", ["fused", "radix"])
def test_kernel_topk_ties_signed_zeros(monkeypatch, route):
    s, vis = tie_scores(1)
    want = ranked(s, vis, spec_order)
    assert not torch.equal(ranked(s, vis, signed_order), want)
    fused = route == "fused"
    monkeypatch.setattr(ker, "_FUSED_MAX_COLS", 1 << 30 if fused else 0)
    monkeypatch.setattr(ker, "_FUSED_MAX_ROWS", 1 << 30 if fused else 0)
    monkeypatch.setattr(ker, "ScoreLaunch", InjectedScores(s))
    sched = ker.plan_select(T, G, KB, decode=False, device=DEV, options=OPTS)
    assert sched.scored and sched.route == route
    assert torch.equal(run_select(sched, vis, decode=False), want)


@pytest.mark.interpreter  # (G columns take this route with the interpreter's small tiles only)
def test_kernel_dsamp_ties_signed_zeros(monkeypatch):
    """The per-row-samples decode route: MTP rows (4 a request), whose samples come from the
    route's own sample launch over the scores. Every zero reaches a row's bound, so rows of at
    most cap columns resolve from their candidate lists, longer ones by the whole-row resolve."""
    s, vis = tie_scores(2)
    want = ranked(s, vis, spec_order)
    assert not torch.equal(ranked(s, vis, signed_order), want)
    monkeypatch.setattr(ker, "ScoreLaunch", InjectedScores(s))
    sched = ker.plan_select(T, G, KB, decode=True, device=DEV, rows_per_request=4,
                            options=replace(OPTS, decode_samples=True))
    assert sched.route == "dsamp" and sched.decode_samples_tiles.sample_launch
    cap = sched.decode_samples_tiles.cap
    assert (vis <= cap).any() and (vis > cap).any()
    assert torch.equal(run_select(sched, vis, decode=True), want)
