"""What the CPU server test cannot reach, on real SGLang 0.5.23 objects: CUDA-graph decode
metadata (capture, then a padded replay refresh built with SGLang's own
`build_replay_fb_view`), a TARGET_VERIFY step, and 3-axis MRoPE positions.

A real `Qwen4ExpAttentionDecoderLayer` (weights of a random HF `Qwen4ExpTextAttention`,
production budget 2048), SGLang's `ReqToTokenPool`, `QSATokenToKVPool` (page 64) and paged
allocator, `ForwardBatch` objects as the scheduler fills them. Outputs must match the
standalone `Runner` and the HF oracle (bf16: 2e-2 relative). Chunked prefill, decodes,
concurrent requests and the 512-group selection are covered by the real server
(`test_server.py`); the ForwardBatch map of every mode by `test_batch_map.py`.
"""

import types

import pytest
import torch
from hf_oracle import hf_forward, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core import debug_enabled
from qsa_core.standalone import Runner
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
from sglang_harness import BUDGET, Env, ensure_plugin, sglang_config, sglang_layer
from torch.utils._python_dispatch import TorchDispatchMode

DT = torch.bfloat16
TOL = 2e-2
LAYER_ID = 3
HIDDEN = 256


def inputs(L, seed):
    """Hidden rows with a shared component (as in test_hf_oracle: few ReLU-zero ties)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, HIDDEN, generator=g) + torch.randn(HIDDEN, generator=g)).to(DT)


def close(out, ref, what):
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < TOL, f"{what}: relative error {err:.2e}"


class HostReads(TorchDispatchMode):
    """Records ops that read tensor values back to the host (a sync on a GPU)."""

    SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
               "aten::unique_consecutive", "aten::masked_select", "aten::repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func._schema.name in self.SYNCING:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def hf():
    return random_hf_attention(tiny_config(indexer_budget=BUDGET), 0, DT, layer_idx=LAYER_ID)


@pytest.fixture(scope="module")
def layer(hf):
    ensure_plugin()
    return sglang_layer(hf, LAYER_ID, DT)


class Lockstep:
    """Runs the same schedule through SGLang (qsa_core) and the standalone Runner."""

    def __init__(self, env, runner, xs):
        self.env, self.runner, self.xs = env, runner, xs
        self.done = dict.fromkeys(xs, 0)
        self.out = {k: {} for k in ("sglang", "runner")}

    def _record(self, who, rid, start, rows):
        self.out[who].setdefault(rid, {}).update({start + i: rows[i] for i in range(rows.shape[0])})

    def _runner(self, chunks, padding=None):
        res = self.runner.step({r: self.xs[r][self.done[r] : self.done[r] + n] for r, n in chunks.items()}, padding=padding)
        for r, n in chunks.items():
            self._record("runner", r, self.done[r], res[r])
            self.done[r] += n

    def _split(self, out, chunks):
        i = 0
        for r, n in chunks.items():
            self._record("sglang", r, self.done[r], out[i : i + n])
            i += n

    def hidden(self, chunks):
        return torch.cat([self.xs[r][self.done[r] : self.done[r] + n] for r, n in chunks.items()])

    def _step(self, fb, chunks):
        self._split(self.env.run(fb, self.hidden(chunks)), chunks)
        self._runner(chunks)

    def extend(self, chunks, mode=ForwardMode.EXTEND):
        self._step(self.env.extend(chunks, mode), chunks)

    def decode(self, rids):
        self._step(self.env.decode(rids), dict.fromkeys(rids, 1))

    def verify(self, rids, draft_tokens):
        self._step(self.env.verify(rids, draft_tokens), dict.fromkeys(rids, draft_tokens))

    def graph_decode(self, rids, bs):
        """A decode CUDA-graph capture at batch size bs, then a padded replay of `rids`."""
        chunks = dict.fromkeys(rids, 1)
        out = replay_padded_decode(self.env, self.env.decode(rids), self.hidden(chunks), bs)
        self._split(out, chunks)
        self._runner(chunks, padding=torch.full((bs - len(rids), HIDDEN), float("nan"), dtype=DT))

    def rows(self, who, rid):
        got = self.out[who][rid]
        pos = sorted(got)
        return pos, torch.stack([got[p] for p in pos])


def static_buffers(n):
    """The decode graph runner's static inputs (padding values as SGLang fills them)."""
    return types.SimpleNamespace(
        input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.zeros(n, dtype=torch.int64), seq_lens=torch.ones(n, dtype=torch.int64),
        seq_lens_cpu=torch.ones(n, dtype=torch.int64), out_cache_loc=torch.zeros(n, dtype=torch.int64),
        encoder_lens=None, mamba_track_indices=None,
    )


def replay_padded_decode(env, real, hidden, bs):
    """Capture like DecodeCudaGraphRunner, then refresh for `real` (fewer requests) and replay.

    On the CPU the "replay" re-runs the layer on the static batch with the metadata object
    the capture built, which is what a graph replays: its tensors must hold the new step.
    """
    be, raw = env.backend, real.batch_size
    logged = []
    be.guard_watch.log = logged.append
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    buf = static_buffers(8)
    cap = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=buf.input_ids[:bs],
        req_pool_indices=buf.req_pool_indices[:bs], seq_lens=buf.seq_lens[:bs],
        out_cache_loc=buf.out_cache_loc[:bs], seq_lens_sum=bs, seq_lens_cpu=buf.seq_lens_cpu[:bs],
        positions=buf.positions[:bs],
    )
    with forward_context(ForwardContext(attn_backend=be)):
        be.init_forward_metadata_out_graph(cap, in_capture=True)
    captured, captured_plan = be.forward_metadata, be.plan
    env.run(cap, torch.zeros(bs, HIDDEN, dtype=DT), init=False)  # the capture's own forward

    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "positions", "out_cache_loc"):
        getattr(buf, name)[:raw].copy_(getattr(real, name))
    view = build_replay_fb_view(
        forward_batch=real, buffers=buf, bs=bs, raw_bs=raw, num_tokens=bs, global_num_tokens_cpu=None,
        seq_len_fill_value=be.get_cuda_graph_seq_len_fill_value(), capture_forward_mode=ForwardMode.DECODE,
        is_encoder_decoder=False,
    )
    before = {n: t.clone() for n, t in snapshot(env).items()}
    reads = HostReads()
    with reads:
        be.init_forward_metadata_out_graph(view)
    if not debug_enabled():  # QSA_DEBUG=1 value checks read on purpose
        assert reads.seen == [], f"replay refresh read tensors back to the host: {reads.seen}"
    refreshed = be.forward_metadata
    for field, value in vars(captured).items():
        if isinstance(value, torch.Tensor):
            assert getattr(refreshed, field).data_ptr() == value.data_ptr(), f"{field} moved at replay"
    assert refreshed.num_padding_rows == bs - raw and refreshed.positions[raw:].eq(-1).all()

    be.plan = captured_plan  # what the graph replays: the captured launches on the refreshed buffers
    padded = torch.full((bs, HIDDEN), float("nan"), dtype=DT)
    padded[:raw] = hidden
    out = env.run(cap, padded, init=False)
    assert torch.equal(out[raw:], torch.zeros_like(out[raw:])), "padding rows must output 0"
    written = set(real.out_cache_loc.tolist())
    after = snapshot(env)
    changed_kv = (after["k"] != before["k"]).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed_kv) <= written, "padding rows wrote K/V"
    assert torch.equal(after["ring"][0], before["ring"][0]), "padding rows wrote the ring rows of request slot 0"
    # The capture batch (every request on request slot 0, every row on slot 0) flagged nothing:
    # the next poll reports the replay's flags and whatever the capture left in the guard.
    be.guard_watch.poll(be.graph.planner, 0)
    assert logged == [], logged
    return out[:raw]


def snapshot(env):
    pool = env.pool
    return {
        "k": pool.get_key_buffer(env.layer_id), "ring": env.backend.ring.keys[env.layer_id],
        "compressed": pool.get_qsa_compressed_k_buffer(env.layer_id),
    }


def test_graph_decode_and_verify_match_runner_and_hf(hf, layer):
    xs = {"A": inputs(150, 1), "B": inputs(16, 2), "E": inputs(70, 5)}
    env = Env(layer)
    runner = Runner([QSAAttention.from_hf(hf)], page_size=64, num_pages=32, max_requests=8, num_speculative_tokens=1)
    s = Lockstep(env, runner, xs)

    env.admit("A"), env.admit("B")
    s.extend({"A": 130, "B": 10})  # A ends inside a group (130 = 32 * 4 + 2)
    s.decode(["A", "B"])
    b_row = env.rows["B"]
    env.free("B"), runner.free("B")  # B finishes; E gets its request row (and ring rows)
    env.admit("E")
    assert env.rows["E"] == b_row
    s.extend({"E": 60})
    s.graph_decode(["A", "E"], bs=4)
    s.verify(["A", "E"], draft_tokens=2)
    s.decode(["A", "E"])

    for rid in xs:
        pos, got = s.rows("sglang", rid)
        rpos, want = s.rows("runner", rid)
        assert rpos[-len(pos) :] == pos
        close(got, want[-len(pos) :], f"{rid} vs Runner")
        close(got, hf_forward([hf], xs[rid][: pos[-1] + 1])[pos], f"{rid} vs HF")


def test_mrope_requests_match_hf():
    """MRoPE: 3-axis positions reach the core (compressed groups use the exact first-token position),
    also from a chunk that starts inside a group and runs past it (each layer's position ring is
    the adapter's own, so no layer overwrites a position another still needs)."""
    section = [6, 5, 5]
    hf = random_hf_attention(tiny_config(mrope_section=section, indexer_budget=BUDGET), 7, DT, layer_idx=LAYER_ID)
    ensure_plugin()
    env = Env(sglang_layer(hf, LAYER_ID, DT, mrope_section=section), config=sglang_config(section))
    L = 56
    t = torch.arange(L)
    rope = torch.stack([t, (t * 7) % 13, (t * 5) % 11 + 3])
    x = inputs(L, 9)
    env.admit("a", rope=rope)
    outs = [env.run(env.extend({"a": 30}), x[:30]), env.run(env.extend({"a": 11}), x[30:41])]
    outs += [env.run(env.decode(["a"]), x[i : i + 1]) for i in range(41, L)]
    close(torch.cat(outs), hf_forward([hf], x, rope), "MRoPE vs HF")


def test_cuda_graph_state_warms_the_graph_planner(layer, monkeypatch):
    """init_cuda_graph_state warms the graph planner before capture, on every QSA layer's
    caches of the pool, with decode query lengths 1 and max_num_tokens / max_bs and no mixed
    shapes (the graphs are decode-only); on the CPU's reference backend the warm-up compiles
    nothing and logs nothing."""
    from qsa_adapters.sglang import backend

    calls, real = [], backend.start_up_warm

    env = Env(layer)  # warms its eager planner (test_eager_planner.py)

    def spy(planner, caches, *, decode_query_lens, mixed):
        caches = list(caches)
        calls.append((planner, caches, tuple(decode_query_lens), mixed))
        out = real(planner, caches, decode_query_lens=decode_query_lens, mixed=mixed)
        assert out is None and planner.backend.name == "reference"
        return out

    monkeypatch.setattr(backend, "start_up_warm", spy)
    env.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    (planner, caches, lens, mixed), = calls
    assert planner is env.backend.graph.planner
    ids = list(env.pool.full_attention_layer_id_mapping)
    assert env.layer_id in ids
    assert [c.k.data_ptr() for c in caches] == [env.pool.get_key_buffer(i).data_ptr() for i in ids]
    assert lens == (1, 3) and mixed is False
    # Where Triton compiles (a GPU) the warm-up plans static steps, which need the graph
    # planner's request bound (seen on an H100: without it every launch with graphs failed).
    from qsa_adapters.sglang.batch_map import step_inputs

    env.admit("a")
    be = env.backend
    step = step_inputs(env.extend({"a": 8}), be.req_to_token, page_size=be.page_size, mrope=be.mrope,
                       max_seq_len_bound=be.max_seq_len, fixed_max_seq_len=True)  # as graph steps map
    assert planner.plan(step, static=True).num_tokens == 8
