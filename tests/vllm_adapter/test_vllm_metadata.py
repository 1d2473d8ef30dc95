"""CommonAttentionMetadata (+ the ring block table) -> QSAForwardMetadata, against the Runner.

Every step a core `Runner` runs is restated as the real vLLM metadata object vLLM's model
runner would build for it; the adapter's map must give the Runner's own step record.
"""

import pytest

import torch  # noqa: E402
from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec  # noqa: E402
from vllm_batches import common_metadata  # noqa: E402

from qsa_adapters.vllm.backend import QSACoreBackend, QSAStepMetadata, QSAStepMetadataBuilder  # noqa: E402
from qsa_adapters.vllm.metadata import (  # noqa: E402
    PagedGeometry,
    QSAMetadataMapper,
    uniform_decode_split,
)
from qsa_core import QSAAttention, QSAConfig  # noqa: E402
from qsa_core.standalone import Runner  # noqa: E402

CONFIG = QSAConfig(
    hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, index_n_heads=2, index_head_dim=32,
    token_topk=16, compress_ratio=4, rotary_dim=16, rope_theta=1e4,
)
PAGE = 16
FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "ring_index", "rope_positions",
          "token_to_req", "positions", "visible_blocks", "ring_slot", "compressed_slot")
# Ring blocks are the Runner's ring rows + 1: vLLM allocates no request its null block 0, on
# which the mapper's planner takes requests for padding (`NULL_BLOCK`).
RING_OFFSET = 1
INTS = ("num_tokens", "num_padding_rows", "num_reqs", "num_decodes", "decode_query_len", "max_query_len",
        "max_seq_len", "page_size", "ring_capacity", "compress_ratio")


def make_runner(num_spec=0):
    torch.manual_seed(0)
    return Runner([QSAAttention(CONFIG)], page_size=PAGE, num_pages=64, max_requests=6, shuffle_pages=True,
                  num_speculative_tokens=num_spec)


def mapper(num_spec=0):
    C = 4 * -(-(4 + num_spec) // 4)
    geometry = PagedGeometry(compress_ratio=4, page_size=PAGE, ring_capacity=C)
    return QSAMetadataMapper(geometry, CONFIG, torch.float32, "cpu")


def run(runner, step, padding=0):
    x = {k: torch.randn(n, CONFIG.hidden_size) for k, n in step.items()}
    runner.step(x, padding=torch.zeros(padding, CONFIG.hidden_size) if padding else None)
    return runner.last_metadata


def assert_same(mapped, ref, num_reqs=None):
    R = ref.num_reqs if num_reqs is None else num_reqs
    for name in INTS:
        if name != "num_reqs" or num_reqs is None:
            assert getattr(mapped, name) == getattr(ref, name), name
    for name in FIELDS:
        got, want = getattr(mapped, name), getattr(ref, name)
        if name in ("query_start_loc",):
            got = got[: R + 1]
        elif name in ("seq_lens", "block_table", "ring_index"):
            got, want = got[:R], want[:R]
        if name == "block_table":  # pages past a request's length: -1 here, the null block in vLLM
            got = torch.where(want >= 0, got, -1)
        if name == "ring_index":
            got = got - RING_OFFSET
        if name == "ring_slot":
            got = torch.where(got >= 0, got - RING_OFFSET * mapped.ring_capacity, got)
        assert got.dtype == want.dtype and torch.equal(got, want), name


SCHEDULES = {
    # new prefills, then decodes first beside a new prompt and a continuing chunk
    "mixed": [{"a": 37, "b": 11}, {"b": 1, "a": 30, "c": 20}, {"b": 1, "c": 1, "a": 23, "d": 5}],
    # one prompt in chunks that end inside groups and pages (37 = 9 groups + 1, 67, 90)
    "chunked_prefill": [{"a": 37}, {"a": 30}, {"a": 23, "b": 3}, {"a": 1, "b": 1}, {"a": 1, "b": 6}],
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_steps_map_to_the_runner_metadata(name):
    runner, m = make_runner(), mapper()
    for step in SCHEDULES[name]:
        ref = run(runner, step)
        common, ring = common_metadata(ref, ring_offset=RING_OFFSET)
        assert_same(m.map(common, ring).meta, ref)


@pytest.mark.parametrize("pad_reqs, pad_tokens", [(1, 1), (3, 5)])
def test_padded_uniform_decode_batch(pad_reqs, pad_tokens):
    """FULL CUDA graph: zero-length padding requests and -1 slots are inert rows."""
    runner, m = make_runner(), mapper()
    run(runner, {"a": 21, "b": 9, "c": 40})
    ref = run(runner, {"a": 1, "b": 1, "c": 1}, padding=pad_tokens)
    common, ring = common_metadata(ref, ring_offset=RING_OFFSET, pad_reqs=pad_reqs)
    mapped = m.map(common, ring).meta
    assert_same(mapped, ref, num_reqs=3)
    assert mapped.num_reqs == 3 + pad_reqs and mapped.num_decodes == 3
    pad = slice(3, None)
    assert mapped.positions[pad].tolist() == [-1] * pad_tokens
    assert mapped.ring_slot[pad].tolist() == [-1] * pad_tokens
    assert mapped.compressed_slot[pad].tolist() == [-1] * pad_tokens
    assert mapped.visible_blocks[pad].tolist() == [0] * pad_tokens


def test_padded_mixed_batch_and_spec_decode_length():
    """Decodes of 1 + 2 draft tokens first, a chunked prefill after them, padded rows last."""
    runner, m = make_runner(num_spec=2), mapper(num_spec=2)
    run(runner, {"a": 22, "b": 13})
    ref = run(runner, {"a": 3, "b": 3, "c": 17}, padding=4)
    assert (ref.num_decodes, ref.decode_query_len) == (2, 3)
    common, ring = common_metadata(ref, ring_offset=RING_OFFSET, pad_reqs=2)
    assert_same(m.map(common, ring, decode_threshold=3).meta, ref, num_reqs=3)


@pytest.mark.parametrize("qsl, threshold, want", [
    ([0, 1, 2, 9], 1, (2, 1)),        # two decodes, a prefill
    ([0, 7, 8], 1, (0, 1)),           # a prefill first: no decodes
    ([0, 1, 2, 3, 3, 3], 1, (3, 1)),  # zero-length padding requests are not decodes
    ([0, 3, 6, 7, 12], 3, (2, 3)),    # spec decode: the leading run of 1 + 2 drafts
    ([0, 0, 0], 1, (0, 1)),           # an all-padding step
])
def test_uniform_decode_split(qsl, threshold, want):
    assert uniform_decode_split(torch.tensor(qsl, dtype=torch.int32), threshold) == want


def test_builders_pair_the_main_and_ring_groups_of_a_step():
    """One builder per KV-cache group: both halves of a step meet in one QSAStep (keyed by the
    query_start_loc tensor vLLM copies into every group's record); the next step gets a new one."""
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=PAGE))
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=32, dtype=torch.float32)
    ring_spec = CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=32, head_size_v=0, dtype=torch.float32)
    cls = QSACoreBackend.get_builder_cls()
    main_builder = cls(spec, ["l.attn"], vllm_config, torch.device("cpu"))
    ring_builder = cls(ring_spec, ["l.indexer.raw_key_cache"], vllm_config, torch.device("cpu"))
    assert isinstance(main_builder, QSAStepMetadataBuilder) and main_builder.reorder_batch_threshold == 1
    runner = make_runner()
    run(runner, {"a": 21, "b": 9})
    common, ring = common_metadata(run(runner, {"a": 1, "b": 5}), ring_offset=RING_OFFSET)
    ring_half = ring_builder.build(0, common.replace(block_table_tensor=ring))
    main_half = main_builder.build(0, common)
    assert isinstance(main_half, QSAStepMetadata) and main_half.step is ring_half.step
    assert main_half.step.main is common and main_half.step.ring_block_table is ring
    common2, ring2 = common_metadata(run(runner, {"a": 1, "b": 1}), ring_offset=RING_OFFSET)
    assert main_builder.build(0, common2).step is not main_half.step


def test_dummy_run_on_the_null_block_is_inert_and_unflagged():
    """vLLM's dummy runs (memory profiling, graph capture) give every request its null block 0,
    in the ring group too: the mapper plans them (the CPU value checks pass) with every row inert
    (no position, no cache write) and nothing flagged."""
    runner, m = make_runner(), mapper()
    ref = run(runner, {"a": 5, "b": 3, "c": 1})
    common, ring = common_metadata(ref, ring_offset=RING_OFFSET)
    plan = m.map(common, torch.zeros_like(ring))
    assert m.planner.null_ring_row == 0
    assert (plan.meta.positions == -1).all() and (plan.meta.slot_mapping == -1).all()
    assert (plan.meta.ring_slot == -1).all() and (plan.meta.compressed_slot == -1).all()
    m.planner.check_guard()  # nothing flagged
