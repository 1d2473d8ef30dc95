"""TARGET_VERIFY steps with rejected drafts on the adapter's raw-key ring (design.md §6.7).

Real SGLang 0.5.23 objects on the CPU (a `Qwen4ExpAttentionDecoderLayer` with the weights of a
random HF attention, production budget 2048, `QSATokenToKVPool`, `ForwardBatch`es as SGLang's
EAGLE worker fills them). NEXTN's default window: the verified token plus 3 draft tokens, so
the backend's ring has C = 4 * ceil((4 + 3) / 4) = 8 rows per request.

A 2113-token prompt leaves group 528 open with one committed token (2112); a verify window at
2113..2116 whose last three drafts are rejected writes position 2116, which in a ring of r = 4
rows (SGLang's `req_pool_idx * r + p % r`) is the row of 2112. The next window (2114..2117,
the true tokens) closes group 528 and compresses it from the ring. With C = 8 the group's key
equals the one of a run without speculation, and every committed row's output equals HF's
over the committed sequence (where the context is past the budget, so the group keys decide
the selection); with C = r, as SGLang's pool allocates it, the committed raw key is gone and
group 528's key is wrong (whether a wrong key changes an output depends on whether it moves the
group across the top-k boundary of a later row; the cache state is what is asserted).
"""

import types

import pytest
import torch
from hf_oracle import hf_forward, random_hf_attention, tiny_config
from qsa_adapters.sglang.ring import ring_capacity, speculative_tokens
from sglang.srt import runtime_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_harness import BUDGET, Env, ensure_plugin, sglang_layer

DT = torch.bfloat16
TOL = 2e-2  # bf16
LAYER_ID = 3
HIDDEN = 256
R = 4
DRAFTS = 3  # NEXTN's default: speculative_num_steps 3, draft tokens 4
PROMPT = 2113  # 528 complete groups (> 512: top-k selects) and one committed token of group 528
OPEN_GROUP = PROMPT // R


def rows(n, seed):
    """Hidden rows with a shared component (few ReLU-zero ties in the indexer scores)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HIDDEN, generator=g) + torch.randn(HIDDEN, generator=g)).to(DT)


@pytest.fixture(scope="module")
def hf():
    return random_hf_attention(tiny_config(indexer_budget=BUDGET), 0, DT, layer_idx=LAYER_ID)


@pytest.fixture(scope="module")
def layer(hf):
    ensure_plugin()
    return sglang_layer(hf, LAYER_ID, DT)


@pytest.fixture(scope="module")
def truth():
    return rows(PROMPT + 8, 1)


def make_env(layer, monkeypatch, drafts: int) -> Env:
    """An Env whose runner speculates with `drafts` draft tokens per window (as SGLang resolves
    NEXTN: EAGLE, 1 + drafts draft tokens published); drafts = 0: no speculative decoding."""
    monkeypatch.setattr(runtime_context, "max_speculative_num_draft_tokens", lambda: drafts + 1)
    spec = SpeculativeAlgorithm.from_string("EAGLE" if drafts else None)
    return Env(layer, slots=4096, max_reqs=4, max_ctx=2304, spec_algorithm=spec)


def run_windows(env, truth, drafts_hidden):
    """Prefill PROMPT rows, a verify window with its drafts rejected, then a verify window of
    the true rows; returns {position: output row} of the committed rows of the verify steps."""
    env.admit("a")
    env.run(env.extend({"a": PROMPT}), truth[:PROMPT])
    window = 1 + DRAFTS
    # Window 1: the verified token at PROMPT, then three drafts that the target rejects.
    out1 = env.run(env.verify(["a"], window), torch.cat([truth[PROMPT : PROMPT + 1], drafts_hidden]))
    env.lens["a"] = PROMPT + 1  # SGLang keeps the verified token only
    # Window 2: the true tokens (all accepted).
    out2 = env.run(env.verify(["a"], window), truth[PROMPT + 1 : PROMPT + 1 + window])
    got = {PROMPT: out1[0]}
    got.update({PROMPT + 1 + i: out2[i] for i in range(window)})
    return got


def group_key(env, group: int) -> torch.Tensor:
    """The compressed key of `group` (row: main slot of its first token // r)."""
    slot = int(env.r2t.req_to_token[env.rows["a"], group * R])
    return env.pool.get_qsa_compressed_k_buffer(LAYER_ID)[slot // R, 0].float()


@pytest.fixture(scope="module")
def plain(layer, truth):
    """The same committed rows without speculation: one prefill of PROMPT + 5 rows."""
    mp = pytest.MonkeyPatch()
    try:
        env = make_env(layer, mp, 0)
        env.admit("a")
        out = env.run(env.extend({"a": PROMPT + 5}), truth[: PROMPT + 5])
        return {"env": env, "out": out}
    finally:
        mp.undo()


def test_ring_capacity_holds_the_open_group_and_a_draft_window():
    assert [ring_capacity(4, n) for n in (0, 1, 3, 4, 5)] == [4, 8, 8, 8, 12]
    assert ring_capacity(4, 0) == 4 and ring_capacity(8, 7) == 16
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        ring_capacity(4, -1)
    assert speculative_tokens(types.SimpleNamespace(spec_algorithm=None)) == 0


def test_rejected_drafts_leave_committed_raw_keys_intact(layer, hf, truth, plain, monkeypatch):
    env = make_env(layer, monkeypatch, DRAFTS)
    assert env.backend.ring.capacity == 8 == speculative_tokens(env.runner) + 5
    got = run_windows(env, truth, rows(DRAFTS, 2))
    # Group 528 (2112 .. 2115), closed in window 2 from raw keys of three steps, is the key of
    # the run without speculation (bf16 rounding of the projections aside).
    want_key = group_key(plain["env"], OPEN_GROUP)
    err = (group_key(env, OPEN_GROUP) - want_key).abs().max() / want_key.abs().max()
    assert err < TOL, f"group {OPEN_GROUP}'s key: relative error {err:.2e}"
    # Committed rows: equal to the run without speculation and to HF over the committed tokens.
    positions = sorted(got)
    out = torch.stack([got[p] for p in positions]).float()
    ref_plain = plain["out"][positions].float()
    ref_hf = hf_forward([hf], truth[: positions[-1] + 1])[positions].float()
    for ref, what in ((ref_plain, "without speculation"), (ref_hf, "HF")):
        rel = (out - ref).abs().max() / ref.abs().max()
        assert rel < TOL, f"verify rows vs {what}: relative error {rel:.2e}"


def test_a_ring_of_r_rows_loses_the_committed_raw_key(layer, truth, plain, monkeypatch):
    """The same steps with SGLang's ring size (C = r): the rejected draft at 2116 overwrote the
    row of 2112, and group 528 is compressed from the draft's raw key."""
    env = make_env(layer, monkeypatch, 0)
    assert env.backend.ring.capacity == R
    run_windows(env, truth, rows(DRAFTS, 2))
    want_key = group_key(plain["env"], OPEN_GROUP)
    err = (group_key(env, OPEN_GROUP) - want_key).abs().max() / want_key.abs().max()
    assert err > 10 * TOL, f"group {OPEN_GROUP}'s key survived a ring of r rows (error {err:.2e})"


def test_cpu_greedy_verification_runs_sglang_triton_kernel(monkeypatch):
    """qsa_core on the CPU: SGLang's greedy chain verification through its Triton kernel (the
    dispatcher alone accepts nothing there); any other process keeps SGLang's dispatcher."""
    from qsa_adapters.sglang import cpu
    from qsa_adapters.sglang.cpu_speculative import verify_greedy_around

    def chain(candidates, target):
        n = candidates.shape[1]
        return dict(
            predicts=torch.full((n,), -1, dtype=torch.int32), accept_index=torch.full((1, n), -1, dtype=torch.int32),
            accept_token_num=torch.full((1,), -1, dtype=torch.int32), candidates=candidates,
            retrieve_index=torch.arange(n).view(1, n),
            retrieve_next_token=torch.tensor([list(range(1, n)) + [-1]]),
            retrieve_next_sibling=torch.full((1, n), -1), target_predict=target,
        )

    calls = []
    other = chain(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[6, 7, 9, 1]]))
    verify_greedy_around(lambda **kw: calls.append(kw), **other)
    assert len(calls) == 1  # not qsa_core on the CPU: SGLang's own dispatcher
    monkeypatch.setattr(cpu, "_applied", True)
    # Root 5 (verified), drafts 6, 7, 8; the target predicts 6, 7, 9: drafts 6 and 7 accepted, 9 is the bonus.
    args = chain(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[6, 7, 9, 1]]))
    predicts, accept_index, accepted = verify_greedy_around(lambda **kw: pytest.fail("dispatcher called"), **args)
    assert accepted.tolist() == [2]
    assert accept_index.tolist() == [[0, 1, 2, -1]]
    assert predicts[:3].tolist() == [6, 7, 9]
