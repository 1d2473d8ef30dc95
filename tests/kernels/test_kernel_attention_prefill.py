"""Shared-tile prefill attention against the reference and the per-row kernel (interpreter on
CPU, compiled on GPU)."""

import os
from dataclasses import replace

import pytest
import torch
from paged import shuffled_block_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference.attention import qsa_sparse_attention as reference  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_kernels import attention as per_row  # noqa: E402
from qsa_kernels import attention_prefill as ker  # noqa: E402
from kernel_options import OPTS  # noqa: E402

import entry  # noqa: E402

R = 4


def chosen(vis: int, prev: torch.Tensor | None, kb: int, overlap: float, g: torch.Generator) -> torch.Tensor:
    """kb groups of [0, vis) (all of them if vis <= kb): each of the previous row's groups kept
    with probability `overlap`, the rest drawn at random."""
    if vis <= kb:
        return torch.arange(vis)
    keep = prev[prev < vis] if prev is not None else torch.empty(0, dtype=torch.long)
    keep = keep[torch.rand(keep.numel(), generator=g) < overlap]
    free = torch.ones(vis, dtype=torch.bool)
    free[keep] = False
    rest = free.nonzero().flatten()
    rest = rest[torch.randperm(rest.numel(), generator=g)[: kb - keep.numel()]]
    return torch.cat([keep, rest]).sort().values


def make_prefill(seq_lens, query_lens, *, Hq=6, Hkv=2, D=32, page=16, Kb=6, overlap=0.0, dtype=torch.float32,
                 kv_dtype=None, pad_rows=0, device=DEV, seed=0):
    """Prefill chunks (the last query_lens[i] positions of request i) over a shuffled paged
    cache, with packed rows as the top-k writes them (`qsa_expand`): Kb chosen groups, ascending,
    then the open tail. Padding rows: NaN q and gate, all -1, count 0.
    Returns (q, gate, k, v, block_table, token_to_req, seq_lens, selection)."""
    g = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(seq_lens, page, g, spare_cols=2, spare_pages=2)
    k = torch.randn(num_pages, page, Hkv, D, generator=g).to(kv_dtype or dtype)
    v = torch.randn(num_pages, page, Hkv, D, generator=g).to(kv_dtype or dtype)
    blocks, pos, reqs = [], [], []
    for i, (s, lq) in enumerate(zip(seq_lens, query_lens)):
        prev = None
        for p in range(s - lq, s):
            vis = (p + 1) // R
            prev = chosen(vis, prev, Kb, overlap, g)
            blocks.append(torch.cat([prev, torch.full((Kb - prev.numel(),), -1, dtype=torch.long)]))
            pos.append(p)
            reqs.append(i)
    for _ in range(pad_rows):
        blocks.append(torch.full((Kb,), -1, dtype=torch.long))
        pos.append(-1)
        reqs.append(0)
    T = len(pos)
    positions = torch.tensor(pos)
    vis = torch.where(positions >= 0, (positions + 1) // R, 0)
    sel = torch.empty(T, Kb * R + R, dtype=torch.int32)
    qsa_expand(torch.stack(blocks).int(), positions, vis.int(), compress_ratio=R, out=sel)
    q = torch.randn(T, Hq, D, generator=g)
    gate = torch.randn(T, Hq, D, generator=g) * 2
    if pad_rows:
        q[-pad_rows:] = float("nan")
        gate[-pad_rows:] = float("nan")
    tensors = (q.to(dtype), gate.to(dtype), k, v, table, torch.tensor(reqs, dtype=torch.int32),
               torch.tensor(seq_lens, dtype=torch.int32), sel)
    return tuple(t.to(device) for t in tensors)


def attend(problem, *, ratio=ker.MAX_UNION_RATIO, block_rows=None, k_scale=1.0, v_scale=1.0):
    """(out, schedule) of the shared-tile kernel; out poisoned first."""
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    sched = ker.plan_prefill_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, R, device=q.device,
                                       block_rows=block_rows, max_union_ratio=ratio, options=OPTS)
    out = torch.full((T, Hq * D), 7.0, dtype=q.dtype, device=q.device)
    entry.prefill_attention(*problem, softmax_scale=D**-0.5, k_scale=k_scale, v_scale=v_scale, out=out,
                              schedule=sched)
    return out, sched


def per_row_kernel(problem, **kw):
    q, k, sel = problem[0], problem[2], problem[-1]
    T, Hq, D = q.shape
    sched = per_row.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, options=OPTS)
    out = torch.empty(T, Hq * D, dtype=q.dtype, device=q.device)
    return entry.sparse_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched, **kw)


def compare(problem, *, tol=1e-5, k_scale=1.0, v_scale=1.0, with_per_row=False, **kw):
    """The shared-tile kernel against the reference (and `attention.py`'s kernel)."""
    D = problem[0].shape[-1]
    out, sched = attend(problem, k_scale=k_scale, v_scale=v_scale, **kw)
    expect = reference(*problem, softmax_scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), expect.float(), rtol=tol, atol=tol)
    if with_per_row:
        torch.testing.assert_close(out.float(), per_row_kernel(problem, k_scale=k_scale, v_scale=v_scale).float(),
                                   rtol=tol, atol=tol)
    return out, sched


def shared_blocks(sched) -> torch.Tensor:
    return sched.info[:, 0] >= 0


def runs_of_block(sel: torch.Tensor, rows: range) -> list[tuple[int, int]]:
    """Sorted (group first token, bitmask) of each run of consecutive rows of the block holding
    a group, from packed rows."""
    W = sel.shape[1] - 1
    held = [{x - x % R for x in sel[t, : int(sel[t, W])].tolist()} for t in rows]
    runs = []
    for i, groups in enumerate(held):
        for first in groups:
            if i > 0 and first in held[i - 1]:
                continue
            bits, j = 0, i
            while j < len(held) and first in held[j]:
                bits |= 1 << j
                j += 1
            runs.append((first, bits))
    return sorted(runs)


def slot_of(problem, req: int, token: int) -> int:
    """The KV slot of a request's token through the block table (page x page_size + offset)."""
    table, page = problem[4].cpu(), problem[2].shape[1]
    return int(table[req, token // page]) * page + token % page


def slot_runs(problem, rows: range) -> list[tuple[int, int]]:
    """`runs_of_block` with each group's first token as its KV slot, as the union pass writes it."""
    req = int(problem[5][rows[0]])
    return sorted((slot_of(problem, req, first), bits) for first, bits in runs_of_block(problem[-1].cpu(), rows))


def block_runs(sched, b: int) -> list[tuple[int, int]]:
    n = int(sched.info[b, 0])
    return sorted(zip(sched.union_tokens[b, :n].tolist(), sched.union_masks[b, :n].tolist()))


def test_identical_rows_share_one_union():
    """A chunk whose rows see at most Kb groups selects everything: every block is shared (at
    ratio 0.5) and its runs are the groups of its last row, each once (as the KV slot of its first
    token), with the bits of the rows that see it; each row's last entry and the request's last
    token go with them as KV slots."""
    problem = make_prefill([23], [23], seed=1)
    out, sched = compare(problem, block_rows=5, ratio=0.5)
    sel = problem[-1].cpu()
    assert shared_blocks(sched).all()
    for b in range(sched.info.shape[0]):
        rows = range(5 * b, min(5 * b + 5, 23))
        runs = slot_runs(problem, rows)
        assert block_runs(sched, b) == runs
        assert len(runs) == len({first for first, _ in runs})  # one run per group
        assert int(sched.info[b, 1]) == slot_of(problem, 0, 22)
    assert sched.last.tolist() == [slot_of(problem, 0, int(sel[t, int(sel[t, -1]) - 1])) for t in range(23)]


@pytest.mark.parametrize("overlap", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("block_rows", [5, None])
def test_overlap_two_requests_padding(overlap, block_rows):
    """Chunks of two requests (a block straddling them falls back) and padding rows (exact 0)."""
    problem = make_prefill([70, 41], [12, 7], overlap=overlap, pad_rows=3, seed=int(overlap * 10))
    out, sched = compare(problem, block_rows=block_rows, with_per_row=overlap == 0.7)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


@pytest.mark.parametrize("kb", [6, 32])
def test_runs_of_groups_that_skip_rows(kb):
    """A group held by rows 0 and 2 of a block but not row 1 gets two runs (each row once). Kb 32:
    a row's 33 groups are searched as a tile of 32 and one of 16 (`union_tiles`)."""
    problem = make_prefill([400], [10], overlap=0.5, Kb=kb, seed=14)
    out, sched = compare(problem, ratio=1e9, block_rows=5)
    sel = problem[-1].cpu()
    for b in range(2):
        assert block_runs(sched, b) == slot_runs(problem, range(5 * b, 5 * b + 5))
    assert any(len(runs_of_block(sel, range(5 * b, 5 * b + 5))) > len({f for f, _ in runs_of_block(
        sel, range(5 * b, 5 * b + 5))}) for b in range(2))


def test_union_tiles_pad_less_than_one_tile():
    """A row's groups are searched in whole tiles plus one narrow tile, where that has fewer
    lanes than one padded tile: W 2051 (513 groups) takes 512 + 16 lanes."""
    assert ker.union_tiles(513) == (512, 16)
    assert ker.union_tiles(33) == (32, 16)
    assert ker.union_tiles(7) == (8, 16)  # 4 + 16 lanes would be more
    assert ker.union_tiles(1000) == (1024, 16)
    assert ker.union_tiles(1025) == (1024, 16)


def test_every_block_shared_or_per_row():
    """The same rows are exact whichever way the blocks go: all shared (ratio above any union),
    all per-row (ratio 0 leaves only empty blocks shared)."""
    problem = make_prefill([90], [15], overlap=0.3, pad_rows=5, seed=3)
    out_all, sched = compare(problem, ratio=1e9, block_rows=5)
    assert shared_blocks(sched).all()
    out_none, sched = compare(problem, ratio=0.0, block_rows=5)
    assert shared_blocks(sched).tolist() == [False] * 3 + [True]  # the padding block: nothing to attend
    torch.testing.assert_close(out_all, out_none, rtol=1e-5, atol=1e-5)


def test_decision_by_union_size():
    """Identical selections share, independent ones (small union overlap) go per row at ratio 0.5."""
    same = make_prefill([200], [10], overlap=1.0, Kb=6, seed=4)
    _, sched = compare(same, block_rows=5, ratio=0.5)
    assert shared_blocks(sched).all()
    indep = make_prefill([2000], [10], overlap=0.0, Kb=6, seed=5)
    _, sched = compare(indep, block_rows=5, ratio=0.5)
    assert not shared_blocks(sched).any()


def test_first_look_sends_independent_blocks_per_row_at_once():
    """At ratio 0.3 a block of 5 rows needs its first and last rows to share about 0.6 of their
    groups: independent rows fail that first look (the full pass never runs: their last entries
    stay unwritten), identical rows pass it and share."""
    for overlap, shared in [(0.0, False), (1.0, True)]:
        problem = make_prefill([4000], [10], overlap=overlap, Kb=64, seed=15)
        q, sel = problem[0], problem[-1]
        T, Hq, D = q.shape
        sched = ker.plan_prefill_attention(T, Hq, 2, D, sel.shape[1] - 1, R, device=q.device, block_rows=5,
                                           max_union_ratio=0.3, options=OPTS)
        sched.last.fill_(-7)
        out = torch.empty(T, Hq * D, device=q.device)
        entry.prefill_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
        torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)
        assert shared_blocks(sched).tolist() == [shared] * 2
        assert (sched.last == -7).all().item() is not shared


def test_union_writes_stay_within_the_planned_capacity(monkeypatch):
    """The union pass stops a block once its runs pass the ratio, so a block holds at most the
    ratio's share of its groups plus one row's: the workspace is planned for that (2.25 of 5 rows'
    groups at 0.25), and blocks that run the full pass (the first look off) and outgrow the ratio
    write nothing past it (the workspace's tail keeps its poison), still exact."""
    monkeypatch.setattr(ker, "_min_share", lambda block_rows, ratio: 0.0)
    assert ker.union_capacity(5, 2051, 4, 0.25) == 641 + 513 + 1
    assert ker.union_capacity(5, 2051, 4, 1e9) == 5 * 513
    problem = make_prefill([4000], [40], overlap=0.8, Kb=64, seed=21)
    q, sel = problem[0], problem[-1]
    T, Hq, D = q.shape
    need = ker.workspace_size(T, Hq, 2, sel.shape[1] - 1, R, 5, 0.3)
    ws = torch.full((need + 4096,), -9, dtype=torch.int32, device=q.device)
    sched = ker.plan_prefill_attention(T, Hq, 2, D, sel.shape[1] - 1, R, device=q.device, block_rows=5,
                                       max_union_ratio=0.3, workspace=ws, options=OPTS)
    out = torch.empty(T, Hq * D, device=q.device)
    entry.prefill_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
    torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)
    ran_full = sched.last.view(-1, 5)[:, 0] != -9  # the full pass writes the rows' last entries
    assert (ran_full & ~shared_blocks(sched)).any(), "no block outgrew the ratio: the case tests nothing"
    assert (ws[need:] == -9).all()


def test_malformed_rows_fall_back_exactly():
    """Rows the union cannot describe (holes, entries >= seq_len, a duplicate, unaligned tokens,
    entries past the count) send their block per-row, still exact; other blocks stay shared."""
    problem = list(make_prefill([60], [25], overlap=1.0, seed=6))
    sel = problem[-1].clone()
    W = sel.shape[1] - 1
    sel[0, 1] = -1  # a hole: block 0
    sel[6, 0] = 60 + 3  # >= seq_len: block 1
    sel[11, 4] = sel[11, 3]  # a duplicate: block 2
    sel[16, :4] = torch.tensor([1, 2, 3, 4])  # not a group: block 3
    sel[21, W - 1] = 5  # beyond the count: ignored, block 4 stays shared
    problem[-1] = sel
    _, sched = compare(tuple(problem), ratio=1e9, block_rows=5)
    assert shared_blocks(sched).tolist() == [False, False, False, False, True]


def test_empty_selections_and_nan_gate():
    problem = list(make_prefill([30], [7], seed=7))
    sel = problem[-1].clone()
    sel[:, -1] = 0
    problem[-1] = sel
    problem[1] = torch.full_like(problem[1], float("nan"))
    out, sched = attend(tuple(problem), block_rows=5)
    assert shared_blocks(sched).all() and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_bf16_and_scales(kv_dtype):
    problem = make_prefill([70, 33], [8, 4], overlap=0.8, dtype=torch.bfloat16, kv_dtype=kv_dtype, pad_rows=2,
                           seed=8)
    out, _ = compare(problem, tol=2e-2, k_scale=0.6, v_scale=1.7, block_rows=5, with_per_row=True)
    assert out.dtype == torch.bfloat16


def test_group_sizes_and_head_dim():
    compare(make_prefill([50], [12], Hq=8, Hkv=1, D=64, overlap=0.9, seed=9), block_rows=3)
    compare(make_prefill([50], [12], Hq=2, Hkv=2, D=16, overlap=0.9, seed=10))


def test_bound_launch_relaunches_with_new_tensors():
    """A launch bound to one step's tensors runs another step's (other buffers, a wider out)."""
    first = make_prefill([60], [12], overlap=0.5, pad_rows=1, seed=11)
    second = make_prefill([60], [12], overlap=0.9, pad_rows=1, seed=12)
    q, gate, k, v, table, to_req, seq, sel = first
    T, Hq, D = q.shape
    sched = ker.plan_prefill_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, R, device=q.device, block_rows=5, options=OPTS)
    out = torch.empty(T, Hq * D, device=q.device)
    bound = ker.PrefillAttentionLaunch(*first, softmax_scale=D**-0.5, out=out, schedule=sched)
    q2, gate2, _, _, table2, to_req2, seq2, sel2 = second
    wide = torch.zeros(T, Hq * D + 4, device=q.device)
    bound(q2, gate2, table2, to_req2, seq2, sel2, wide[:, : Hq * D])
    expect = reference(q2, gate2, k, v, table2, to_req2, seq2, sel2, softmax_scale=D**-0.5)
    torch.testing.assert_close(wide[:, : Hq * D], expect, rtol=1e-5, atol=1e-5)
    assert (wide[:, Hq * D:] == 0).all()
    with pytest.raises(ValueError, match="bound for"):
        bound(q2[:2], gate2[:2], table2, to_req2[:2], seq2, sel2[:2], wide[:2, : Hq * D])


def test_bad_workspace_and_block_rows():
    with pytest.raises(ValueError, match="workspace"):
        ker.plan_prefill_attention(10, 6, 2, 32, 27, R, device="cpu", workspace=torch.empty(3, dtype=torch.int32), options=OPTS)
    with pytest.raises(ValueError, match="block_rows"):
        ker.plan_prefill_attention(10, 6, 2, 32, 27, R, device="cpu", block_rows=32, options=OPTS)


def test_plan_attention_hands_prefill_chunks_to_the_shared_kernels():
    """With shared_prefill (on unless QSA_SHARED_PREFILL=0), `plan_attention` given the compress
    ratio plans the shared-tile kernels for chunks of at least shared_prefill_min_rows rows, and
    `AttentionLaunch` runs them (exact; the one block of 21 rows ends in a padding row, which the
    first look passes over); fewer rows, no ratio or the option off: the one pass."""
    problem = make_prefill([60], [18], overlap=1.0, pad_rows=1, seed=13)
    q, sel = problem[0], problem[-1]
    T, Hq, D = q.shape
    on = replace(OPTS, shared_prefill=True, shared_prefill_min_rows=16)
    off = replace(on, shared_prefill=False)
    assert per_row.plan_attention(T, Hq, 2, D, sel.shape[1] - 1, device=q.device, compress_ratio=R,
                                  options=off).prefill is None
    assert per_row.plan_attention(15, Hq, 2, D, sel.shape[1] - 1, device=q.device, compress_ratio=R,
                                  options=on).prefill is None
    assert per_row.plan_attention(T, Hq, 2, D, sel.shape[1] - 1, device=q.device, options=on).prefill is None
    sched = per_row.plan_attention(T, Hq, 2, D, sel.shape[1] - 1, device=q.device, compress_ratio=R, options=on)
    assert sched.prefill is not None
    out = torch.full((T, Hq * D), 7.0, device=q.device)
    per_row.AttentionLaunch(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)(
        q, problem[1], problem[4], problem[5], problem[6], sel, out)
    assert shared_blocks(sched.prefill).any()
    torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)


# The production variants compiled for sm_90 in a fresh process (no TRITON_INTERPRET), as the
# launcher specializes them (`sm90`): the interpreter accepts code the compiler rejects. Prints
# registers / spill stack per kernel.
_COMPILE = """
import math
import triton.language as tl
from qsa_kernels import attention_prefill as ker
from qsa_kernels.attention_common import launch_config
from sm90 import compile_sm90, usage_text
from test_kernel_attention_compile import VALUES

W, R, BR, G = 2051, 4, 5, 12
NG = math.ceil(W / R)
CAP = ker.union_capacity(BR, W, R, ker.MAX_UNION_RATIO)
BG_UNION, BT_UNION = ker.union_tiles(NG)
bf = dict(q_ptr="*bf16", gate_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", qk_scale="fp32",
          v_scale="fp32", max_ratio="fp32", min_share="fp32")
bg, warps, stages = ker._launch_config(256, False)
bn, rwarps, rstages = launch_config(256, False, 16384)
variants = [
    ("union", ker._union_kernel, dict(BR=BR, BRP=8, W=W, R=R, NG=NG, CAP=CAP, PAGE=64, BLOCK_C=512,
     BLOCK_G=BG_UNION, BLOCK_T=BT_UNION, PRE=64, LOG=10, PDL=2),
     dict(num_warps=4, launch_pdl=True)),
    ("shared", ker._shared_kernel, dict(BR=BR, G=G, M=64, D=256, DP=256, PAGE=64, R=R, CAP=CAP, BLOCK_G=bg,
     DOT_DTYPE=tl.bfloat16, INTERPRET=False, PDL=2), dict(num_warps=warps, num_stages=stages, launch_pdl=True)),
    ("per-row", ker._per_row_kernel, dict(BR=BR, G=G, GP=16, D=256, DP=256, PAGE=64, BLOCK_N=bn,
     DOT_DTYPE=tl.bfloat16, INTERPRET=False, PDL=2), dict(num_warps=rwarps, num_stages=rstages, launch_pdl=True)),
]
for name, fn, consts, options in variants:
    print(f"compiled {name} {options}: {usage_text(compile_sm90(fn, consts, bf, dict(VALUES, T=16384), **options))}")
"""


@pytest.mark.sm90
def test_kernels_compile_for_sm90():
    from sm90 import run

    done = run(_COMPILE, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("compiled ")]
    assert len(lines) == 3, done.stdout
    print("\n".join(lines))


# ---------------------------------------------------------------- GPU, production shapes


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [0.0, 0.9, 1.0])
def test_gpu_production(overlap):
    """Hq 24 / Hkv 2 / D 256, page 64, K 2048: chunks at 128K and 5K context and padding rows,
    against the reference and the per-row kernel; a CUDA-graph replay is bitwise the eager run."""
    problem = make_prefill([131072, 5000], [150, 100], Hq=24, Hkv=2, D=256, page=64, Kb=512, overlap=overlap,
                           dtype=torch.bfloat16, pad_rows=3, device="cuda", seed=int(overlap * 10) + 20)
    out, sched = compare(problem, tol=2e-2, with_per_row=True)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    if overlap == 1.0:
        assert shared_blocks(sched)[: 150 // sched.block_rows].all()  # the first request's blocks
    q, gate, k, v, table, to_req, seq, sel = problem
    bound = ker.PrefillAttentionLaunch(*problem, softmax_scale=256**-0.5, out=out, schedule=sched)
    graph = torch.cuda.CUDAGraph()
    replayed = torch.empty_like(out)
    with torch.cuda.graph(graph):
        bound(q, gate, table, to_req, seq, sel, replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


def test_workspace_views_are_16_byte_aligned_for_every_row_count():
    """One compiled variant serves every step: the union / shared kernels' workspace views
    (Triton specializes pointers on 16-byte alignment) start aligned whatever num_rows, and
    fit the workspace `workspace_size` sizes without overlapping."""
    for rows in range(1, 70):
        need = ker.workspace_size(rows, 24, 2, 2051, 4)
        ws = torch.zeros(need, dtype=torch.int32)
        s = ker.plan_prefill_attention(rows, 24, 2, 256, 2051, 4, device="cpu", workspace=ws, options=OPTS)
        views = [v for v in (getattr(s, f) for f in s.__dataclass_fields__) if isinstance(v, torch.Tensor)]
        assert len(views) == 4
        spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 4) for v in views)
        assert all(a % 16 == 0 for a, _ in spans), (rows, spans)
        assert all(e <= a for (_, e), (a, _) in zip(spans, spans[1:])), (rows, spans)
        assert spans[-1][1] <= ws.data_ptr() + need * 4
