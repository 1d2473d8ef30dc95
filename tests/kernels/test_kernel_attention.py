"""Triton sparse attention against the reference (interpreter on CPU, compiled on GPU)."""

from paged import shuffled_block_table
import os

import pytest
import torch
import triton
import triton.language as tl

# Small-shape tests run on the GPU when there is one, else in the Triton interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference.attention import qsa_sparse_attention as reference  # noqa: E402
from qsa_kernels import attention as ker  # noqa: E402
from qsa_kernels.attention_shared import _union_estimate  # noqa: E402
from test_kernel_select import graph_replay, kernel_breakdown  # noqa: E402  (imported here: a rename fails on CPU too)


def make_problem(
    seq_lens, query_lens, *, Hq=6, Hkv=2, D=32, page=16, W=35, dtype=torch.float32, kv_dtype=None,
    layout="vllm", pad_rows=0, device=DEV, seed=0,
):
    """A ragged batch over a shuffled paged KV cache; selections hold junk to be ignored.

    layout "vllm": one [pages, Hkv, page, 2D] buffer, K and V side by side; "sglang":
    separate [slots, Hkv, D] buffers. Padding rows have NaN q and gate, all -1, count 0.
    Returns (q, gate, k, v, block_table, token_to_req, seq_lens, selection).
    """
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    table, num_pages = shuffled_block_table(seq_lens, page, g, spare_cols=2, spare_pages=2)
    if layout == "vllm":
        kv = torch.randn(num_pages, Hkv, page, 2 * D, generator=g).to(kv_dtype)
        k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
    else:
        k = torch.randn(num_pages * page, Hkv, D, generator=g).to(kv_dtype).view(num_pages, page, Hkv, D)
        v = torch.randn(num_pages * page, Hkv, D, generator=g).to(kv_dtype).view(num_pages, page, Hkv, D)
    reqs, sel = [], []
    for i, (s, lq) in enumerate(zip(seq_lens, query_lens)):
        for j in range(lq):
            p = s - lq + j
            n = min(W, p + 1)
            if p + 1 > 16 * W:  # long context: sample with replacement (duplicates count twice in both)
                idx = torch.randint(0, p + 1, (n,), generator=g).sort().values.int()
            else:
                idx = torch.randperm(p + 1, generator=g)[:n].sort().values.int()
            row = torch.full((W + 1,), -1, dtype=torch.int32)
            row[:n] = idx
            row[W] = n
            junk = torch.randint(0, n + 1, (3,), generator=g)
            row[junk[0]] = -1 if junk[0] < n else row[junk[0]]  # holes inside the count
            if n < W:
                row[n] = int(junk[1])  # beyond the count: ignored
            reqs.append(i)
            sel.append(row)
    if sel:
        sel[0][0] = seq_lens[0] + 5  # >= seq_len: ignored
    for _ in range(pad_rows):
        row = torch.full((W + 1,), -1, dtype=torch.int32)
        row[W] = 0
        sel.append(row)
        reqs.append(0)
    T = len(reqs)
    q = torch.randn(T, Hq, D, generator=g)
    gate = torch.randn(T, Hq, D, generator=g) * 2
    if pad_rows:
        q[-pad_rows:] = float("nan")
        gate[-pad_rows:] = float("nan")
    tensors = (q.to(dtype), gate.to(dtype), k, v, table, torch.tensor(reqs, dtype=torch.int32),
               torch.tensor(seq_lens, dtype=torch.int32), torch.stack(sel))
    return tuple(t.to(device) for t in tensors)


def attend(q, gate, k, v, table, to_req, seq, sel, **kw):
    """The kernel as a plan runs it: scheduled once for the shape, into an out buffer."""
    T, Hq, D = q.shape
    sched = ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, num_decode_rows=0)
    out = torch.full((T, Hq * D), 7.0, dtype=q.dtype, device=q.device)
    return ker.qsa_sparse_attention(q, gate, k, v, table, to_req, seq, sel, out=out, schedule=sched, **kw)


def compare(problem, *, k_scale=1.0, v_scale=1.0, tol=1e-5, ref_device=None):
    q, D = problem[0], problem[0].shape[-1]
    kw = dict(softmax_scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
    out = attend(*problem, **kw)
    expect = reference(*[t.to(ref_device or q.device) for t in problem], **kw).to(q.device)
    torch.testing.assert_close(out.float(), expect.float(), rtol=tol, atol=tol)
    return out


def _empty_rows_zero(out, problem):
    sel = problem[-1]
    W = sel.shape[1] - 1
    empty = (sel[:, W] == 0)
    assert empty.any() and torch.equal(out[empty], torch.zeros_like(out[empty]))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("layout", ["vllm", "sglang"])
def test_fp32_ragged(monkeypatch, split, layout):
    if not split:
        monkeypatch.setattr(ker, "_SPLIT_MAX_ROWS", 0)
    else:
        monkeypatch.setattr(ker, "_num_splits", lambda *a: 3)  # W = 35, BLOCK_N 32: an empty split
    problem = make_problem([40, 9, 70], [5, 2, 3], layout=layout, pad_rows=2)
    out = compare(problem)
    _empty_rows_zero(out, problem)


@pytest.mark.parametrize("Hq,Hkv", [(24, 2), (3, 1), (8, 8), (10, 2)])
def test_group_sizes(Hq, Hkv):
    problem = make_problem([50, 20], [2, 1], Hq=Hq, Hkv=Hkv, pad_rows=1, seed=Hq)
    compare(problem)


@pytest.mark.parametrize("D", [128, 256])
def test_head_dims(monkeypatch, D):
    monkeypatch.setattr(ker, "_SPLIT_MAX_ROWS", 0)
    problem = make_problem([45], [2], Hq=4, Hkv=2, D=D, page=32, pad_rows=1, seed=D)
    compare(problem)


def test_bf16():
    problem = make_problem([60, 33], [3, 2], dtype=torch.bfloat16, pad_rows=1, seed=5)
    out = compare(problem, tol=2e-2)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_scales(kv_dtype):
    problem = make_problem([60, 33], [3, 2], dtype=torch.bfloat16, kv_dtype=kv_dtype, pad_rows=1, seed=6)
    compare(problem, k_scale=0.37, v_scale=1.9, tol=2e-2)


def test_output_rows_of_a_wider_buffer():
    """out may be rows of a wider buffer (a caller's [N, Hq*D] slice with its own stride)."""
    problem = make_problem([40, 9], [3, 2], pad_rows=1, seed=3)
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    wide = torch.full((T + 2, Hq * D + 8), 5.0, device=q.device)
    sched = ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device)
    ker.qsa_sparse_attention(*problem, softmax_scale=D**-0.5, out=wide[:T, : Hq * D], schedule=sched)
    torch.testing.assert_close(wide[:T, : Hq * D], attend(*problem, softmax_scale=D**-0.5), rtol=0, atol=0)
    assert (wide[T:] == 5.0).all() and (wide[:, Hq * D :] == 5.0).all()


def test_all_rows_empty_and_nan_gate():
    problem = make_problem([10], [1], pad_rows=3)
    q, gate, k, v, table, to_req, seq, sel = problem
    sel = sel.clone()
    sel[0, :-1] = -1  # the real row keeps a count but no valid entry
    out = attend(q, torch.full_like(gate, float("nan")), k, v, table, to_req, seq, sel, softmax_scale=0.1)
    assert torch.equal(out, torch.zeros_like(out))


def test_empty_batch():
    problem = make_problem([10], [1])
    q, gate, k, v, table, to_req, seq, sel = problem
    out = attend(q[:0], gate[:0], k, v, table, to_req[:0], seq, sel[:0], softmax_scale=0.1)
    assert out.shape == (0, q.shape[1] * q.shape[2])


# ---------------------------------------------------------------- GPU, production shapes


@pytest.mark.gpu
@pytest.mark.parametrize("Hq", [24, 16])
@pytest.mark.parametrize("D", [256, 128])
@pytest.mark.parametrize("layout", ["vllm", "sglang"])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_gpu_production(Hq, D, layout, rows):
    seq = [131072, 70000, 2051, 100] if rows == "decode" else [131072, 5000]
    ql = [1, 4, 1, 1] if rows == "decode" else [300, 200]
    problem = make_problem(seq, ql, Hq=Hq, Hkv=2, D=D, page=64, W=2051, dtype=torch.bfloat16,
                           layout=layout, pad_rows=3, device="cuda", seed=D + Hq)
    out = compare(problem, tol=2e-2)
    _empty_rows_zero(out, problem)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rows", ["decode", "prefill"])
def test_gpu_fp8(kv_dtype, rows):
    ql = [1, 1] if rows == "decode" else [300, 100]
    problem = make_problem([131072, 9000], ql, Hq=24, Hkv=2, D=256, page=64, W=2051, dtype=torch.bfloat16,
                           kv_dtype=kv_dtype, pad_rows=2, device="cuda", seed=9)
    compare(problem, k_scale=0.6, v_scale=1.7, tol=2e-2)  # fp8 -> bf16 is exact: the bf16 tolerance


@pytest.mark.gpu
def test_gpu_cuda_graph_and_timing(capsys):
    """Attention replays from a CUDA graph bitwise as run eagerly; prints graph-replay
    timings and a per-kernel breakdown (no assertion on speed)."""
    for name, ql in [("decode 4 rows", [1] * 4), ("decode 64 rows", [1] * 64), ("prefill 4096 rows", [4096])]:
        problem = make_problem([131072] * len(ql), ql, Hq=24, Hkv=2, D=256, page=64, W=2051, dtype=torch.bfloat16,
                               device="cuda")
        nd = 0 if name.startswith("prefill") else sum(ql)
        sched = ker.plan_attention(sum(ql), 24, 2, 256, 2051, device="cuda", num_decode_rows=nd)
        out = torch.empty(sum(ql), 24 * 256, dtype=torch.bfloat16, device="cuda")
        run = lambda: ker.qsa_sparse_attention(*problem, softmax_scale=256**-0.5, out=out, schedule=sched)  # noqa: E731
        eager = run().clone()
        replayed, us = graph_replay(run)
        assert torch.equal(replayed, eager)
        with capsys.disabled():
            print(f"\nattention {name}: {us:.1f} us (graph replay); {kernel_breakdown(run)}")


# ---------------------------------------------------------------- shared K/V tiles (prefill)


def correlated_selection(seq_len, query_len, *, W, r=4, sigma=0.5, seed=0):
    """Rows as `qsa_expand` writes them for the last query_len positions of one request: the
    top W // r groups of base[g] + sigma * noise[row, g] (neighbours share most groups; sigma
    None: independent rows), ascending, then the open tail, -1 after the count. int32 [n, W + 1]."""
    g = torch.Generator().manual_seed(seed)
    groups = seq_len // r
    base = torch.randn(groups, generator=g)
    rows = []
    for p in range(seq_len - query_len, seq_len):
        vis = (p + 1) // r
        noise = torch.randn(vis, generator=g)
        score = noise if sigma is None else base[:vis] + sigma * noise
        chosen = score.topk(min(W // r, vis)).indices.sort().values
        idx = torch.cat([(chosen[:, None] * r + torch.arange(r)).flatten(), torch.arange(vis * r, p + 1)])
        row = torch.full((W + 1,), -1, dtype=torch.int32)
        row[: idx.numel()] = idx.int()
        row[W] = idx.numel()
        rows.append(row)
    return torch.stack(rows)


def shared_problem(cases, *, W=39, pad_rows=2, seed=0, device=DEV, **kw):
    """Requests given as (seq_len, query_len, kind): kind "identical" (every row the same
    set), "disjoint" (neighbours share nothing), "correlated" (neighbours share most groups),
    "independent" (random groups per row); then padding rows. make_problem's K/V and q."""
    seq_lens = [c[0] for c in cases]
    base = make_problem(seq_lens, [c[1] for c in cases], W=W, pad_rows=pad_rows, seed=seed, device=device, **kw)
    sels, reqs = [], []
    for i, (s, lq, kind) in enumerate(cases):
        if kind == "identical":
            row = torch.full((W + 1,), -1, dtype=torch.int32)
            n = min(W, s - lq + 1)
            row[:n] = torch.randperm(s - lq + 1, generator=torch.Generator().manual_seed(i))[:n].sort().values.int()
            row[W] = n
            sel = row.repeat(lq, 1)
        elif kind == "disjoint":
            sel = torch.full((lq, W + 1), -1, dtype=torch.int32)
            for j in range(lq):
                idx = torch.arange(j, s - lq + j + 1, lq)[:W]
                sel[j, : idx.numel()] = idx.int()
                sel[j, W] = idx.numel()
        else:
            sel = correlated_selection(s, lq, W=W, sigma=0.5 if kind == "correlated" else None, seed=seed + i)
        sels.append(sel)
        reqs += [i] * lq
    pad = torch.full((pad_rows, W + 1), -1, dtype=torch.int32)
    pad[:, W] = 0
    sel = torch.cat([*sels, pad]).to(base[0].device)
    to_req = torch.tensor(reqs + [0] * pad_rows, dtype=torch.int32, device=base[0].device)
    return (*base[:5], to_req, base[6], sel)


def test_shared_tiles_exact_per_row(monkeypatch):
    """Blocks of one request with identical, disjoint, correlated and independent rows, blocks
    across request boundaries and padding rows: each row attends to its own selection only
    (every block of one request shares tiles, whatever its union)."""
    monkeypatch.setattr(ker, "_SPLIT_MAX_ROWS", 0)
    monkeypatch.setattr(ker, "_MAX_UNION", 1e9)
    cases = [(90, 11, "identical"), (70, 9, "disjoint"), (120, 13, "correlated"), (60, 7, "independent")]
    problem = shared_problem(cases, Hq=6, Hkv=2, seed=1)
    T = problem[0].shape[0]
    sched = ker.plan_attention(T, 6, 2, 32, 39, device=problem[0].device, num_decode_rows=0)
    assert sched.shared is not None and sched.shared_from == 0 and sched.shared.block_rows > 1
    out = compare(problem)
    _empty_rows_zero(out, problem)


def test_shared_tiles_after_decode_rows(monkeypatch):
    """A mixed step: leading decode rows run per row, the prefill rows after them share tiles."""
    monkeypatch.setattr(ker, "_SPLIT_MAX_ROWS", 0)
    problem = shared_problem([(40, 1, "independent"), (50, 1, "independent"), (100, 12, "correlated")],
                             Hq=4, Hkv=1, pad_rows=1, seed=2)
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    sched = ker.plan_attention(T, Hq, 1, D, 39, device=q.device, num_decode_rows=2)
    assert sched.shared_from == 2
    out = torch.full((T, Hq * D), 7.0, dtype=q.dtype, device=q.device)
    ker.qsa_sparse_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
    torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)


def test_shared_tiles_non_finite_v_reaches_only_its_rows(monkeypatch):
    """A NaN V in a shared tile: the rows that select it are NaN, every other row of the block
    is exactly what it is without the NaN."""
    monkeypatch.setattr(ker, "_SPLIT_MAX_ROWS", 0)
    monkeypatch.setattr(ker, "_MAX_UNION", 1e9)
    problem = shared_problem([(100, 10, "correlated")], Hq=6, Hkv=2, pad_rows=0, seed=3)
    q, gate, k, v, table, to_req, seq, sel = problem
    W = sel.shape[1] - 1
    first = set(sel[0, : int(sel[0, W])].tolist())
    tok = next(t for t in sel[-1, : int(sel[-1, W])].tolist() if t not in first)  # not in row 0's set
    holders = (sel[:, :W] == tok).any(1)
    assert holders.any() and not holders.all()
    clean = attend(*problem, softmax_scale=0.2)
    page = int(table[0, tok // k.shape[1]])
    v[page, tok % k.shape[1], 1, 3] = float("nan")  # KV head 1 only
    out = attend(*problem, softmax_scale=0.2).view(q.shape[0], 6, -1)
    head1 = slice(3, 6)
    assert out[holders][:, head1].isnan().all()
    assert torch.equal(out[~holders], clean.view_as(out)[~holders])
    assert torch.equal(out[:, :3], clean.view_as(out)[:, :3])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["correlated", "independent"])
def test_gpu_shared_production(kind):
    """Production shapes on the shared-tile path (sorted selections as expand writes them)."""
    problem = shared_problem([(131072, 300, kind), (5000, 200, "correlated")], W=2051, Hq=24, Hkv=2, D=256,
                             page=64, dtype=torch.bfloat16, pad_rows=3, device="cuda", seed=4)
    sched = ker.plan_attention(problem[0].shape[0], 24, 2, 256, 2051, device="cuda", num_decode_rows=0)
    assert sched.shared is not None
    out = compare(problem, tol=2e-2)
    _empty_rows_zero(out, problem)


@triton.jit
def _union_probe(sel_ptr, out_ptr, n, stride_st, BM_P: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    i = tl.arange(0, BM_P)
    rvalid = i < n
    cnt = tl.load(sel_ptr + i * stride_st + W, mask=rvalid, other=0)
    tl.store(out_ptr, _union_estimate(sel_ptr, i, rvalid, cnt, stride_st, 1, BM_P, BM_P, 32, LOG_W))


def test_union_estimate_tracks_the_exact_union():
    """The block's union estimate (it decides shared tiles vs row by row): exact for identical
    rows, one count per row for disjoint rows, near the exact union for correlated rows."""
    W = 39
    for kind in ("identical", "disjoint", "correlated"):
        sel = shared_problem([(300, 10, kind)], W=W, pad_rows=0, Hq=2, Hkv=1, seed=5)[-1]
        est = torch.zeros(1, device=sel.device)
        _union_probe[(1,)](sel, est, 10, sel.stride(0), BM_P=16, W=W, LOG_W=W.bit_length())
        exact = torch.unique(sel[:, :W][sel[:, :W] >= 0]).numel()
        if kind == "identical":
            assert est.item() == sel[0, W].item()
        elif kind == "disjoint":
            assert est.item() == sel[:, W].sum().item() == exact
        else:
            assert 0.8 * exact <= est.item() <= 1.3 * exact, (est.item(), exact)
