"""The Runner's steps are transactions: a layer failing mid-step, or a request the checks or the
device guards refuse, leaves every request as it was, and a retry gives a clean run's output."""

import pytest
import torch
from torch import nn

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core.standalone import Runner

HIDDEN = 256


class Flaky(nn.Module):
    """A QSA layer that raises once when armed (after the layers before it wrote their caches)."""

    def __init__(self, layer: QSAAttention) -> None:
        super().__init__()
        self.layer, self.config, self.armed = layer, layer.config, False

    def forward(self, hidden, plan, cache):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected layer fault")
        return self.layer(hidden, plan, cache)


def make_runner(num_layers: int = 2, **kw) -> Runner:
    """num_layers QSA layers, the last one `Flaky`."""
    layers = [QSAAttention.from_hf(random_hf_attention(tiny_config(), seed)).to(DEVICE) for seed in range(num_layers)]
    layers[-1] = Flaky(layers[-1])
    return Runner(layers, page_size=8, num_pages=32, max_requests=4, shuffle_pages=True, **kw)


def chunks(g, **lens):
    return {rid: torch.randn(n, HIDDEN, generator=g) for rid, n in lens.items()}


# a: 22 tokens (its open group holds positions 20, 21 in ring rows 0, 1), then 7 more: the
# step's last C = 4 rows (positions 25..28) go to ring rows 1, 2, 3, 0 and the group of 20..23
# is pooled from ring rows 0, 1. Past the budget (16 tokens), that group's key decides what is
# selected. b decodes beside it.
g = torch.Generator().manual_seed(0)
STEPS = [chunks(g, a=22, b=5), chunks(g, a=7, b=1), chunks(g, a=1, b=1)]


def test_a_layer_failing_mid_step_is_undone_and_a_retry_equals_a_clean_run(backend):
    clean = make_runner()
    want = [clean.step(s) for s in STEPS]

    r = make_runner()
    got = [r.step(STEPS[0])]
    free = r.num_free_pages
    r.layers[1].armed = True  # layer 0 writes a's ring rows 0 and 1, then layer 1 fails
    with pytest.raises(RuntimeError, match="injected layer fault"):
        r.step(STEPS[1])
    assert (r.seq_len("a"), r.seq_len("b"), r.num_free_pages) == (22, 5, free)
    got += [r.step(s) for s in STEPS[1:]]
    for step_want, step_got in zip(want, got):
        for rid in step_want:
            assert torch.equal(step_got[rid], step_want[rid]), rid
    for mine, theirs in zip(r.caches, clean.caches):  # the same pages: the failed step took none
        for name in ("k", "v", "compressed", "ring"):
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name


def plant_shared(r: Runner, what: str) -> None:
    """The next two new requests get one ring row, or one page."""
    if what == "ring":
        r._free_rings[1] = r._free_rings[0]
    else:
        r._free_pages[1] = r._free_pages[0]


SHARED = {
    "ring": (r"ring_index\[1\] = ring_index\[2\] = \d+: requests 1 and 2 both have rows",
             "ring_index entry was another request's with rows too"),
    "page": (r"slot_mapping\[\d+\] = slot_mapping\[\d+\] = \d+: rows \d+ \(request 1\) and \d+ \(request 2\) write "
             r"the same KV slot", r"slot_mapping entry \(>= 0\) of a live row was another live row's too"),
}


def run_planted(what: str, device_guards: bool):
    """A runs a step; then c and d (new, planted onto one ring row or page) join a's decode:
    refused, nothing changes; with the planted ring row / page back apart, the step runs as in
    a clean runner."""
    gen = torch.Generator().manual_seed(1)
    first, second = chunks(gen, a=9), chunks(gen, a=1, c=5, d=6)
    kw = dict(value_checks=False) if device_guards else {}
    clean = make_runner(1, **kw)
    clean.step(first)
    want = clean.step(second)

    r = make_runner(1, **kw)
    r.step(first)
    rings, pages = list(r._free_rings), list(r._free_pages)
    plant_shared(r, what)
    error, message = (RuntimeError, SHARED[what][1]) if device_guards else (ValueError, SHARED[what][0])
    with pytest.raises(error, match=message) as raised:
        r.step(second)
    assert r.request_ids == ["a"] and r.seq_len("a") == 9
    r._free_rings, r._free_pages = rings, pages
    got = r.step(second)
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid
    return str(raised.value)


@pytest.mark.parametrize("what", list(SHARED))
def test_requests_sharing_a_ring_row_or_page_are_refused(what):
    """The Runner's defaults: on CPU tensors the value checks refuse the step before it runs
    (in plan, whatever the backend); on CUDA the guards flag it and the Runner raises."""
    run_planted(what, device_guards=DEVICE.type == "cuda")


@pytest.mark.parametrize("what", list(SHARED))
def test_the_runner_raises_on_a_step_the_device_guards_flagged(backend, what):
    """Without value checks (a GPU's default), the metadata build makes c and d inert and the
    Runner raises after the step, naming them and the reason; a stays as it was."""
    text = run_planted(what, device_guards=True)
    reason = SHARED[what][1]
    assert "request 'c'" in text and "request 'd'" in text and "request 'a'" not in text.split("Flagged:")[1]
    assert text.count(reason.replace("\\", "")) == 3, text  # the step's reason, then c's and d's


@pytest.mark.gpu
@pytest.mark.parametrize("what", list(SHARED))
def test_the_runner_raises_on_a_flagged_step_gpu(what):
    """On CUDA with the Runner's defaults (no value checks on a GPU): the Triton metadata build
    flags the planted requests and the Runner raises naming them."""
    assert DEVICE.type == "cuda", "run with QSA_TEST_DEVICE=cuda (scripts/test_gpu.sh runner)"
    text = run_planted(what, device_guards=True)
    assert "request 'c'" in text and "request 'd'" in text
