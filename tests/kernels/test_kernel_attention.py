"""Triton sparse attention against the reference (interpreter on CPU, compiled on GPU)."""

from paged import shuffled_block_table
import os

import pytest
import torch

# Small-shape tests run on the GPU when there is one, else in the Triton interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference.attention import qsa_sparse_attention as reference  # noqa: E402
from qsa_kernels import attention as ker  # noqa: E402
from kernel_options import OPTS  # noqa: E402

import entry  # noqa: E402
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
    sched = ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, options=OPTS)
    out = torch.full((T, Hq * D), 7.0, dtype=q.dtype, device=q.device)
    return entry.sparse_attention(q, gate, k, v, table, to_req, seq, sel, out=out, schedule=sched, **kw)


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
    sched = ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, options=OPTS)
    entry.sparse_attention(*problem, softmax_scale=D**-0.5, out=wide[:T, : Hq * D], schedule=sched)
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


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_split_count_leaves_no_split_empty(monkeypatch, rows):
    """A full row of W 2051 in 64-column blocks on an H200 (132 SMs): every planned split gets
    a share of blocks (32 splits would leave 15 of them empty)."""
    monkeypatch.setattr(ker, "_num_sms", lambda device: 132)
    n = ker._num_splits(rows, 2, 2051, 64, torch.device("cpu"))
    blocks = -(-2051 // 64)
    per_split = -(-blocks // n)
    assert n > 1 and (n - 1) * per_split < blocks <= n * per_split


def test_bound_launch_relaunches_with_new_tensors():
    """An AttentionLaunch bound to one step's tensors runs another step's (same shapes, other
    buffers and strides) exactly as the op does."""
    first = make_problem([40, 9], [3, 2], pad_rows=1, seed=11)
    second = make_problem([40, 9], [3, 2], pad_rows=1, seed=12)
    q, gate, k, v, table, to_req, seq, sel = first
    T, Hq, D = q.shape
    sched = ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, options=OPTS)
    out = torch.empty(T, Hq * D, device=q.device)
    bound = ker.AttentionLaunch(*first, softmax_scale=D**-0.5, out=out, schedule=sched)
    q2, gate2, _, _, table2, to_req2, seq2, sel2 = second
    wide = torch.zeros(T, Hq * D + 4, device=q.device)
    bound(q2, gate2, table2, to_req2, seq2, sel2, wide[:, : Hq * D])
    expect = attend(q2, gate2, k, v, table2, to_req2, seq2, sel2, softmax_scale=D**-0.5)
    torch.testing.assert_close(wide[:, : Hq * D], expect, rtol=0, atol=0)
    with pytest.raises(ValueError, match="bound for"):
        bound(q2[:2], gate2[:2], table2, to_req2[:2], seq2, sel2[:2], wide[:2, : Hq * D])


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
        sched = ker.plan_attention(sum(ql), 24, 2, 256, 2051, device="cuda", options=OPTS)
        out = torch.empty(sum(ql), 24 * 256, dtype=torch.bfloat16, device="cuda")
        run = lambda: entry.sparse_attention(*problem, softmax_scale=256**-0.5, out=out, schedule=sched)  # noqa: E731
        eager = run().clone()
        replayed, us = graph_replay(run)
        assert torch.equal(replayed, eager)
        with capsys.disabled():
            print(f"\nattention {name}: {us:.1f} us (graph replay); {kernel_breakdown(run)}")
