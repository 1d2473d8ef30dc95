"""SPEC 2.7: in the top-k, -0.0 == +0.0; zeros of either sign tie and the lower group wins.

ReLU makes exact zeros, so the rule decides many rows, but the scoring paths seldom emit a
-0.0 (an fp32 sum that starts at +0.0 absorbs it). The scores are therefore injected where
the top-k reads them: straight into the reference's `topk_groups`, and into the Triton score
scratch in place of the score launch (both top-k routes: the fused kernel and radix passes).
"""

import math
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402

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


def test_reference_topk_ties_signed_zeros():
    s, vis = tie_scores(0)
    want = ranked(s, vis, spec_order)
    assert not torch.equal(ranked(s, vis, signed_order), want)  # the sign of zero reaches the boundary
    assert torch.equal(topk_groups(s, vis, KB), want)


@pytest.mark.parametrize("route", ["fused", "passes"])
def test_kernel_topk_ties_signed_zeros(monkeypatch, route):
    s, vis = tie_scores(1)
    want = ranked(s, vis, spec_order)
    assert not torch.equal(ranked(s, vis, signed_order), want)
    fused = route == "fused"
    monkeypatch.setattr(ker, "_FUSED_MAX_COLS", 1 << 30 if fused else 0)
    monkeypatch.setattr(ker, "_FUSED_MAX_ROWS", 1 << 30 if fused else 0)
    monkeypatch.setattr(ker, "ScoreLaunch", InjectedScores(s))
    sched = ker.plan_select(T, G, KB, decode=False, device=DEV)
    assert sched.scored and sched.fused == fused
    page, r = 16, 4
    out = ker.qsa_select_prefill(
        torch.zeros(T, 1, 16, device=DEV), torch.zeros(G * r // page + 1, page // r, 16, device=DEV),
        torch.arange(G * r // page + 1, dtype=torch.int32, device=DEV)[None, :], torch.zeros(T, dtype=torch.int32, device=DEV),
        vis.to(DEV), page_size=page, compress_ratio=r, block_topk=KB,
        out=torch.full((T, KB), 7, dtype=torch.int32, device=DEV), schedule=sched,
    )
    assert torch.equal(out.cpu(), want)
