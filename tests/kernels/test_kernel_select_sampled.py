"""The sampled decode top-k (`select_sampled`) against the reference top-k, indices exact.

Runs on the GPU when there is one, else in the Triton interpreter, with the small tiles
(segments of 32 columns, 16-entry lists, 32 candidates per row). The kernel alone reads
samples the test computes (the maxima of runs of S columns; entries past a row's samples
poisoned), so the bound, the lists, the pack, the last-arriver resolve and the whole-row
fallback are each crossed; through `plan_select` the score launch writes the samples
(one row per request: the decode kernel; two: the rows-per-request kernel).
"""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernel_select_topk import distinct, positions_of, reference  # noqa: E402

from qsa_kernels.select_sampled import (  # noqa: E402
    SampledTopkLaunch, sampled_scratch, sampled_scratch_elems, sampled_tiles, samples_view,
)

R = 4
POISON = 0x7F000000  # a sample above every key: read past a row's samples, the bound breaks


def run_sampled(rows: list[torch.Tensor], num_cols: int, kb: int, *, row0: int = 0, calls: int = 2,
                packed: bool = False, **tile_changes) -> torch.Tensor:
    """Kernel top-k of score rows (row i: its visible scores) from host-computed samples.
    The scratch beyond each row's visible columns is NaN; out rows before row0 must stay -7."""
    T = len(rows)
    tiles = {**sampled_tiles(num_cols, kb, 16, small=True), **tile_changes}
    S = tiles["S"]
    scores = torch.full((T, num_cols), float("nan"), device=DEV)
    scratch = sampled_scratch(sampled_scratch_elems(T, num_cols, tiles), DEV)
    samples = samples_view(scratch, T, tiles)
    samples.fill_(POISON)
    for i, r in enumerate(rows):
        scores[i, : r.numel()] = r.to(DEV)
        key = r.view(torch.int32) & 0x7FFFFFFF
        n = -(-r.numel() // S)
        padded = torch.full((n * S,), -1, dtype=torch.int32)
        padded[: r.numel()] = key
        samples[i, :n] = padded.view(n, S).amax(1).to(DEV)
    vis = torch.tensor([0] * row0 + [r.numel() for r in rows], dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.full((row0,), -1, dtype=torch.int64), positions_of(rows)]).to(DEV) if packed else None
    width = kb * R + R if packed else kb
    out = torch.full((row0 + T, width), -7, dtype=torch.int32, device=DEV)
    launch = SampledTopkLaunch(scores, vis, out, scratch, row0=row0, rows=T, num_cols=num_cols, block_topk=kb,
                               tiles=tiles, positions=pos, compress_ratio=R)
    for _ in range(calls):
        out[row0:] = -7
        launch(row0, out, out.stride(0))
    assert (out[:row0] == -7).all(), "rows before the chunk were written"
    assert (scratch.arrive == 0).all(), "an arrival counter was left set"
    return out[row0:].cpu()


def test_small_tiles_cross_every_border():
    t = sampled_tiles(300, 8, 16, small=True)
    assert t["seg"] < 300 and t["S"] < 16 and -(-300 // t["S"]) >= 4 * 8


@pytest.mark.parametrize("num_cols, kb, packed, lbits, bound", [(300, 8, False, 31, 0), (300, 16, True, 31, 4),
                                                                (60, 8, False, 31, 0), (300, 8, False, 12, 0)])
def test_random_scores(num_cols, kb, packed, lbits, bound):
    # lbits 12: a coarser bound (its 12 high key bits), more candidates, the same result; bound 4:
    # the bounds from a launch of their own.
    rows = [distinct(num_cols, s) for s in range(2)] + [distinct(num_cols - 5, 9), distinct(min(num_cols, 41), 4)]
    got = run_sampled(rows, num_cols, kb, packed=packed, lbits=lbits, bound=bound)
    assert torch.equal(got, reference(rows, num_cols, kb, packed))


def test_ties_at_the_threshold_and_crowded_lists():
    # Row 0: 12 keys tied at the threshold spread over the row; row 1: all equal (every list
    # overflows: the whole-row resolve); row 2: the top keys crowd one segment (its list overflows).
    num_cols = 300
    g = torch.Generator().manual_seed(3)
    row = torch.rand(num_cols, generator=g)
    tie_at = torch.randperm(num_cols, generator=g)[:17]
    row[tie_at[:12]] = 2.0
    row[tie_at[12:]] = 3.0 + torch.arange(5.0)
    crowded = distinct(num_cols, 21)
    crowded[130:150] = 20.0 + torch.arange(20.0)
    rows = [row, torch.full((num_cols,), 1.5), crowded]
    for packed in (False, True):
        assert torch.equal(run_sampled(rows, num_cols, 8, packed=packed), reference(rows, num_cols, 8, packed))


def test_rows_at_or_below_kb_padding_rows_and_batch_invariance():
    num_cols = 300
    rows = [distinct(n, n) for n in (0, 7, 8, 9, 300, 130)]  # 0: a padding row (visible 0)
    rows[5][::3] = 0.5  # ties in one row only
    assert torch.equal(run_sampled(rows, num_cols, 8, row0=2, packed=True), reference(rows, num_cols, 8, True))
    got = run_sampled(rows, num_cols, 8, row0=2)
    assert torch.equal(got, reference(rows, num_cols, 8))
    for i, r in enumerate(rows):
        assert torch.equal(got[i], run_sampled([r], num_cols, 8, calls=1)[0]), f"row {i} depends on the batch"


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [2, 2, 2, 2]])
def test_decode_select_through_the_plan(query_lens, monkeypatch):
    # The score launch writes the samples (one row per request: the decode kernel; two: the
    # rows-per-request kernel); integer data, tie-heavy; rows of 0, < Kb and several segments.
    from test_kernel_select import make_problem
    from qsa_core.reference import select as ref
    from qsa_kernels import select as ker

    from qsa_kernels import select_score

    monkeypatch.setattr(ker, "_SAMPLED_MIN_COLS", 1)
    monkeypatch.setattr(select_score, "EARLY_LOADS", query_lens[0] == 1)  # (the decode kernel's early loads)
    monkeypatch.setattr(ker, "_score_scratch", lambda rows, cols, device: torch.full(
        (rows, cols), float("nan"), device=device))
    kw = dict(page_size=16, compress_ratio=R, block_topk=8)
    for kind in ("int", "bf16"):
        q, comp, table, to_req, vis, max_seq = make_problem([1200, 600, 20, 900], query_lens, kind=kind, pad_rows=1)
        T = q.shape[0]
        s = ker.plan_select(T, max_seq // R, 8, decode=True, device=DEV, rows_per_request=query_lens[0])
        assert s.sampled is not None and s.sampled_tiles["seg"] < max_seq // R
        out = torch.full((T, 8), 7, dtype=torch.int32, device=DEV)
        ker.qsa_select_decode(q, comp, table, to_req, vis, out=out, schedule=s, **kw)
        expect = ref.qsa_select_decode(q, comp, table, to_req, vis, out=torch.empty_like(out), **kw)
        assert torch.equal(out, expect), kind


def test_the_select_workspace_holds_every_decode_plan_of_this_route(monkeypatch):
    from qsa_kernels import select as ker

    monkeypatch.setattr(ker, "_SAMPLED_MIN_COLS", 64)
    ws = ker.select_workspace(40, 1200 // 4, 8, DEV)
    for rows in (1, 4, 16, 17, 40):
        for cols in (32, 64, 128, 300):
            for rpr in (1, 4):
                s = ker.plan_select(rows, cols, 8, decode=True, device=DEV, workspace=ws, rows_per_request=rpr)
                assert (s.sampled is not None) == (cols >= 64 and rows <= 16)
                assert s.sampled is None or s.sampled is ws.sampled


@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_fused_short_select_through_the_plan(kind, monkeypatch):
    # `select_fused`: scores and the top-k in one launch (the last program of a row resolves
    # it); rows of several spans, one span, < Kb and padding; groups and packed rows, twice.
    from test_kernel_select import make_problem
    from qsa_core.reference import select as ref
    import dataclasses

    from qsa_core.reference.expand import qsa_expand
    from qsa_kernels import select as ker, select_score

    tiles = ker.score_tiles
    monkeypatch.setattr(ker, "score_tiles", lambda *a: dataclasses.replace(tiles(*a), span=tiles(*a).block_g))
    monkeypatch.setattr(ker, "_FUSED_SHORT_MAX_ROWS", 4)  # (spans of one 16-column tile: 2 programs a row)
    monkeypatch.setattr(select_score, "EARLY_LOADS", kind == "int")
    monkeypatch.setattr(ker, "_score_scratch", lambda rows, cols, device: torch.full(
        (rows, cols), float("nan"), device=device))
    kw = dict(page_size=16, compress_ratio=R, block_topk=8)
    q, comp, table, to_req, vis, max_seq = make_problem([128, 60, 20], [1, 1, 1], kind=kind, pad_rows=1)
    T = q.shape[0]
    s = ker.plan_select(T, max_seq // R, 8, decode=True, device=DEV)
    assert s.fused_short and s.sampled is None and s.topk is None
    expect = ref.qsa_select_decode(q, comp, table, to_req, vis, out=torch.empty(T, 8, dtype=torch.int32, device=DEV),
                                   **kw)
    pos = torch.where(vis > 0, vis * R + 1, -1).long()
    packed = qsa_expand(expect, pos, vis, compress_ratio=R, out=torch.empty(T, 8 * R + R, dtype=torch.int32,
                                                                             device=DEV))
    for positions, want in ((None, expect), (pos, packed)):
        out = torch.full_like(want, 7)
        launch = ker.SelectLaunch(s, q, comp, table, to_req, vis, out, positions=positions, **kw)
        for _ in range(2):
            out.fill_(7)
            launch(q, table, out)
            assert torch.equal(out, want), positions is not None
    assert (s.arrive == 0).all()
