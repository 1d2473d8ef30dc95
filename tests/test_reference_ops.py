"""The reference ops' contracts (design.md §2.7, §2.8, §6.3, §6.4, §6.9), on hand-made data."""

import pytest
import torch

from qsa_core.reference import qsa_expand, qsa_select_prefill, qsa_sparse_attention, qsa_store_kv
from qsa_core.reference.select import topk_groups


def test_ties_break_to_the_lower_group_and_negative_zero_ties_zero():
    scores = torch.tensor([[0.0, 3.0, -0.0, 3.0, 0.0, 1.0, 0.0, 9.0]])
    got = topk_groups(scores + 0.0, torch.tensor([8]), 4)
    assert got.tolist() == [[1, 3, 5, 7]]
    got = topk_groups(scores + 0.0, torch.tensor([8]), 6)
    assert got.tolist() == [[0, 1, 2, 3, 5, 7]]  # zeros at 0, 2 (-0.0), 4, 6: lowest first


def test_never_a_group_at_or_past_visible():
    scores = torch.tensor([[1.0, 2.0, 3.0, 9.0, 9.0], [5.0, 1.0, 7.0, 9.0, 9.0]])
    got = topk_groups(scores, torch.tensor([3, 2]), 4)
    assert got.tolist() == [[0, 1, 2, -1], [0, 1, -1, -1]]


def test_select_reads_each_request_through_its_own_block_table():
    """Two requests at equal positions on different pages pick from their own keys."""
    r, page = 4, 8
    comp = torch.zeros(8, 2)  # 4 pages * 8 / 4
    comp[2 * 2 + 0] = torch.tensor([1.0, 0.0])  # request 0, page 2: group 0 points at +x
    comp[2 * 2 + 1] = torch.tensor([0.0, 1.0])  # group 1 at +y
    comp[1 * 2 + 0] = torch.tensor([0.0, 1.0])  # request 1, page 1: group 0 at +y
    comp[1 * 2 + 1] = torch.tensor([1.0, 0.0])  # group 1 at +x
    table = torch.tensor([[2], [1]], dtype=torch.int32)
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # both rows look for +x
    out = torch.empty(2, 1, dtype=torch.int32)
    qsa_select_prefill(q, comp.view(4, 2, 2), table, torch.tensor([0, 1]), torch.tensor([2, 2]),
                       page_size=page, compress_ratio=r, block_topk=1, out=out)
    assert out.tolist() == [[0], [1]]


def test_expand_groups_then_tail_with_count():
    blocks = torch.tensor([[0, 2, -1], [3, 1, 9], [-1, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([13, 17, -1])
    visible = torch.tensor([3, 4, 0], dtype=torch.int32)
    out = torch.empty(3, 3 * 4 + 3 + 1, dtype=torch.int32)
    qsa_expand(blocks, positions, visible, compress_ratio=4, out=out)
    assert out[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13] + [-1] * 5 + [10]
    # group 9 >= visible is dropped; p = 17 closes nothing: tail 16, 17
    assert out[1].tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 16, 17] + [-1] * 5 + [10]
    assert out[2].tolist() == [-1] * 15 + [0]


def test_expand_refuses_an_output_too_narrow_for_its_groups():
    """Expansion checks out's shape before it writes: Kb groups of r tokens and an open tail
    of up to r - 1 need W >= Kb * r + r - 1 (a narrower row would take group tokens past its
    end, or count a tail it has no room for). The kernel's test entry makes the same check
    (tests/kernels/test_kernel_expand.py)."""
    blocks = torch.tensor([[0, 2, 1]], dtype=torch.int32)
    args = (blocks, torch.tensor([14]), torch.tensor([3], dtype=torch.int32))
    for shape in ((1, 3 * 4 + 1), (1, 3 * 4 + 3), (2, 3 * 4 + 4), (1,)):
        with pytest.raises(ValueError, match=r"out must be \[T = 1, W \+ 1\] with W >= Kb \* r \+ r - 1 = 15"):
            qsa_expand(*args, compress_ratio=4, out=torch.empty(shape, dtype=torch.int32))
    out = qsa_expand(*args, compress_ratio=4, out=torch.empty(1, 3 * 4 + 4, dtype=torch.int32))
    assert out[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # the tail 12..14 fits


def _attend(q, k, v, idx, scale):
    logits = torch.einsum("hd,nhd->hn", q, k[idx]) * scale
    return torch.einsum("hn,nhd->hd", logits.softmax(-1), v[idx])


def test_attention_ignores_invalid_entries_and_zeroes_empty_rows():
    torch.manual_seed(0)
    Hq, Hkv, D, page = 4, 2, 16, 8
    k = torch.randn(4, page, Hkv, D)
    v = torch.randn(4, page, Hkv, D)
    table = torch.tensor([[3, 1, 2]], dtype=torch.int32)
    q = torch.randn(3, Hq, D)
    gate = torch.randn(3, Hq, D)
    gate[2] = float("nan")
    sel = torch.tensor(
        [[0, 9, -1, 20, 3, 17, -1, 5], [2, 30, -1, -1, -1, -1, -1, 2], [21, -1, 40, -1, -1, -1, -1, 3]],
        dtype=torch.int32,
    )  # seq_len 21: 30, 40 and 21 are past it; 17 sits past row 0's count of 5
    out = qsa_sparse_attention(q, gate, k, v, table, torch.zeros(3, dtype=torch.int64),
                               torch.tensor([21], dtype=torch.int32), sel, softmax_scale=0.25)
    flat_k = k[table[0].long()].reshape(-1, Hkv, D).repeat_interleave(2, 1)
    flat_v = v[table[0].long()].reshape(-1, Hkv, D).repeat_interleave(2, 1)
    want0 = _attend(q[0], flat_k, flat_v, torch.tensor([0, 9, 20, 3]), 0.25) * gate[0].sigmoid()
    want1 = _attend(q[1], flat_k, flat_v, torch.tensor([2]), 0.25) * gate[1].sigmoid()
    assert torch.allclose(out[0].view(Hq, D), want0, atol=1e-5)
    assert torch.allclose(out[1].view(Hq, D), want1, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(Hq * D))


def test_fp8_kv_with_scales_matches_dequantized_values():
    torch.manual_seed(1)
    Hq, Hkv, D, page = 4, 2, 16, 8
    k8 = (torch.randn(2, page, Hkv, D) * 8).to(torch.float8_e4m3fn)
    v8 = (torch.randn(2, page, Hkv, D) * 8).to(torch.float8_e5m2)
    q, gate = torch.randn(1, Hq, D), torch.randn(1, Hq, D)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    sel = torch.tensor([[0, 5, 9, 15, 4]], dtype=torch.int32)
    args = (table, torch.zeros(1, dtype=torch.int64), torch.tensor([16], dtype=torch.int32), sel)
    got = qsa_sparse_attention(q, gate, k8, v8, *args, softmax_scale=0.25, k_scale=0.125, v_scale=0.5)
    want = qsa_sparse_attention(q, gate, k8.float() * 0.125, v8.float() * 0.5, *args, softmax_scale=0.25)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_store_saturates_at_the_largest_finite_value(dtype):
    """x / scale beyond the format's range stores +-max (448 e4m3fn, 57344 e5m2), never inf:
    the kernels' conversion saturates; torch's e5m2 cast alone gives inf."""
    top = torch.finfo(dtype).max
    k = torch.tensor([[[3.0 * top, -3.0 * top, 1.0, 0.5]]])  # [T 1, Hkv 1, D 4]
    v = -k
    kc, vc = torch.zeros(2, 4, 1, 4, dtype=dtype), torch.zeros(2, 4, 1, 4, dtype=dtype)
    qsa_store_kv(kc, vc, torch.tensor([5]), k, v, k_scale=2.0, v_scale=0.5)
    assert kc[1, 1, 0].float().tolist() == [top, -top, 0.5, 0.25]
    assert vc[1, 1, 0].float().tolist() == [-top, top, -2.0, -1.0]
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()
