"""Malformed step metadata never yields a wrong answer.

CPU tensors: `plan` reads the values (free there) and the error names the field, the entry and
the expected value. A GPU's default path reads nothing back: there the metadata build's device
guards make every row of the malformed request inert (no cache write, output 0), the other
requests run as usual, and `check_guard` names the reason. The guard path is exercised here on
CPU tensors with the host checks switched off (`value_checks=False`), with both backends.
A layer fed hidden states whose row count differs from the plan's is refused.
"""

import pytest
import torch

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention, QSACacheLayout, QSAConfig, QSAPlanner, QSAStepInputs
from qsa_core.reference import metadata as guards

I32, I64 = torch.int32, torch.int64
CONFIG = QSAConfig.from_hf(tiny_config())
PAGE, NUM_PAGES, RING_ROWS, C = 8, 12, 3, 4
A_SLOTS = [4 * PAGE + i for i in range(4)]  # request a: 4 new rows on page 4
B_SLOTS = [2 * PAGE + i for i in range(6)]  # request b: 6 new rows on page 2


def step(device=DEVICE, **change) -> QSAStepInputs:
    """Two prefills (a: 4 rows, b: 6 rows) and 2 padding rows; `change` breaks one field."""
    args = dict(
        query_start_loc=torch.tensor([0, 4, 10], dtype=I32),
        seq_lens=torch.tensor([4, 6], dtype=I32),
        block_table=torch.tensor([[4, -1], [2, -1]], dtype=I32),
        slot_mapping=torch.tensor(A_SLOTS + B_SLOTS + [-1, -1], dtype=I64),
        ring_index=torch.tensor([0, 2], dtype=I32),
        num_decodes=0,
        max_query_len=6,
        max_seq_len=7,
        num_padding_rows=2,
    )
    args.update(change)
    return QSAStepInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()})


def with_entry(name, index, value):
    t = step("cpu").__dict__[name].clone()
    t[index] = value
    return {name: t}


# field: (change, CPU error, guard bit, the request whose rows become inert)
BAD = {
    "seq_lens": (
        dict(seq_lens=torch.tensor([3, 6], dtype=I32)),
        r"seq_lens\[0\] = 3 is below request 0's query length 4: expected seq_lens\[0\] >= 4",
        guards.GUARD_SEQ_LEN, "a",
    ),
    "max_query_len": (
        dict(max_query_len=5),
        r"max_query_len must be >= every query length \(6\), got 5",
        guards.GUARD_MAX_QUERY_LEN, "b",
    ),
    "query_start_loc": (
        dict(query_start_loc=torch.tensor([0, 4, 11], dtype=I32), seq_lens=torch.tensor([4, 7], dtype=I32)),
        r"query_start_loc\[-1\] must equal the number of rows T - num_padding_rows = 12 - 2 = 10, got 11",
        guards.GUARD_QUERY_START_LOC, "b",
    ),
    "slot_mapping": (
        with_entry("slot_mapping", 2, NUM_PAGES * PAGE),
        r"slot_mapping\[2\] = 96 is outside the cache: expected -1 or a slot in \[0, 96\)",
        guards.GUARD_SLOT, "a",
    ),
    "ring_index": (
        with_entry("ring_index", 1, RING_ROWS),
        r"ring_index\[1\] = 3 is outside the ring: expected a ring row in \[0, 3\)",
        guards.GUARD_RING_INDEX, "b",
    ),
    "block_table": (
        with_entry("block_table", (0, 0), NUM_PAGES),
        r"block_table\[0, 0\] = 12 is outside the cache: request 0 uses its first 1 pages, expected pages in \[0, 12\)",
        guards.GUARD_PAGE, "a",
    ),
    "slot_mapping_vs_block_table": (  # row 5 (b's position 1) writes into a's page 4, past a's rows
        with_entry("slot_mapping", 5, 4 * PAGE + 5),
        r"slot_mapping\[5\] = 37 disagrees with the block table: row 5 is request 1's position 1, in its page "
        r"block_table\[1, 0\] = 2, expected slot 17 \(or -1\)",
        guards.GUARD_SLOT_TABLE, "b",
    ),
}
GUARDED = list(BAD)
ROWS = {"a": slice(0, 4), "b": slice(4, 10)}
REASON = {
    guards.GUARD_SEQ_LEN: "seq_lens entry was below",
    guards.GUARD_MAX_QUERY_LEN: "query length exceeded the step's max_query_len",
    guards.GUARD_QUERY_START_LOC: r"query_start_loc\[-1\] differed",
    guards.GUARD_SLOT: "slot_mapping entry was outside",
    guards.GUARD_RING_INDEX: "ring_index entry was outside",
    guards.GUARD_PAGE: "block_table page",
    guards.GUARD_SLOT_TABLE: "was not its position's slot through its request's block_table row",
}


def planner(device=DEVICE, **kw) -> QSAPlanner:
    return QSAPlanner(CONFIG, dtype=torch.float32, page_size=PAGE, ring_capacity=C, max_num_tokens=16,
                      max_model_len=64, device=device, num_slots=NUM_PAGES * PAGE, num_ring_rows=RING_ROWS, **kw)


@pytest.mark.parametrize("field", list(BAD))
def test_cpu_steps_are_checked_and_the_error_names_the_field(field):
    """CPU tensors (on any machine): checked in plan, before anything runs."""
    change, message, _, _ = BAD[field]
    with pytest.raises(ValueError, match=message):
        planner("cpu").plan(step("cpu", **change))


@pytest.mark.parametrize("field", list(BAD))
def test_qsa_debug_checks_every_step(monkeypatch, field):
    change, message, _, _ = BAD[field]
    monkeypatch.setenv("QSA_DEBUG", "1")
    with pytest.raises(ValueError, match=message):
        planner(value_checks=False).plan(step(**change))


def run_step(inputs, p, rows=None):
    """(output, caches before, caches after, plan) of one layer on `inputs`; hidden rows: 12
    fixed ones, or those of `rows` (int64 [T]) among them."""
    layer = QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)).to(DEVICE)
    cache = QSACacheLayout(num_layers=1, page_size=PAGE, num_pages=NUM_PAGES, ring_rows=RING_ROWS).allocate(
        CONFIG, torch.float32, DEVICE)[0]
    for t in (cache.k, cache.v, cache.compressed, cache.ring):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)).to(t.dtype))
    before = [t.clone() for t in (cache.k, cache.v, cache.compressed, cache.ring)]
    hidden = torch.randn(12, CONFIG.hidden_size, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    if rows is not None:
        hidden = hidden[rows.to(DEVICE)]
    plan = p.plan(inputs)
    with torch.no_grad():
        out = layer(hidden, plan, cache)
    after = [cache.k, cache.v, cache.compressed, cache.ring]
    return out.cpu(), before, after, plan


@pytest.mark.parametrize("field", GUARDED)
def test_device_guards_make_the_malformed_request_inert(backend, field):
    change, _, bit, bad = BAD[field]
    good = "b" if bad == "a" else "a"
    want, _, _, _ = run_step(step(), planner(value_checks=False))
    p = planner(value_checks=False)
    out, before, after, plan = run_step(step(**change), p)

    assert torch.equal(out[ROWS[bad]], torch.zeros_like(out[ROWS[bad]]))  # inert: output 0
    assert torch.equal(out[ROWS[good]], want[ROWS[good]])  # the other request as usual
    meta = plan.meta
    assert (meta.positions[ROWS[bad]] == -1).all() and (meta.slot_mapping[ROWS[bad]] == -1).all()
    own = {"a": A_SLOTS, "b": B_SLOTS}[good]
    ring = int(step("cpu").ring_index[0 if good == "a" else 1])
    k_rows = lambda t: t.flatten(0, 1).flatten(1)  # noqa: E731  one row per main slot
    for name, old, new, allowed in (
        ("k", k_rows(before[0]), k_rows(after[0]), own),
        ("v", k_rows(before[1]), k_rows(after[1]), own),
        ("compressed", before[2].flatten(0, 1), after[2].flatten(0, 1), [s // 4 for s in own]),  # flat rows
        ("ring", before[3].flatten(0, 1), after[3].flatten(0, 1), range(ring * C, (ring + 1) * C)),
    ):
        changed = (old != new).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(allowed), f"{name}: rows {changed} written, only {sorted(set(allowed))} allowed"
    with pytest.raises(RuntimeError, match=REASON[bit]):
        p.check_guard()
    assert int(p.guard) == 0  # read and cleared


def test_decode_requests_of_other_row_counts_are_inert(backend):
    """A decode request must have decode_query_len rows (or 0): MTP rows of a decode-only step are
    scored a whole request per program, so one of other length would shift the next requests' rows
    across programs. Here a is a decode of 4 rows and b, counted as a decode too, has 6."""
    bad = dict(num_decodes=2, decode_query_len=4)
    with pytest.raises(ValueError, match=r"decode request 1 has 6 rows: the first num_decodes = 2 requests must each "
                                         r"have decode_query_len = 4 rows"):
        planner("cpu", backend="reference").plan(step("cpu", **bad))
    want, _, _, _ = run_step(step(num_decodes=1, decode_query_len=4), planner(value_checks=False))
    p = planner(value_checks=False)
    out, _, _, plan = run_step(step(**bad), p)
    assert torch.equal(out[ROWS["b"]], torch.zeros_like(out[ROWS["b"]]))
    assert torch.equal(out[ROWS["a"]], want[ROWS["a"]])
    assert (plan.meta.positions[ROWS["b"]] == -1).all()
    with pytest.raises(RuntimeError, match="had neither decode_query_len nor 0 rows"):
        p.check_guard()


@pytest.mark.parametrize("rows", [11, 13])
def test_hidden_states_must_match_the_plan(rows):
    layer = QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)).to(DEVICE)
    cache = QSACacheLayout(num_layers=1, page_size=PAGE, num_pages=NUM_PAGES, ring_rows=RING_ROWS).allocate(
        CONFIG, torch.float32, DEVICE)[0]
    plan = planner().plan(step())
    with pytest.raises(ValueError, match=rf"hidden_states has {rows} rows, expected the plan's num_tokens = 12"):
        layer(torch.zeros(rows, CONFIG.hidden_size, device=DEVICE), plan, cache)


def _ring(rows: int, capacity: int, device) -> dict:
    return dict(ring=torch.zeros(rows, capacity, CONFIG.index_head_dim, device=device),
                ring_positions=torch.zeros(rows, capacity, 3, dtype=I64, device=device))


@pytest.mark.parametrize("change, message", [
    (lambda c: dict(v=c.v[: NUM_PAGES - 2]), rf"cache.v must have as many pages as cache.k \({NUM_PAGES}\), got 10"),
    (lambda c: _ring(RING_ROWS, 2 * C, c.ring.device), rf"cache.ring must be \[ring_rows, {C}, "),
    (lambda c: dict(compressed=c.compressed.bfloat16()),
     r"cache.compressed must be torch.float32 \(index_dtype 'auto' = the model dtype\), got torch.bfloat16"),
    (lambda c: dict(ring=c.ring.bfloat16()), r"cache.ring must be torch.float32 \(the model dtype: .*\), got torch.bfloat16"),
    (lambda c: dict(k="narrow"), rf"k must be \[T, {CONFIG.num_kv_heads * CONFIG.head_dim}\] for this layer's heads"),
    (lambda c: dict(q_gate="narrow"), rf"q_gate must be \[T, {2 * CONFIG.num_heads * CONFIG.head_dim}\]"),
    (lambda c: dict(index_qk="bf16"), r"index_qk must be torch.float32 \(the model dtype the plan was made for\), "
                                      r"got torch.bfloat16"),
    (lambda c: dict(v="bf16"), r"v must be torch.float32 \(the model dtype the plan was made for\), got torch.bfloat16"),
])
def test_the_write_side_checks_its_cache_and_projections_when_it_binds(backend, change, message):
    """The write side bounds its stores by the cache's shapes (V by K's slots, the ring by the
    plan's C) and its head loops by the projections' widths, and casts them to the caches'
    dtypes: where they disagree it is refused once per (schedule, cache), on either backend,
    naming the tensor (before: writes outside the views, or silently rounded keys). So are
    projections in another dtype than the model's (before: computed at their precision)."""
    import dataclasses

    from qsa_core import qsa_prepare

    layer = QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)).to(DEVICE)
    good = QSACacheLayout(num_layers=1, page_size=PAGE, num_pages=NUM_PAGES, ring_rows=RING_ROWS).allocate(
        CONFIG, torch.float32, DEVICE)[0]
    plan = planner(backend=backend).plan(step())
    T, D = 12, CONFIG.head_dim
    hidden = torch.randn(T, CONFIG.hidden_size, device=DEVICE)
    index_qk = layer.indexer.index_qk_proj(hidden).detach()
    q_gate = torch.randn(T, 2 * CONFIG.num_heads * D, device=DEVICE)
    kv = torch.randn(T, CONFIG.num_kv_heads * D, device=DEVICE)
    args = dict(index_qk=index_qk, q_gate=q_gate, k=kv, v=kv.clone())
    fields = change(good)
    cache = dataclasses.replace(good, **{n: x for n, x in fields.items() if not isinstance(x, str)})
    args.update({n: args[n][:, :-D] if x == "narrow" else args[n].bfloat16()  # "bf16": the projection's dtype
                 for n, x in fields.items() if isinstance(x, str)})
    with pytest.raises(ValueError, match=message):
        qsa_prepare(plan, layer.norm_weights(), args["index_qk"], args["q_gate"], args["k"], args["v"], cache)
    qsa_prepare(plan, layer.norm_weights(), index_qk, q_gate, kv, kv.clone(), good)  # the same step, well formed


def test_padding_rows_never_write_the_slots_they_carry(backend):
    """CUDA-graph padding rows often carry slot 0 (design.md §6.6): the metadata gives them slot
    -1, and a layer step writes no K/V, ring or compressed row for them and outputs 0 there."""
    layer = QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)).to(DEVICE)
    cache = QSACacheLayout(num_layers=1, page_size=PAGE, num_pages=NUM_PAGES, ring_rows=RING_ROWS).allocate(
        CONFIG, torch.float32, DEVICE)[0]
    for name in ("k", "v", "compressed", "ring"):
        getattr(cache, name).fill_(3.0)  # a sentinel no write of this step produces
    plan = planner().plan(step(slot_mapping=torch.tensor(A_SLOTS + B_SLOTS + [0, 0], dtype=I64)))
    assert plan.meta.slot_mapping[-2:].tolist() == [-1, -1]
    hidden = torch.randn(12, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = layer(hidden, plan, cache)
    assert torch.equal(out[-2:].cpu(), torch.zeros(2, CONFIG.hidden_size))
    for name in ("k", "v"):  # page 0 (slot 0) holds no live row: untouched
        t = getattr(cache, name)
        assert (t[0] == 3.0).all(), name
        assert not any((t.flatten(0, 1)[s] == 3.0).all() for s in A_SLOTS + B_SLOTS), name  # live rows written
    assert (cache.compressed[0] == 3.0).all()


# Two live requests writing one slot or one ring row: each request's slots agree with its own
# block table (b's table names a's page 4), or both name ring row 2. Both requests are wrong.
B_ON_A = [4 * PAGE + i for i in range(6)]
SHARED = {
    "slot_mapping": (
        dict(block_table=torch.tensor([[4, -1], [4, -1]], dtype=I32),
             slot_mapping=torch.tensor(A_SLOTS + B_ON_A + [-1, -1], dtype=I64)),
        r"slot_mapping\[0\] = slot_mapping\[4\] = 32: rows 0 \(request 0\) and 4 \(request 1\) write the same KV "
        r"slot, expected distinct slots \(or -1\) for the live rows",
        "slot_mapping entry \\(>= 0\\) of a live row was another live row's too",
    ),
    "ring_index": (
        dict(ring_index=torch.tensor([2, 2], dtype=I32)),
        r"ring_index\[0\] = ring_index\[1\] = 2: requests 0 and 1 both have rows in this step, expected a ring row "
        r"of its own for each",
        "ring_index entry was another request's with rows too",
    ),
}


@pytest.mark.parametrize("field", list(SHARED))
def test_shared_write_slots_or_ring_rows_are_refused_on_cpu_and_under_qsa_debug(monkeypatch, field):
    change, message, _ = SHARED[field]
    with pytest.raises(ValueError, match=message):
        planner("cpu").plan(step("cpu", **change))
    monkeypatch.setenv("QSA_DEBUG", "1")
    with pytest.raises(ValueError, match=message):
        planner(value_checks=False).plan(step(**change))


@pytest.mark.parametrize("field", list(SHARED))
def test_device_guards_make_requests_sharing_a_slot_or_ring_row_inert(backend, field):
    """Both requests: no cache write at all, output 0, and check_guard names them and why."""
    change, _, reason = SHARED[field]
    p = planner(value_checks=False)
    out, before, after, plan = run_step(step(**change), p)
    assert torch.equal(out[:10], torch.zeros_like(out[:10]))
    assert (plan.meta.positions == -1).all() and (plan.meta.slot_mapping == -1).all()
    for name, old, new in zip(("k", "v", "compressed", "ring"), before, after):
        assert torch.equal(old, new), name
    assert (p.request_flags[:2].cpu() != 0).all()
    with pytest.raises(RuntimeError, match=rf"{reason}.*Flagged: request 'a': .*{reason}.*; request 'b': .*{reason}"):
        p.check_guard(["a", "b"])


def test_a_request_without_rows_may_share_a_ring_row(backend):
    """A CUDA-graph padding request (no rows) keeps any ring_index, also a live request's: the
    step runs as without it, on CPU (value checks) and with the device guards alone."""
    padded = dict(query_start_loc=torch.tensor([0, 4, 4, 10], dtype=I32), seq_lens=torch.tensor([4, 0, 6], dtype=I32),
                  block_table=torch.tensor([[4, -1], [-1, -1], [2, -1]], dtype=I32),
                  ring_index=torch.tensor([0, 0, 2], dtype=I32))
    want, _, _, _ = run_step(step(), planner(value_checks=False))
    planner("cpu", backend="reference").plan(step("cpu", **padded))  # the value checks
    p = planner(value_checks=False)
    out, _, _, _ = run_step(step(**padded), p)
    assert torch.equal(out, want)
    p.check_guard()  # nothing flagged


@pytest.mark.parametrize("change", [
    dict(ring_index=torch.tensor([0, RING_ROWS, 2], dtype=I32)),
    dict(block_table=torch.tensor([[4, -1], [NUM_PAGES, -1], [2, -1]], dtype=I32)),
], ids=["ring_index", "block_table"])
def test_a_request_without_rows_reads_nothing_and_is_not_checked(backend, change):
    """A request without rows reads and writes nothing, so its ring row and pages are not
    checked: the value checks accept it out of range, the device guards report nothing, and the
    other requests run as without it (host and device agree)."""
    padded = dict(query_start_loc=torch.tensor([0, 4, 4, 10], dtype=I32), seq_lens=torch.tensor([4, 4, 6], dtype=I32),
                  block_table=torch.tensor([[4, -1], [7, -1], [2, -1]], dtype=I32),
                  ring_index=torch.tensor([0, 1, 2], dtype=I32))
    padded.update(change)
    planner("cpu", backend="reference").plan(step("cpu", **padded))  # the value checks
    want, _, want_after, _ = run_step(step(), planner(value_checks=False))
    p = planner(value_checks=False)
    out, _, after, _ = run_step(step(**padded), p)
    assert torch.equal(out, want)
    for name, got, expected in zip(("k", "v", "compressed", "ring"), after, want_after):
        assert torch.equal(got, expected), name
    p.check_guard()  # nothing reported


@pytest.mark.parametrize("dummy_slots, dummy_pages", [
    ([7 * PAGE, 8 * PAGE], [7, 8]),  # vLLM's dummy runs: slots of their own
    ([0, 0], [-1, -1]),  # SGLang's capture batches: every row on its padding slot 0, no page
])
def test_requests_on_the_null_ring_row_are_the_engines_padding(backend, dummy_slots, dummy_pages):
    """An engine's padding requests with rows on the planner's null_ring_row (vLLM's dummy runs
    give every request its null block, SGLang's capture batches its request-pool row 0): their
    rows are inert (output 0, no cache write, though they carry slots, even one slot for all)
    and none of their values is checked or flagged, and the other requests run as without them,
    on CPU (value checks) and with the device guards alone. Without a null ring row the step is
    refused."""
    null = 1
    dummies = dict(query_start_loc=torch.tensor([0, 4, 5, 6, 12], dtype=I32),
                   seq_lens=torch.tensor([4, 1, 1, 6], dtype=I32),
                   block_table=torch.tensor([[4, -1], [dummy_pages[0], -1], [dummy_pages[1], -1], [2, -1]], dtype=I32),
                   slot_mapping=torch.tensor(A_SLOTS + dummy_slots + B_SLOTS, dtype=I64),
                   ring_index=torch.tensor([0, null, null, 2], dtype=I32), num_padding_rows=0)
    with pytest.raises(ValueError, match=r"ring_index\[1\] = ring_index\[2\] = 1: requests 1 and 2 both have rows"):
        planner("cpu", backend="reference").plan(step("cpu", **dummies))
    planner("cpu", backend="reference", null_ring_row=null).plan(step("cpu", **dummies))  # the value checks
    want, _, want_after, _ = run_step(step(), planner(value_checks=False))
    p = planner(value_checks=False, null_ring_row=null)
    rows = torch.tensor([0, 1, 2, 3, 10, 11, 4, 5, 6, 7, 8, 9])  # a, the dummies (2 more rows), b
    out, _, after, plan = run_step(step(**dummies), p, rows)
    assert torch.equal(out[:4], want[:4]) and torch.equal(out[6:], want[4:10])
    assert torch.equal(out[4:6], torch.zeros_like(out[4:6]))
    assert (plan.meta.positions[4:6] == -1).all() and (plan.meta.slot_mapping[4:6] == -1).all()
    for name, got, expected in zip(("k", "v", "compressed", "ring"), after, want_after):
        assert torch.equal(got, expected), name
    p.check_guard()  # nothing flagged
    with pytest.raises(ValueError, match=r"null_ring_row must be a ring row in \[0, num_ring_rows = 3\), got 3"):
        planner(null_ring_row=RING_ROWS)


def test_requests_sharing_a_prefix_page_they_only_read_run(backend):
    """Prefix caching: a and b both read page 4 (their positions 0..7) and each writes its own
    page (a 5, b 2): accepted by the value checks and passed by the device guards."""
    shared_prefix = dict(seq_lens=torch.tensor([12, 14], dtype=I32), block_table=torch.tensor([[4, 5], [4, 2]], dtype=I32),
                         slot_mapping=torch.tensor([5 * PAGE + i for i in range(4)] + B_SLOTS + [-1, -1], dtype=I64),
                         max_seq_len=14)
    planner("cpu", backend="reference").plan(step("cpu", **shared_prefix))  # the value checks
    p = planner(value_checks=False)
    out, _, _, plan = run_step(step(**shared_prefix), p)
    assert (plan.meta.positions[:10] >= 8).all() and (out[:10] != 0).any(1).all()
    p.check_guard()  # nothing flagged


def test_the_triton_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    """A compiled Triton kernel given CPU tensors reads host addresses on the GPU (an illegal
    memory access that poisons the CUDA context): refused by name when the planner is built."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="the triton backend on CPU tensors needs TRITON_INTERPRET=1"):
        planner("cpu", backend="triton")
    monkeypatch.setenv("QSA_BACKEND", "triton")
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        planner("cpu")
