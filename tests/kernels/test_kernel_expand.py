"""Triton expansion vs the reference: packed rows and count column, bitwise."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference import qsa_expand as reference_expand  # noqa: E402
from entry import expand as qsa_expand  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.interpreter  # (TRITON_INTERPRET=1, CPU tensors: tests/conftest.py)


def random_rows(T, Kb, r, max_pos, gen, device, num_pad=0):
    """Positions, visible counts and top-k-like block rows (sorted groups, -1 padded) with
    stray entries (< 0, >= visible) mixed in; the last num_pad rows are CUDA-graph padding."""
    pos = torch.randint(0, max_pos, (T,), generator=gen)
    seq = pos + 1 + torch.randint(0, 3 * r, (T,), generator=gen)
    vis = torch.minimum((pos + 1) // r, seq // r)
    blocks = torch.full((T, Kb), -1, dtype=torch.int32)
    for t in range(T):
        n = min(Kb, int(vis[t]))
        if n:
            blocks[t, :n] = torch.randperm(int(vis[t]), generator=gen)[:n].sort().values.to(torch.int32)
    stray = torch.rand(T, Kb, generator=gen) < 0.1
    noise = torch.randint(-3, int(vis.max()) + 4 * r, (T, Kb), generator=gen).to(torch.int32)
    blocks = torch.where(stray, noise, blocks)
    pos[T - num_pad :] = -1
    vis[T - num_pad :] = 0
    return blocks.to(device), pos.to(device), vis.to(torch.int32).to(device)


def run_both(blocks, pos, vis, r, W):
    T = blocks.shape[0]
    got = torch.full((T, W + 1), 777, dtype=torch.int32, device=blocks.device)
    want = torch.full_like(got, 0)
    qsa_expand(blocks, pos, vis, compress_ratio=r, out=got)
    reference_expand(blocks, pos, vis, compress_ratio=r, out=want)
    return got, want


@interp
@pytest.mark.parametrize("Kb,r", [(4, 4), (8, 2), (5, 3), (16, 4)])
def test_random_rows(Kb, r):
    gen = torch.Generator().manual_seed(Kb * 7 + r)
    W = Kb * r + r - 1
    for max_pos in (Kb * r // 2, Kb * r * 3):  # short contexts (all groups) and long ones
        blocks, pos, vis = random_rows(24, Kb, r, max_pos, gen, "cpu", num_pad=3)
        got, want = run_both(blocks, pos, vis, r, W)
        assert torch.equal(got, want)


@interp
def test_edge_rows():
    """Closing rows (empty tail), duplicate groups, all-stray rows, padding rows."""
    r, Kb = 4, 3
    W = Kb * r + r - 1
    blocks = torch.tensor(
        [[0, 1, 2], [2, 2, -1], [5, 9, -7], [-1, -1, -1], [1, 0, 3], [0, 1, 2]], dtype=torch.int32
    )
    pos = torch.tensor([15, 9, 3, 2, 13, -1])
    vis = torch.tensor([4, 2, 1, 0, 3, 0], dtype=torch.int32)
    got, want = run_both(blocks, pos, vis, r, W)
    assert torch.equal(got, want)
    assert got[5].tolist() == [-1] * W + [0]


@interp
def test_wider_output_and_strided_rows():
    """out wider than Kb*r + r - 1 and a strided view of the block rows."""
    gen = torch.Generator().manual_seed(5)
    blocks, pos, vis = random_rows(10, 6, 4, 60, gen, "cpu")
    wide = torch.full((10, 12), -1, dtype=torch.int32)
    wide[:, 2:8] = blocks
    got, want = run_both(wide[:, 2:8], pos, vis, 4, 6 * 4 + 9)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_production_gpu():
    """Kb 512, r 4 (W 2051), contexts up to 128K, with CUDA-graph padding rows."""
    gen = torch.Generator().manual_seed(6)
    Kb, r = 512, 4
    pos = torch.randint(0, 131072, (2048,), generator=gen)
    pos[:64] = torch.randint(0, 2100, (64,), generator=gen)  # contexts <= K: every group
    vis = (pos + 1) // r
    blocks = torch.full((2048, Kb), -1, dtype=torch.int32)
    for t in range(2048):
        n = min(Kb, int(vis[t]))
        if n:
            blocks[t, :n] = torch.randperm(int(vis[t]), generator=gen)[:n].sort().values.to(torch.int32)
    pos[-16:] = -1
    vis[-16:] = 0
    got, want = run_both(blocks.cuda(), pos.cuda(), vis.to(torch.int32).cuda(), r, Kb * r + r - 1)
    assert torch.equal(got, want)


@interp
def test_refuses_an_output_too_narrow_for_its_groups():
    """As the reference (tests/test_reference_ops.py): W >= Kb * r + r - 1 is checked before
    the kernel writes (a narrower row would take group tokens past its end)."""
    blocks = torch.tensor([[0, 2, 1]], dtype=torch.int32)
    args = (blocks, torch.tensor([14]), torch.tensor([3], dtype=torch.int32))
    for shape in ((1, 3 * 4 + 1), (1, 3 * 4 + 3), (2, 3 * 4 + 4), (1,)):
        out = torch.full(shape, 7, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"out must be \[T = 1, W \+ 1\] with W >= Kb \* r \+ r - 1 = 15"):
            qsa_expand(*args, compress_ratio=4, out=out)
        assert (out == 7).all()
    out = qsa_expand(*args, compress_ratio=4, out=torch.empty(1, 3 * 4 + 4, dtype=torch.int32))
    assert out[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
