"""One whole decode step (plan refresh + 4 QSA layers) captured in one CUDA graph.

The graph is captured once; every replay refreshes the plan from the engine's static input
tensors on the device and runs four layers, and must equal the same step run eagerly,
bitwise: outputs and every cache (K/V, compressed keys, ring). Later steps carry CUDA-graph
padding requests (no rows, inert padding rows with NaN hidden states). The same steps run with
programmatic dependent launch (the default on the H200) and without it (`QSA_PDL=0`) give the
same bits, and so do they with the top-k's L2 warm of the K/V (`qsa_kernels.warm`) on and off.
"""

from __future__ import annotations

import pytest
import torch

import qsa_kernels.launch as launch
import qsa_kernels.warm as warm
from qsa_core import QSAAttention, QSACacheLayout, QSAConfig, QSAPlanner, QSAStepInputs

pytestmark = pytest.mark.gpu

CONFIG = QSAConfig(
    hidden_size=1024, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
    token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
)
PAGE, BATCH, LAYERS, PAGES_PER_REQ = 64, 8, 4, 160  # contexts up to 10240 tokens: scored selection
DEV = "cuda"


class Engine:
    """A toy engine owning static step inputs (what a CUDA graph reads) and paged caches."""

    def __init__(self, pages_per_req: int = PAGES_PER_REQ) -> None:
        dev, g = DEV, torch.Generator(device=DEV).manual_seed(0)
        torch.manual_seed(0)
        self.layers = [QSAAttention(CONFIG).to(dev, torch.bfloat16) for _ in range(LAYERS)]
        for layer in self.layers:
            for p in layer.parameters():
                p.data.normal_(0, 0.02 if p.dim() == 2 else 0.3, generator=g)
        layout = QSACacheLayout(num_layers=LAYERS, page_size=PAGE, num_pages=BATCH * pages_per_req + 1, ring_rows=BATCH)
        self.caches = layout.allocate(CONFIG, torch.bfloat16, dev)
        for cache in self.caches:
            for name in ("k", "v", "compressed", "ring"):
                t = getattr(cache, name)
                t.copy_(torch.randn(t.shape, device=dev, generator=g).to(t.dtype))
        self.pages = (torch.randperm(BATCH * pages_per_req, device=dev, generator=g) + 1).view(BATCH, pages_per_req)
        self.max_seq_len = pages_per_req * PAGE
        i32 = dict(dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(BATCH + 1, **i32)
        self.seq_lens = torch.zeros(BATCH, **i32)
        self.block_table = self.pages.to(torch.int32)
        self.slot_mapping = torch.full((BATCH,), -1, dtype=torch.int64, device=dev)
        self.ring_index = torch.arange(BATCH, **i32)
        self.hidden = torch.zeros(BATCH, CONFIG.hidden_size, dtype=torch.bfloat16, device=dev)
        self.out = torch.zeros_like(self.hidden)
        self.planner = QSAPlanner(
            CONFIG, dtype=torch.bfloat16, page_size=PAGE, ring_capacity=layout.ring_capacity(CONFIG),
            max_num_tokens=BATCH, max_model_len=self.max_seq_len, max_num_reqs=BATCH, device=dev,
        )

    def set_step(self, seq_lens: list[int], seed: int) -> None:
        """Write a decode step of len(seq_lens) real requests (the rest: padding) in place."""
        n = len(seq_lens)
        g = torch.Generator(device=DEV).manual_seed(seed)
        qsl = torch.arange(BATCH + 1, device=DEV).clamp(max=n).to(torch.int32)
        seq = torch.tensor(seq_lens + [1] * (BATCH - n), dtype=torch.int32, device=DEV)
        pos = seq.long() - 1
        slots = self.pages.long()[torch.arange(BATCH, device=DEV), pos // PAGE] * PAGE + pos % PAGE
        slots[n:] = -1
        self.query_start_loc.copy_(qsl)
        self.seq_lens.copy_(seq)
        self.slot_mapping.copy_(slots)
        self.hidden.copy_(torch.randn(self.hidden.shape, device=DEV, generator=g).to(torch.bfloat16))
        self.hidden[n:] = float("nan")
        self.num_padding_rows = BATCH - n

    def step(self) -> None:
        """Plan refresh (static: into the planner's buffers) and four layers."""
        plan = self.planner.plan(QSAStepInputs(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            slot_mapping=self.slot_mapping, ring_index=self.ring_index, num_decodes=BATCH,
            max_query_len=1, max_seq_len=self.max_seq_len, num_padding_rows=self.num_padding_rows,
        ), static=True)
        x = self.hidden
        for layer, cache in zip(self.layers, self.caches):
            x = layer(x, plan, cache)
        self.out.copy_(x)

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{n: getattr(c, n).clone() for n in ("k", "v", "compressed", "ring")} for c in self.caches]

    def restore(self, snap) -> None:
        for cache, saved in zip(self.caches, snap):
            for name, t in saved.items():
                getattr(cache, name).copy_(t)


STEPS = [([9000, 2049, 2051, 7000, 10240, 4096, 3001, 5555], 1),
         ([9001, 2050, 2052, 7001, 10239, 4097, 3002, 5556], 2),
         ([10000, 3333, 2100, 8000, 9999], 3),  # 3 padding requests
         ([2048, 777], 4)]  # 6 padding requests, a short context (no scoring)


@pytest.mark.parametrize("pdl", [0, 1, 2], ids=["no-pdl", "pdl-early", "pdl-late"])
def test_decode_step_replays_bitwise_as_eager(pdl, monkeypatch):
    monkeypatch.setenv("QSA_PDL", str(pdl))  # read when the engine's planner is made
    from qsa_kernels import attention
    assert launch.pdl_enabled(attention._combine.fn, pdl) == (pdl > 0 and torch.cuda.get_device_capability()[0] >= 9)
    engine = Engine()
    steps = STEPS
    with torch.no_grad():
        engine.set_step(*steps[0])
        start = engine.snapshot()
        engine.step()  # compile outside the capture
        torch.cuda.synchronize()
        engine.restore(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            engine.step()
        for seq_lens, seed in steps:
            engine.set_step(seq_lens, seed)
            before = engine.snapshot()
            engine.step()
            eager_out, eager_caches = engine.out.clone(), engine.snapshot()
            engine.restore(before)
            engine.out.fill_(7.0)
            graph.replay()
            torch.cuda.synchronize()
            n = len(seq_lens)
            assert torch.isfinite(eager_out).all()
            assert torch.equal(engine.out, eager_out), f"step {seed}: output differs"
            assert torch.equal(engine.out[n:], torch.zeros_like(engine.out[n:])), "padding rows must give 0"
            for i, (got, want) in enumerate(zip(engine.snapshot(), eager_caches)):
                for name in got:
                    assert torch.equal(got[name], want[name]), f"step {seed}, layer {i}: {name} differs"
            written = (before[0]["k"] != eager_caches[0]["k"]).flatten(2).any(-1).sum()
            assert written == n, "exactly one K/V slot per real request, none for padding"
    engine.planner.check_guard()


def eager_steps(engine: Engine, steps: list) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(each step's output, the caches after the last) of the steps run eagerly."""
    outs = []
    with torch.no_grad():
        for seq_lens, seed in steps:
            engine.set_step(seq_lens, seed)
            engine.step()
            outs.append(engine.out.clone())
    torch.cuda.synchronize()
    return outs, engine.snapshot()


def assert_same_bits(want: tuple, got: tuple, what: str) -> None:
    """Two `eager_steps` results: finite outputs, equal bit for bit, and equal caches."""
    for i, (a, b) in enumerate(zip(want[0], got[0])):
        assert torch.isfinite(a).all(), f"step {i}: output not finite"
        assert torch.equal(a, b), f"step {i}: output differs {what}"
    for i, (a, b) in enumerate(zip(want[1], got[1])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"layer {i}: {name} differs {what}"


def test_pdl_changes_no_bits(monkeypatch):
    """Eager steps with PDL (either signal) and without: the same outputs and caches, bit for bit."""
    runs = []
    for pdl in (0, 1, 2):
        monkeypatch.setenv("QSA_PDL", str(pdl))
        runs.append(eager_steps(Engine(), STEPS))
    for mode, run in enumerate(runs[1:], 1):
        assert_same_bits(runs[0], run, f"with PDL {mode}")


# Contexts up to 40960 tokens: decode rows past the short top-k's 8192 columns, so the top-k's
# K/V warm applies too.
LONG_PAGES = 640
LONG_STEPS = [([40960, 33000, 2049, 40001, 9000, 36000, 35001, 34567], 1),
              ([40000, 20000, 38000], 2)]  # 5 padding requests


def bound_topks(engine: Engine):
    """The top-k launches the engine's planner bound, every schedule and layer."""
    for schedule in engine.planner._schedules.values():
        for key, entry in schedule.launches.items():
            if key != "by_views":
                for select in getattr(entry[1], "select_launches", ()):  # none on a step of no rows
                    yield from (topk for _, _, topk in select._chunks)


def test_l2_warm_changes_no_bits(monkeypatch):
    """Eager steps with the top-k's K/V warm bound (QSA_L2_WARM unset; its byte cap lifted for
    8 rows) and without (QSA_L2_WARM=0): the same outputs and caches, bit for bit."""
    monkeypatch.setattr(warm, "KV_WARM_BYTES", 1 << 30)
    runs = []
    for mask in ("", "0"):
        monkeypatch.setenv("QSA_L2_WARM", mask)
        engine = Engine(LONG_PAGES)
        runs.append(eager_steps(engine, LONG_STEPS))
        warmed = [getattr(topk, "kv", None) is not None for topk in bound_topks(engine)]
        assert warmed and any(warmed) == (mask == ""), "the K/V warm must be bound as asked"
    assert_same_bits(runs[0], runs[1], "without the K/V warm")
