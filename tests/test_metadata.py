"""Step inputs and the plan's metadata: design.md §3's derivations, padding rows, the
column-bound guard, persistent (CUDA-graph) buffers and malformed input errors."""

import pytest
import torch

from qsa_core import QSAConfig, QSAPlanner, QSAStepInputs

I32, I64 = torch.int32, torch.int64

CONFIG = QSAConfig(
    hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=16, index_n_heads=2, index_head_dim=16,
    token_topk=8, compress_ratio=4, rotary_dim=8, rope_theta=1e4,
)


def planner(**over):
    kw = dict(dtype=torch.float32, page_size=8, ring_capacity=4, max_num_tokens=16, max_model_len=64)
    kw.update(over)
    return QSAPlanner(CONFIG, **kw)


def mixed_step(decode_slots=(7 * 8 + 1, 5 * 8 + 4), **over):
    """Two decodes (context 9 and 4) then prefills of 6 (context 2) and 3 (new), 2 padding rows.

    r = 4, page 8, C = 4. decode_slots: the decodes' slots, through their pages 7 and 5 (a
    step that moves a decode on moves its slot).
    """
    args = dict(
        query_start_loc=torch.tensor([0, 1, 2, 8, 11], dtype=I32),
        seq_lens=torch.tensor([10, 5, 8, 3], dtype=I32),
        block_table=torch.tensor([[3, 7], [5, -1], [0, -1], [2, -1]], dtype=I32),
        slot_mapping=torch.tensor(
            list(decode_slots) + [0 * 8 + i for i in range(2, 8)] + [2 * 8 + i for i in range(3)] + [-1, -1],
            dtype=I64,
        ),
        ring_index=torch.tensor([2, 0, 3, 1], dtype=I32),
        num_decodes=2,
        max_query_len=6,
        max_seq_len=10,
        num_padding_rows=2,
    )
    args.update(over)
    return QSAStepInputs(**args)


def test_derived_fields_of_a_mixed_step(backend):
    meta = planner().plan(mixed_step()).meta
    assert meta.token_to_req.tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0]
    assert meta.positions.tolist() == [9, 4, 2, 3, 4, 5, 6, 7, 0, 1, 2, -1, -1]
    # visible = complete groups among tokens 0..p
    assert meta.visible_blocks.tolist() == [2, 1, 0, 1, 1, 1, 1, 2, 0, 0, 0, 0, 0]
    # ring: ring_index * C + p % C, only the last C rows of each request
    assert meta.ring_slot.tolist() == [9, 0, -1, -1, 12, 13, 14, 15, 4, 5, 6, -1, -1]
    # compressed write slot = main slot // r for rows that close a group
    assert meta.compressed_slot.tolist() == [-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, -1, -1]
    assert (meta.num_tokens, meta.num_reqs, meta.num_decode_tokens) == (13, 4, 2)
    assert meta.rope_positions is meta.positions


def test_idle_step_is_all_padding(backend):
    meta = planner().plan(QSAStepInputs(
        query_start_loc=torch.zeros(1, dtype=I32), seq_lens=torch.zeros(0, dtype=I32),
        block_table=torch.zeros(0, 1, dtype=I32), slot_mapping=torch.full((3,), -1, dtype=I64),
        ring_index=torch.zeros(0, dtype=I32), num_decodes=0, max_query_len=0, max_seq_len=0,
        num_padding_rows=3,
    )).meta
    assert meta.positions.tolist() == [-1, -1, -1] and meta.visible_blocks.tolist() == [0, 0, 0]


def test_derived_fields_live_in_the_planner_workspace():
    p = planner()
    first = p.plan(mixed_step()).meta
    ptr = first.positions.data_ptr()
    second = p.plan(mixed_step((7 * 8 + 2, 5 * 8 + 4), seq_lens=torch.tensor([11, 5, 8, 3], dtype=I32),
                               max_seq_len=11)).meta
    assert second.positions.data_ptr() == ptr and second.positions[0].item() == 10
    with pytest.raises(ValueError, match="max_num_tokens"):
        p.plan(mixed_step(slot_mapping=torch.full((17,), -1, dtype=I64), num_padding_rows=6))


def test_static_plan_copies_inputs_into_fixed_buffers(backend):
    """plan(static=True): every tensor of the metadata keeps its address from step to step."""
    p = planner(max_num_reqs=4)
    a = p.plan(mixed_step(), static=True).meta
    b = p.plan(mixed_step((7 * 8 + 2, 5 * 8 + 5), seq_lens=torch.tensor([11, 6, 8, 3], dtype=I32), max_seq_len=11),
               static=True).meta
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "ring_index", "positions",
                 "visible_blocks", "ring_slot", "compressed_slot"):
        assert getattr(a, name).data_ptr() == getattr(b, name).data_ptr(), name
    assert b.seq_lens.tolist() == [11, 6, 8, 3] and b.positions[:2].tolist() == [10, 5]
    with pytest.raises(ValueError, match="max_num_reqs"):
        planner().plan(mixed_step(), static=True)


def test_an_understated_max_seq_len_is_refused_on_the_host():
    """With the engine's host copy of seq_lens the bound is checked on every step, no sync."""
    with pytest.raises(ValueError, match="max_seq_len \\(9\\) is below a request's seq_len \\(10\\)"):
        planner().plan(mixed_step(max_seq_len=9, seq_lens_cpu=torch.tensor([10, 5, 8, 3], dtype=I32)))


HOST = "seq_lens_cpu must be int32 or int64 \\[num_reqs = 4\\] on cpu, got "


@pytest.mark.parametrize("host, message", [
    (torch.tensor([10, 5, 8], dtype=I32), HOST + r"torch.int32 \(3,\) on cpu"),
    (torch.tensor([[10, 5, 8, 3]], dtype=I32), HOST + r"torch.int32 \(1, 4\) on cpu"),
    (torch.tensor([10.0, 5, 8, 3]), HOST + r"torch.float32 \(4,\) on cpu"),
    (torch.tensor([10, 5, 8, 3], dtype=I64, device="meta"), HOST + r"torch.int64 \(4,\) on meta"),
    ([10, 5, 8, 3], HOST + "list"),
    (torch.tensor([10, 5, 7, 3], dtype=I64), r"seq_lens_cpu\[2\] = 7 differs from seq_lens\[2\] = 8"),
])
def test_the_host_copy_of_seq_lens_is_checked(host, message):
    """seq_lens_cpu feeds the max_seq_len check with no device read: a copy of another length,
    rank, dtype or device, or (on CPU, where values are read) other values, is refused by
    name; before, a short, 2-D, float or stale copy passed unseen, the others failed inside torch."""
    with pytest.raises(ValueError, match=message):
        planner().plan(mixed_step(seq_lens_cpu=host))
    planner().plan(mixed_step(seq_lens_cpu=torch.tensor([10, 5, 8, 3], dtype=I64)))  # SGLang's int64 copy


def test_an_understated_max_seq_len_makes_rows_inert_on_the_device(backend):
    """Without a host copy the metadata build guards: the long request's rows become inert
    (as padding: nothing selected, nothing written, output 0) and the sticky flag trips."""
    p = planner(value_checks=False)  # a GPU's default path: no host reads
    meta = p.plan(mixed_step(max_seq_len=9)).meta  # request 0 has seq_len 10
    assert meta.positions.tolist() == [-1, 4, 2, 3, 4, 5, 6, 7, 0, 1, 2, -1, -1]
    assert meta.visible_blocks.tolist()[:2] == [0, 1]
    assert meta.ring_slot[0] == -1 and meta.compressed_slot[0] == -1
    p.plan(mixed_step())  # a good step does not clear the flag
    with pytest.raises(RuntimeError, match="made inert"):
        p.check_guard()
    p.check_guard()  # cleared by the read


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_start_loc=torch.tensor([0, 1, 2, 8, 11], dtype=I64)), "query_start_loc must be torch.int32"),
        (dict(seq_lens=torch.tensor([10, 5, 8], dtype=I32)), "query_start_loc must have num_reqs \\+ 1 = 4"),
        (dict(ring_index=torch.tensor([10, 5, 8], dtype=I32)), "ring_index must have num_reqs = 4"),
        (dict(slot_mapping=torch.zeros(13, dtype=I32)), "slot_mapping must be torch.int64"),
        (dict(block_table=torch.zeros(4, dtype=I32)), "block_table must have 2 dims"),
        (dict(ring_index=torch.zeros(4, dtype=I64)), "ring_index must be torch.int32"),
        (dict(num_decodes=5), "num_decodes"),
        (dict(rope_positions=torch.zeros(2, 13, dtype=I64)), "rope_positions"),
        (dict(rope_positions=torch.zeros(12, dtype=I64)), "rope_positions"),
        (dict(num_padding_rows=14), "num_padding_rows"),
        (dict(max_seq_len=65), "max_model_len"),
    ],
)
def test_malformed_inputs_are_rejected_at_plan(change, message):
    with pytest.raises(ValueError, match=message):
        planner().plan(mixed_step(**change))


@pytest.mark.parametrize(
    "over, message",
    [(dict(page_size=6), "page_size"), (dict(ring_capacity=6), "ring_capacity"), (dict(max_num_tokens=0), "max_num_tokens")],
)
def test_planner_geometry_is_checked_once(over, message):
    with pytest.raises(ValueError, match=message):
        planner(**over)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_start_loc=torch.tensor([0, 2, 1, 8, 11], dtype=I32)), "non-decreasing"),
        (dict(seq_lens=torch.tensor([10, 5, 5, 3], dtype=I32)), "seq_lens"),
        (dict(num_padding_rows=1), "query_start_loc\\[-1\\]"),
        (dict(slot_mapping=torch.full((13,), 99, dtype=I64)), "slot_mapping"),
        (dict(ring_index=torch.tensor([2, 0, 3, 9], dtype=I32)), "ring_index"),
        (dict(num_decodes=3), "decode_query_len"),
        (dict(max_query_len=5), "max_query_len"),
    ],
)
def test_value_checks_on_cpu_tensors_and_under_qsa_debug(monkeypatch, change, message):
    with pytest.raises(ValueError, match=message):  # CPU tensors: checked on every step
        planner(num_slots=64, num_ring_rows=4).plan(mixed_step(**change))
    p = planner(num_slots=64, num_ring_rows=4, value_checks=False)
    p.plan(mixed_step(**change))  # a GPU's default path reads no tensor values
    monkeypatch.setenv("QSA_DEBUG", "1")  # read when a planner is made
    with pytest.raises(ValueError, match=message):
        planner(num_slots=64, num_ring_rows=4, value_checks=False).plan(mixed_step(**change))


def test_layer_launches_are_shared_by_equal_cache_views_only():
    """A schedule's bound launches are found again for the same cache object and for a new
    cache object over the same views (an engine rebuilding its views per call); another
    buffer, stride or scale gets its own."""
    from qsa_core import QSACacheLayout, QSALayerCache

    plan = planner().plan(mixed_step())
    cache = QSACacheLayout(num_layers=2, page_size=8, num_pages=4, ring_rows=4).allocate(CONFIG, torch.float32)
    a, other = cache
    launches = plan.launches(a)
    same_views = QSALayerCache(k=a.k[:], v=a.v[:], compressed=a.compressed[:], ring=a.ring[:],
                               ring_positions=a.ring_positions)
    assert plan.launches(a) is launches and plan.launches(same_views) is launches
    rescaled = QSALayerCache(k=a.k, v=a.v, compressed=a.compressed, ring=a.ring, ring_positions=a.ring_positions,
                             k_scale=0.5)
    fewer_pages = QSALayerCache(k=a.k[:3], v=a.v[:3], compressed=a.compressed[:3], ring=a.ring,
                                ring_positions=a.ring_positions)
    found = [plan.launches(cache) for cache in (other, rescaled, fewer_pages)]
    assert len({id(x) for x in [launches, *found]}) == 4 and all(x.cache is c for x, c in
                                                                 zip(found, (other, rescaled, fewer_pages)))


def test_a_plan_records_every_field_of_its_dataclasses():
    """plan builds its records field by field: none may be missing or extra."""
    from dataclasses import fields

    from qsa_core import QSAForwardMetadata, QSAPlan

    plan = planner().plan(mixed_step())
    assert set(vars(plan)) == {f.name for f in fields(QSAPlan)}
    assert set(vars(plan.meta)) == {f.name for f in fields(QSAForwardMetadata)}
