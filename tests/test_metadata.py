"""Step metadata: SPEC.md section 3's derivations, padding rows, and malformed input errors."""

import pytest
import torch

from qsa_core import QSAMetadataBuilder

I32, I64 = torch.int32, torch.int64


def mixed_step(**over):
    """Two decodes (context 9 and 4) then prefills of 6 (context 2) and 3 (new), 2 padding rows.

    r = 4, page 8, C = 4.
    """
    args = dict(
        query_start_loc=torch.tensor([0, 1, 2, 8, 11], dtype=I32),
        seq_lens=torch.tensor([10, 5, 8, 3], dtype=I32),
        block_table=torch.tensor([[3, 7], [5, -1], [0, -1], [2, -1]], dtype=I32),
        slot_mapping=torch.tensor(
            [7 * 8 + 1, 5 * 8 + 4] + [0 * 8 + i for i in range(2, 8)] + [2 * 8 + i for i in range(3)] + [-1, -1],
            dtype=I64,
        ),
        ring_index=torch.tensor([2, 0, 3, 1], dtype=I32),
        num_decodes=2,
        max_query_len=6,
        max_seq_len=10,
        num_padding_rows=2,
    )
    args.update(over)
    return args


def test_derived_fields_of_a_mixed_step():
    meta = QSAMetadataBuilder(4, 8, 4).build(**mixed_step())
    assert meta.token_to_req.tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0]
    assert meta.positions.tolist() == [9, 4, 2, 3, 4, 5, 6, 7, 0, 1, 2, -1, -1]
    # visible = complete groups among tokens 0..p
    assert meta.visible_blocks.tolist() == [2, 1, 0, 1, 1, 1, 1, 2, 0, 0, 0, 0, 0]
    # ring: ring_index * C + p % C, only the last C rows of each request
    assert meta.ring_slot.tolist() == [9, 0, -1, -1, 12, 13, 14, 15, 4, 5, 6, -1, -1]
    # compressed write slot = main slot // r for rows that close a group
    assert meta.compressed_slot.tolist() == [-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, -1, -1]
    assert (meta.num_decode_tokens, meta.num_prefills, meta.num_prefill_tokens) == (2, 2, 11)
    assert meta.rope_positions is meta.positions


def test_idle_step_is_all_padding():
    meta = QSAMetadataBuilder(4, 8, 4).build(
        query_start_loc=torch.zeros(1, dtype=I32), seq_lens=torch.zeros(0, dtype=I32),
        block_table=torch.zeros(0, 1, dtype=I32), slot_mapping=torch.full((3,), -1, dtype=I64),
        ring_index=torch.zeros(0, dtype=I32), num_decodes=0, max_query_len=0, max_seq_len=0,
        num_padding_rows=3,
    )
    assert meta.positions.tolist() == [-1, -1, -1] and meta.visible_blocks.tolist() == [0, 0, 0]


def test_persistent_buffers_are_refreshed_in_place():
    builder = QSAMetadataBuilder(4, 8, 4, max_num_tokens=16)
    first = builder.build(**mixed_step())
    ptr = first.positions.data_ptr()
    second = builder.build(**mixed_step(seq_lens=torch.tensor([11, 5, 8, 3], dtype=I32)))
    assert second.positions.data_ptr() == ptr and second.positions[0].item() == 10
    with pytest.raises(ValueError, match="max_num_tokens"):
        builder.build(**mixed_step(slot_mapping=torch.full((17,), -1, dtype=I64), num_padding_rows=6))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_start_loc=torch.tensor([0, 1, 2, 8, 11], dtype=I64)), "query_start_loc must be torch.int32"),
        (dict(seq_lens=torch.tensor([10, 5, 8], dtype=I32)), "seq_lens must have num_reqs = 4"),
        (dict(query_start_loc=torch.tensor([0, 1, 2, 8], dtype=I32)), "must have num_reqs = 3"),
        (dict(slot_mapping=torch.zeros(13, dtype=I32)), "slot_mapping must be torch.int64"),
        (dict(block_table=torch.zeros(4, dtype=I32)), "block_table must have 2 dims"),
        (dict(ring_index=torch.zeros(4, dtype=I64)), "ring_index must be torch.int32"),
        (dict(num_decodes=5), "num_decodes"),
        (dict(rope_positions=torch.zeros(2, 13, dtype=I64)), "rope_positions"),
        (dict(rope_positions=torch.zeros(12, dtype=I64)), "rope_positions"),
        (dict(num_padding_rows=14), "num_padding_rows"),
    ],
)
def test_malformed_metadata_is_rejected_at_build(change, message):
    with pytest.raises(ValueError, match=message):
        QSAMetadataBuilder(4, 8, 4).build(**mixed_step(**change))


def test_page_size_must_be_a_multiple_of_the_ratio():
    with pytest.raises(ValueError, match="page_size"):
        QSAMetadataBuilder(4, 6, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_start_loc=torch.tensor([0, 2, 1, 8, 11], dtype=I32)), "non-decreasing"),
        (dict(seq_lens=torch.tensor([10, 5, 5, 3], dtype=I32)), "seq_lens"),
        (dict(num_padding_rows=1), "query_start_loc\\[-1\\]"),
        (dict(max_seq_len=9), "max_seq_len"),
        (dict(slot_mapping=torch.full((13,), 99, dtype=I64)), "slot_mapping"),
        (dict(ring_index=torch.tensor([2, 0, 3, 9], dtype=I32)), "ring_index"),
        (dict(num_decodes=3), "decode_query_len"),
    ],
)
def test_value_checks_only_under_qsa_debug(monkeypatch, change, message):
    builder = QSAMetadataBuilder(4, 8, 4)
    builder.build(**mixed_step(**change))  # default path reads no tensor values
    monkeypatch.setenv("QSA_DEBUG", "1")
    with pytest.raises(ValueError, match=message):
        builder.build(**mixed_step(**change)).check_values(num_slots=64, num_ring_rows=4)
