"""SGLang ForwardBatch -> QSAForwardMetadata, per forward mode, on real SGLang pools."""

import types

import pytest
import torch
from qsa_adapters.sglang.batch_map import step_inputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang_harness import PAGE, Env, ensure_plugin

R = 4  # indexer_compress_ratio of the tiny config


@pytest.fixture(params=[512, 20 * PAGE], ids=["8-pages", "20-pages"])
def env(request):
    """req_to_token 8 pages wide (an eager table's 16 columns repeat its last page) or 20 (a view)."""
    ensure_plugin()
    return Env(max_ctx=request.param)


def meta_of(env, fb):
    env.backend.init_forward_metadata(fb)
    return env.backend.forward_metadata


def expect_common(env, fb, meta, rids):
    rows = torch.tensor([env.rows[r] for r in rids])
    table = env.r2t.req_to_token[rows, ::PAGE] // PAGE
    # An eager step's table: ceil(max_seq_len / PAGE) pages rounded up to a multiple of 16 (one
    # row-stride class for the kernels), columns past req_to_token's width repeating its last page.
    pages = meta.block_table.shape[1]
    assert pages % 16 == 0 and pages - 16 < -(-meta.max_seq_len // PAGE) <= pages
    cols = torch.arange(pages).clamp(max=table.shape[1] - 1)
    assert torch.equal(meta.block_table, table[:, cols].to(torch.int32))
    assert torch.equal(meta.slot_mapping, fb.out_cache_loc)
    assert torch.equal(meta.ring_index, rows.to(torch.int32))
    # The adapter's ring row req * C + p % C (C = r without speculation) for each request's last C
    # rows; compressed at slot // r.
    C = env.backend.ring.capacity
    assert C == R
    req = meta.token_to_req.long()
    p = meta.positions
    last = torch.arange(meta.num_tokens) >= meta.query_start_loc[1:].long()[req] - C
    assert torch.equal(meta.ring_slot, torch.where(last, rows[req] * C + p % C, -1))
    closes = (p + 1) % R == 0
    assert torch.equal(meta.compressed_slot, torch.where(closes, fb.out_cache_loc // R, -1))


def test_extend_with_cached_prefix_and_chunk(env):
    env.admit("a")
    meta_of(env, env.extend({"a": 70}))
    env.admit("c", prefix_from="a", prefix=64)  # radix hit on a's first page
    fb = env.extend({"a": 10, "c": 7})
    meta = meta_of(env, fb)
    assert meta.query_start_loc.tolist() == [0, 10, 17] and meta.seq_lens.tolist() == [80, 71]
    assert meta.num_decodes == 0 and meta.max_seq_len == 80 and meta.max_query_len == 10
    assert torch.equal(meta.positions, fb.positions)
    assert torch.equal(meta.block_table[1, :1], meta.block_table[0, :1])  # the shared page
    expect_common(env, fb, meta, ["a", "c"])


def test_decode_and_mixed(env):
    env.admit("a"), env.admit("b")
    meta_of(env, env.extend({"a": 9, "b": 64}))
    fb = env.decode(["a", "b"])
    meta = meta_of(env, fb)
    assert meta.num_decodes == 2 and meta.decode_query_len == 1 and meta.query_start_loc.tolist() == [0, 1, 2]
    assert torch.equal(meta.positions, fb.seq_lens - 1)
    expect_common(env, fb, meta, ["a", "b"])
    env.admit("n")
    fb = env.extend({"n": 6, "a": 1, "b": 1}, mode=ForwardMode.MIXED)  # prefill first, then decodes
    meta = meta_of(env, fb)
    assert meta.num_decodes == 0 and meta.query_start_loc.tolist() == [0, 6, 7, 8]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 10, 65]
    expect_common(env, fb, meta, ["n", "a", "b"])


def test_target_verify_counts_the_draft_window(env):
    env.admit("a"), env.admit("b")
    meta_of(env, env.extend({"a": 70, "b": 10}))
    fb = env.verify(["a", "b"], draft_tokens=3)
    meta = meta_of(env, fb)
    assert fb.seq_lens.tolist() == [70, 10]  # SGLang's seq_lens exclude the window
    assert meta.seq_lens.tolist() == [73, 13] and meta.max_seq_len == 73
    assert meta.num_decodes == 2 and meta.decode_query_len == 3
    assert torch.equal(meta.positions, fb.spec_info.positions)
    expect_common(env, fb, meta, ["a", "b"])
    fb.spec_info.topk = 2
    with pytest.raises(NotImplementedError, match="topk must be 1"):
        meta_of(env, fb)


def test_draft_extend_v2_includes_the_window(env):
    env.admit("a"), env.admit("b")
    meta_of(env, env.extend({"a": 9, "b": 14}))
    n = 4
    seq = torch.tensor([13, 18])  # DRAFT_EXTEND_V2 seq_lens include the window
    pos = torch.cat([torch.arange(s - n, s) for s in seq.tolist()])
    loc = torch.cat([env.slots(r, s - n, s) for r, s in zip("ab", seq.tolist())])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=2, input_ids=torch.zeros(2 * n, dtype=torch.int64),
        req_pool_indices=torch.tensor([env.rows["a"], env.rows["b"]]), seq_lens=seq, out_cache_loc=loc,
        seq_lens_sum=31, seq_lens_cpu=seq.clone(), positions=pos,
        spec_info=types.SimpleNamespace(num_tokens_per_req=n, topk=1, positions=pos),
    )
    meta = meta_of(env, fb)  # no extend_seq_lens_cpu: num_tokens_per_req rows each
    assert meta.seq_lens.tolist() == [13, 18] and torch.equal(meta.positions, pos)
    assert meta.query_start_loc.tolist() == [0, 4, 8] and meta.num_decodes == 0
    expect_common(env, fb, meta, ["a", "b"])


def test_idle_and_unsupported_modes(env):
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=torch.zeros(0, dtype=torch.int64),
        req_pool_indices=torch.zeros(0, dtype=torch.int64), seq_lens=torch.zeros(0, dtype=torch.int64),
        out_cache_loc=torch.zeros(0, dtype=torch.int64), seq_lens_sum=0, positions=torch.zeros(0, dtype=torch.int64),
    )
    assert meta_of(env, idle) is None
    layer = types.SimpleNamespace(tp_q_head_num=4, v_head_dim=64)
    assert env.backend.forward(torch.zeros(0, 256), None, None, layer, idle).shape == (0, 256)
    env.admit("a")
    fb = env.extend({"a": 3})
    fb.forward_mode = ForwardMode.PREBUILT
    with pytest.raises(NotImplementedError, match="does not serve ForwardMode.PREBUILT"):
        step_inputs(fb, env.r2t.req_to_token, page_size=PAGE, mrope=False, max_seq_len_bound=512)


def test_prefix_ending_inside_a_group_needs_this_requests_ring(env):
    env.admit("a")
    meta_of(env, env.extend({"a": 66}))  # ends inside a group: the ring holds 64, 65
    meta_of(env, env.extend({"a": 5}))  # continuation from 66: fine
    env.admit("c", prefix_from="a", prefix=66)  # a cache hit ending inside a group
    with pytest.raises(ValueError, match="ends inside a group of 4"):
        meta_of(env, env.extend({"c": 3}))


def test_a_request_the_device_guards_flag_is_logged_at_the_next_step(env, monkeypatch):
    """The backend's GuardWatch (no value checks: a GPU's default path, on the reference build's
    flag): a batch whose two requests write one slot is made inert and flagged; the next
    step's metadata logs both by rid, and the reason."""
    monkeypatch.setattr(env.backend.planner, "_read_values", False)
    logged = []
    monkeypatch.setattr(env.backend.guard_watch, "log", logged.append)
    env.admit("a")
    env.admit("b")
    fb = env.extend({"a": 3, "b": 5})
    fb.out_cache_loc = fb.out_cache_loc.clone()
    fb.out_cache_loc[3] = fb.out_cache_loc[0]  # b's first row writes a's first slot
    meta = meta_of(env, fb)
    assert (meta.positions == -1).all() and logged == []  # inert; the flags are read a step later
    meta_of(env, env.decode(["a", "b"]))
    (report,) = logged
    assert "slot_mapping entry (>= 0) of a live row was another live row's too" in report
    assert "request 'a'" in report and "request 'b'" in report


def test_a_capture_batch_on_request_slot_0_is_inert_and_unflagged(env, monkeypatch):
    """SGLang's prefill-graph capture runs the eager metadata path on a dummy batch: one request
    on request slot 0 (which its ReqToTokenPool never allocates), every row writing the padding
    slot 0. Its rows are inert and it is neither refused (host value checks, the CPU default)
    nor flagged (device guards alone); the requests served next run and nothing is logged."""
    logged = []
    monkeypatch.setattr(env.backend.guard_watch, "log", logged.append)
    n = 96
    pos = torch.arange(n)
    cap = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([n]), out_cache_loc=torch.zeros(n, dtype=torch.int64),
        seq_lens_sum=n, seq_lens_cpu=torch.tensor([n]), positions=pos, extend_num_tokens=n,
        extend_seq_lens=torch.tensor([n], dtype=torch.int32), extend_prefix_lens=torch.tensor([0], dtype=torch.int32),
        extend_start_loc=torch.tensor([0], dtype=torch.int32), extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[0],
        mrope_positions=pos.expand(3, n) if env.backend.mrope else None,
    )
    for read_values in (True, False):
        monkeypatch.setattr(env.backend.planner, "_read_values", read_values)
        meta = meta_of(env, cap)
        assert (meta.positions == -1).all() and (meta.slot_mapping == -1).all()
    env.admit("a")
    meta = meta_of(env, env.extend({"a": 5}))
    assert torch.equal(meta.positions, torch.arange(5))
    meta_of(env, env.decode(["a"]))
    assert logged == []
