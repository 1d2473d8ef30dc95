"""The one-launch short decode selection (`select_short`, QSA_SHORT_FUSED) against main's two
launches (the decode score kernel, then `select_topk`'s short top-k) and the reference.

Runs in the Triton interpreter on the CPU (on the GPU when there is one). The interpreter's
short route takes rows of <= 32 columns; `wide` lifts it to 256 columns (the route's tiles
otherwise), so a row crosses up to 16 spans of 16 columns, and each row's last arriver runs
the top-k. Every check is bitwise: main's route on the same inputs (float data: the same ops
in the same order), and the reference where scores are exact (integer data: ties, zeros).
"""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernel_select import make_problem  # noqa: E402

from qsa_core.reference import select as ref  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402
from qsa_kernels import select_short, select_topk  # noqa: E402

R, PAGE, KB = 4, 16, 8


@pytest.fixture
def wide(monkeypatch):
    """The short route up to 256 columns (the interpreter's tiles otherwise), its search with
    2^sbits counts a step as the test asks (`_kth_bound`); the score scratch poisoned with NaN."""
    tiles = select_topk.topk_tiles

    def set_sbits(sbits: int) -> None:
        monkeypatch.setattr(select_topk, "topk_tiles", lambda n, small, rows=1: {
            **tiles(n, small, rows), "short": 256, "sbits": sbits})

    monkeypatch.setattr(ker, "_score_scratch", lambda rows, cols, device: torch.full(
        (rows, cols), float("nan"), device=device))
    set_sbits(2)
    return set_sbits


def positions(seq_lens, query_lens, pad_rows):
    """Each decode row's position (make_problem's: the last query_len of its request), -1 padding."""
    pos = [s - q + j for s, q in zip(seq_lens, query_lens) for j in range(q)]
    return torch.tensor(pos + [-1] * pad_rows, dtype=torch.int64, device=DEV)


def select(problem, pos, *, fused, packed, rows_per_request=1, calls=2, workspace=None):
    """Decode select of the problem through plan_select / SelectLaunch, the fused route on or
    off (MTP: never taken); out int32 [T, Kb] or the packed rows [T, Kb * r + r]."""
    q, comp, table, to_req, vis, max_seq = problem
    T = q.shape[0]
    s = ker.plan_select(T, max_seq // R, KB, decode=True, device=DEV, rows_per_request=rows_per_request,
                        short_fused=fused, workspace=workspace)
    assert (s.short is not None) == (fused and rows_per_request == 1), "the plan did not take the asked route"
    out = torch.full((T, KB * R + R if packed else KB), -7, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(s, q, comp, table, to_req, vis, out, page_size=PAGE, compress_ratio=R, block_topk=KB,
                              positions=pos if packed else None)
    results = []
    for _ in range(calls):  # the counters left at zero: the second call is the same
        out.fill_(-7)
        launch(q, table, out)
        results.append(out.clone())
    assert all(torch.equal(r, results[0]) for r in results)
    if s.short is not None:
        assert (s.short == 0).all(), "arrival counters not left at zero"
    return results[0].cpu()


def reference(problem, pos, packed):
    q, comp, table, to_req, vis, _ = problem
    blocks = ref.qsa_select_prefill(q, comp, table, to_req, vis, page_size=PAGE, compress_ratio=R, block_topk=KB,
                                    out=torch.empty(q.shape[0], KB, dtype=torch.int32, device=DEV)).cpu()
    if not packed:
        return blocks
    out = torch.empty(q.shape[0], KB * R + R, dtype=torch.int32)
    return qsa_expand(blocks, pos.cpu(), vis.cpu(), compress_ratio=R, out=out)


def check(seq_lens, query_lens, *, kind, pad_rows=0, seed=0, rows_per_request=1, zero_rows=()):
    """Fused == main bitwise, groups and packed rows; == the reference for integer data."""
    problem = make_problem(seq_lens, query_lens, kind=kind, pad_rows=pad_rows, seed=seed)
    for t in zero_rows:  # every score 0: the lowest groups
        problem[0][t] = 0
    pos = positions(seq_lens, query_lens, pad_rows)
    for packed in (False, True):
        got = select(problem, pos, fused=True, packed=packed, rows_per_request=rows_per_request)
        main = select(problem, pos, fused=False, packed=packed, rows_per_request=rows_per_request, calls=1)
        assert torch.equal(got, main)
        if kind == "int":
            assert torch.equal(got, reference(problem, pos, packed))


@pytest.mark.parametrize("sbits", [2, 3])
@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_b1(wide, sbits, kind):
    wide(sbits)  # 250 columns: 16 spans, the last a partial one
    check([1000], [1], kind=kind, seed=sbits)


@pytest.mark.parametrize("sbits", [2, 3])
def test_b4_mixed_visible_ties_and_zeros(wide, sbits):
    # visible 250 (column bound), 9 (Kb + 1: one span), 8 (== Kb: unscored), 33 (3 spans, a
    # partial one), 0-score row (ties at zero), padding rows.
    wide(sbits)
    check([1000, 36, 32, 132, 700], [1] * 5, kind="int", pad_rows=2, seed=2, zero_rows=(4,))


@pytest.mark.parametrize("sbits", [2, 3])
def test_b64(wide, sbits):
    # 64 rows of 4..128 columns (rows <= Kb among them) in one chunk: batch-invariant rows.
    wide(sbits)
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(16, 512, (64,), generator=g).tolist()
    check(seq, [1] * 64, kind="int", seed=3)


def test_fp8_keys(wide):
    check([1000, 300], [1, 1], kind="fp8", seed=4)


def test_interpreter_tiles_two_spans():
    # The interpreter's own short route: 32 columns, spans of 16 (no monkeypatch).
    check([128, 100, 40], [1, 1, 1], kind="int", pad_rows=1, seed=5)
    check([128, 77], [1, 1], kind="bf16", seed=6)


def test_mtp_rows_keep_mains_route(wide):
    # rows_per_request 3: main scores a request's rows together (another head-sum order on
    # the GPU), so the switch leaves those chunks on main's two launches.
    check([900, 400, 60], [3, 3, 3], kind="int", pad_rows=1, seed=8, rows_per_request=3)


def test_workspace_counters_and_route(wide, monkeypatch):
    # The planner's workspace serves the route (its radix counters, left at zero); the
    # switch is read when a schedule is made; long rows, more than 64 rows, prefill never take it.
    ws = ker.select_workspace(64, 1024, KB, DEV)
    problem = make_problem([1000, 200], [1, 1], kind="int", seed=9)
    pos = positions([1000, 200], [1, 1], 0)
    got = select(problem, pos, fused=True, packed=True, workspace=ws)
    assert torch.equal(got, reference(problem, pos, True)) and (ws.arrive == 0).all()
    monkeypatch.setenv("QSA_SHORT_FUSED", "1")
    assert ker.plan_select(2, 250, KB, decode=True, device=DEV, workspace=ws).short is not None
    assert ker.plan_select(2, 300, KB, decode=True, device=DEV, workspace=ws).short is None  # > short
    assert ker.plan_select(2, 250, KB, decode=False, device=DEV, workspace=ws).short is None
    assert ker.plan_select(2, KB, KB, decode=True, device=DEV, workspace=ws).short is None  # nothing scored
    many = ker.plan_select(65, 250, KB, decode=True, device=DEV)
    assert many.topk is not None and many.short is None  # the short top-k of 65 rows: two launches
    monkeypatch.setenv("QSA_SHORT_FUSED", "0")
    assert ker.plan_select(2, 250, KB, decode=True, device=DEV, workspace=ws).short is None
    assert select_short.enabled() is False


SM90_COMPILE = """
import re, subprocess, tempfile, os
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qsa_kernels import select_short as ss, select_topk as stk
fn = ss._select_short_kernel
dump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for cols, key, packed, warps in ((2048, "*bf16", True, 16), (4096, "*bf16", True, 16), (2048, "*bf16", False, 16),
                                 (2048, "*fp8e4nv", True, 16), (1024, "*bf16", True, 16), (2048, "*bf16", True, 8)):
    t = stk.topk_tiles(cols, small=False)
    const = dict(HI=4, DI=128, HM=16, DP=128, PAGE=64, R=4, KB=512, BLOCK_G=128, STAGES=3, DOT_DTYPE=tl.bfloat16,
                 SPAN_TILES=0, KBP=512, CAP=cols, SBITS=t["sbits"], PACKED=packed, RP=4 if packed else 1,
                 W=2051 if packed else 1, BLOCK_W=1024 if packed else 1)
    types = dict(q_ptr=key, k_ptr=key, s_ptr="*fp32", pos_ptr="*i64", norm="fp32")
    sig = {n: "constexpr" if n in const else types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    usage = "-1 -1"
    if os.path.exists(dump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            out = subprocess.run([dump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\\d+) STACK:(\\d+)", out)
        usage = f"{m.group(1)} {m.group(2)}" if m else usage
    print(cols, key, packed, warps, t["sbits"], usage)
"""


def test_compiles_for_sm90_without_spills():
    """The kernel at the H200's tiles (4K, 8K and 16K contexts, bf16 or fp8 keys, packed or
    not, 16 and 8 warps) compiles here without a GPU, with no spill stack."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.strip().splitlines()]
    assert len(lines) == 6, run.stdout
    for *_, regs, stack in lines:
        assert int(stack) <= 0, lines  # (-1: no cuobjdump to read it)
