"""A QSA layer runs with grad mode on, under torch.no_grad() and under torch.inference_mode(),
with the same result; caches and planners made in one mode serve steps in another."""

import contextlib

import pytest
import torch

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core.standalone import Runner

MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def runner():
    layer = QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)).to(DEVICE)
    return Runner([layer], page_size=8, num_pages=48, max_requests=2)


def second_step(mode):
    """A prefill by the Runner, then the layer called directly on a second step's plan."""
    g = torch.Generator().manual_seed(0)
    r = runner()
    r.step({"a": torch.randn(13, 256, generator=g)})
    x = torch.randn(6, 256, generator=g).to(DEVICE)
    r.step({"a": x})  # plans the step (and runs it once: the direct call below repeats it)
    layer, plan, cache = r.layers[0], r.last_plan, r.caches[0]
    with MODES[mode]():
        out = layer(x, plan, cache)
    return out.detach().cpu(), [t.cpu().clone() for t in (cache.k, cache.v, cache.compressed, cache.ring)]


def test_layer_call_in_every_grad_mode(backend):
    want, want_caches = second_step("no_grad")
    for mode in ("grad", "inference_mode"):
        got, caches = second_step(mode)
        assert torch.equal(got, want), mode
        for a, b in zip(caches, want_caches):
            assert torch.equal(a, b), mode


def test_state_made_in_inference_mode_serves_steps_outside(backend):
    """Caches and the planner's workspace (a Runner regrows its planner the same way) are
    normal tensors even when made inside inference mode, so later steps may write them."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 256, generator=g)
    with torch.inference_mode():
        r = runner()
        r.step({"a": x[:20]})
    assert not any(t.is_inference() for t in (r.caches[0].k, r.caches[0].ring, r.planner.guard))
    r.step({"a": x[20:21]})
    with torch.inference_mode():
        r.step({"b": x[21:30]})
    out = r.step({"b": torch.randn(1, 256, generator=g)})["b"]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_runner_step_under_each_mode(backend, mode):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 256, generator=g)
    with torch.no_grad():
        want = runner().step({"a": x})["a"]
    with MODES[mode]():
        got = runner().step({"a": x})["a"]
    assert torch.equal(got, want)
