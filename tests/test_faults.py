"""Faults in a real row: NaN or Inf hidden states poison only their own request.

Outcome (both backends): the poisoned request's K/V, ring and compressed rows may hold NaN
and its outputs at and after the poisoned row change (NaN or Inf with the reference; the
Triton kernels' max / exp may turn them into finite garbage); its earlier rows equal a clean
run's up to fp32 summation order, and every other request's cache rows and outputs are
bitwise what a clean run gives.
"""

import functools

import pytest
import torch

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core.standalone import Runner

HIDDEN = 256
LENS = {"a": 37, "b": 29, "c": 41}
STEPS = [{"a": 20, "b": 29, "c": 9}, {"a": 1, "c": 24}, {"a": 16, "c": 8}]


def runner():
    layers = [QSAAttention.from_hf(random_hf_attention(tiny_config(), seed)).to(DEVICE) for seed in (0, 1)]
    return Runner(layers, page_size=8, num_pages=40, max_requests=4, shuffle_pages=True)


def run(xs):
    r = runner()
    done = {k: 0 for k in xs}
    outs = {k: [] for k in xs}
    for step in STEPS:
        res = r.step({k: xs[k][done[k] : done[k] + n] for k, n in step.items()})
        for k, n in step.items():
            outs[k].append(res[k].cpu())
            done[k] += n
    return r, {k: torch.cat(v) for k, v in outs.items()}


def request_rows(r, rid):
    """The cache rows request `rid` owns: main slots, compressed rows, ring rows."""
    req = r._requests[rid]
    ps, ratio, C = r.page_size, r.config.compress_ratio, r.layout.ring_capacity(r.config)
    slots = torch.tensor([p * ps + o for p in req.pages for o in range(ps)])
    return slots, torch.unique(slots // ratio), torch.arange(req.ring * C, (req.ring + 1) * C)


def rows_of(t):
    """One row per flat slot: every cache is paged [pages, rows per page, ...]."""
    return t.flatten(0, 1)


NAN, INF = float("nan"), float("inf")
# rows: 3 in the first chunk, 21 a decode row, 30 a later chunk. The interpreted kernels take
# one case per value (CI time); the reference takes every pair.
CASES = [pytest.param("reference", bad, row, id=f"reference-{bad}-{row}")
         for bad in (NAN, INF, -INF) for row in (3, 21, 30)]
CASES += [pytest.param("triton", bad, row, id=f"triton-{bad}-{row}") for bad, row in ((NAN, 21), (INF, 3), (-INF, 30))]


def clean_inputs() -> dict[str, torch.Tensor]:
    """Each request's hidden states [LENS[k], HIDDEN] fp32, the same on every call."""
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(n, HIDDEN, generator=g) + torch.randn(HIDDEN, generator=g) for k, n in LENS.items()}


@functools.cache
def clean_run(backend: str):
    """`run` of the clean inputs with `backend` (QSA_BACKEND), once per process: tests only read it."""
    return run(clean_inputs())


@pytest.mark.parametrize("backend,bad,row", CASES, indirect=["backend"])
def test_non_finite_hidden_state_stays_in_its_request(backend, bad, row):
    poisoned = clean_inputs()
    poisoned["a"][row, 5] = bad
    r_clean, want = clean_run(backend)
    r_bad, got = run(poisoned)

    for k in ("b", "c"):
        assert torch.equal(got[k], want[k]), k
    # Its earlier rows are untouched up to fp32 summation order: the reference gathers a
    # chunk's selections once and a poisoned request falls back to one row at a time.
    torch.testing.assert_close(got["a"][:row], want["a"][:row], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got["a"][row:], want["a"][row:])  # the fault reached its own request

    slots, comp_rows, ring_rows = request_rows(r_bad, "a")
    for c_bad, c_clean in zip(r_bad.caches, r_clean.caches):
        for name, own in (("k", slots), ("v", slots), ("compressed", comp_rows), ("ring", ring_rows)):
            a, b = (rows_of(getattr(c, name)) for c in (c_bad, c_clean))
            differs = (~((a == b) | (a.isnan() & b.isnan()))).reshape(a.shape[0], -1).any(1).nonzero().flatten()
            assert set(differs.tolist()) <= set(own.tolist()), name
            others = torch.ones(a.shape[0], dtype=torch.bool)
            others[own] = False
            assert torch.isfinite(a[others.to(a.device)].float()).all(), name
