"""The core against the HF oracle (`Qwen4ExpTextAttention`, random weights, budget 16, r 4).

Every schedule (one shot, chunks, decode, mixed ragged batches, speculative rollback) must
reproduce the HF output of the whole sequence at each position, with the reference ops and
with the Triton kernels (through the interpreter when there is no GPU).
"""

import pytest
import torch

from hf_oracle import DEVICE, hf_forward, random_hf_attention, tiny_config
from qsa_core import QSAAttention, qsa_prepare, qsa_select
from qsa_core.reference.select import compressed_rows, paged_rows
from qsa_core.standalone import Runner

HIDDEN = 256


@pytest.fixture(autouse=True)
def every_backend(backend):
    """Every test runs with the reference ops and with the Triton kernels."""
# fp32: the same math up to summation order. bf16: HF rounds K/V, probabilities and the
# gate product to bf16 where the core keeps fp32, so allow bf16-sized error.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def depth(dtype):
    """Chains of two layers run in fp32: in bf16, layer 1's rounding (HF rounds logits and
    probabilities to bf16) can flip a near-tie in layer 2's top-k, a legitimate difference."""
    return 2 if dtype == torch.float32 else 1


def make(dtype=torch.float32, layers=1, mrope=None, seed=0, correlation=1.0, **config):
    cfg = tiny_config(mrope_section=mrope, **config)
    hf = [random_hf_attention(cfg, seed + i, dtype, layer_idx=i, correlation=correlation) for i in range(layers)]
    return hf, [QSAAttention.from_hf(h).to(DEVICE) for h in hf]


def runner(layers, **kw):
    args = dict(page_size=8, num_pages=96, max_requests=6, shuffle_pages=True)
    args.update(kw)
    return Runner(layers, **args)


def close(out, ref, dtype):
    out = out.cpu()
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def run_chunks(r, rid, x, bounds, rope=None):
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        rp = None if rope is None else {rid: rope[..., a:b]}
        outs.append(r.step({rid: x[a:b]}, rope_positions=rp)[rid])
    return torch.cat(outs)


def inputs(L, dtype, seed=1):
    """Hidden states with a shared component, as real sequences have: together with the
    correlated indexer weights of `random_hf_attention` it keeps most scores above zero."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, HIDDEN, generator=g) + torch.randn(HIDDEN, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [13, 16, 75])  # below, at and above the budget of 16 tokens
def test_one_shot_prefill(dtype, L):
    hf, layers = make(dtype)
    x = inputs(L, dtype)
    out = runner(layers).step({"a": x})["a"]
    close(out, hf_forward(hf, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_inside_and_on_group_edges(dtype):
    hf, layers = make(dtype, layers=depth(dtype))
    x = inputs(90, dtype)
    # chunk ends inside groups (5, 11, 37), on edges (8, 24, 64), longer than the ring (26)
    out = run_chunks(runner(layers), "a", x, [0, 5, 8, 11, 24, 37, 63, 64, 90])
    close(out, hf_forward(hf, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_by_token_decode(dtype):
    hf, layers = make(dtype)
    x = inputs(48, dtype)
    out = run_chunks(runner(layers), "a", x, [0, 3] + list(range(4, 49)))
    close(out, hf_forward(hf, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_requests_in_mixed_steps_with_shuffled_pages(dtype):
    """Decodes and prefills share steps; requests hold different data at equal positions."""
    hf, layers = make(dtype, layers=depth(dtype))
    lens = {"a": 70, "b": 41, "c": 57, "d": 23}
    xs = {k: inputs(n, dtype, seed=i + 10) for i, (k, n) in enumerate(lens.items())}
    sched = {  # per step: {request: chunk length}
        0: {"a": 30, "b": 17},
        1: {"a": 1, "b": 1, "c": 19},
        2: {"a": 1, "b": 9, "c": 1, "d": 23},
        3: {"a": 20, "b": 1, "c": 37},
        4: {"a": 18, "b": 13},
    }
    r = runner(layers)
    done = {k: 0 for k in lens}
    outs = {k: [] for k in lens}
    for step in sched.values():
        res = r.step({k: xs[k][done[k] : done[k] + n] for k, n in step.items()})
        for k, n in step.items():
            outs[k].append(res[k])
            done[k] += n
    assert done == lens
    for k in lens:
        close(torch.cat(outs[k]), hf_forward(hf, xs[k]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_three_axis_positions(dtype):
    """Groups are keyed by their first token's exact 3-axis position, across chunk edges."""
    hf, layers = make(dtype, mrope=[6, 5, 5])
    L = 60
    t = torch.arange(L)
    pos = torch.stack([t, (t * 7) % 13, (t * 5) % 11 + 3])
    x = inputs(L, dtype)
    out = run_chunks(runner(layers), "a", x, [0, 6, 9, 23, 30] + list(range(31, L + 1)), rope=pos)
    close(out, hf_forward(hf, x, pos), dtype)


# 1-D RoPE positions that are not the logical ones (design.md §6.2): a group key is rotated at
# its first token's RoPE position, which an earlier chunk may hold.
CHUNKS = [0, 5, 8, 11, 24, 37, 63, 64, 90]  # ends inside groups, on edges, longer than the ring


def offset_positions(L):
    return torch.arange(L) + 1000


def compacted_positions(L):
    """Strictly increasing with gaps of 1 to 4, different inside every group."""
    gaps = torch.randint(1, 5, (L,), generator=torch.Generator().manual_seed(7))
    return torch.cumsum(gaps, 0) + 3


ONE_SHOT, DECODE = [0, 90], CHUNKS[:-1] + list(range(65, 91))
# The Triton kernels run in the interpreter in CI: they take the chunked compacted case, the
# one where a group's first RoPE position must come from the ring; the reference takes all.
POSITION_CASES = [
    pytest.param("reference", make, bounds, id=f"reference-{make.__name__}-{name}")
    for make in (offset_positions, compacted_positions)
    for name, bounds in (("one_shot", ONE_SHOT), ("chunked", CHUNKS), ("decode", DECODE))
] + [pytest.param("triton", compacted_positions, CHUNKS, id="triton-compacted_positions-chunked")]


@pytest.mark.parametrize("backend,make_positions,bounds", POSITION_CASES, indirect=["backend"])
def test_one_d_rope_positions_differ_from_logical(make_positions, bounds):
    hf, layers = make()
    x = inputs(90, torch.float32)
    pos = make_positions(90)
    out = run_chunks(runner(layers), "a", x, bounds, rope=pos)
    close(out, hf_forward(hf, x, pos), torch.float32)


@pytest.mark.parametrize("backend", ["reference"], indirect=True)  # the kernel's twin: test_kernel_prepare
def test_cache_without_ring_positions_takes_group_positions_as_contiguous():
    """Engine caches may lack a ring-position buffer: offset (contiguous) positions still match."""
    hf, layers = make()
    x = inputs(90, torch.float32)
    r = runner(layers)
    for cache in r.caches:
        cache.ring_positions = None
    out = run_chunks(r, "a", x, CHUNKS, rope=offset_positions(90))
    close(out, hf_forward(hf, x, offset_positions(90)), torch.float32)


@pytest.mark.parametrize(
    "backend,dtype",
    [("reference", torch.float32), ("reference", torch.bfloat16), ("triton", torch.float32)],
    indirect=["backend"],
)
def test_left_padded_hf_batch(dtype):
    """An HF batch left-pads the shorter sequence and runs positions 0..L-1 over the pad: its
    real tokens sit at RoPE positions pad..L-1 while their logical positions start at 0. One
    layer: HF's fully masked pad rows are NaN and would reach a second layer's values."""
    hf, layers = make(dtype)
    L, pad = 70, 13
    xa, xb = inputs(L - pad, dtype, seed=21), inputs(L, dtype, seed=22)
    batch = torch.stack([torch.cat([torch.zeros(pad, HIDDEN, dtype=dtype), xa]), xb])
    want = hf_forward(hf, batch, left_padding=[pad, 0])
    r = runner(layers)
    rope = {"a": torch.arange(pad, L), "b": torch.arange(L)}
    outs = {"a": [], "b": []}
    for a, b in [(0, 9), (9, 30), (30, 31), (31, 32), (32, L - pad)]:
        step = r.step({"a": xa[a:b], "b": xb[a:b]}, rope_positions={k: v[a:b] for k, v in rope.items()})
        for k in outs:
            outs[k].append(step[k])
    rest = r.step({"b": xb[L - pad :]}, rope_positions={"b": rope["b"][L - pad :]})["b"]
    close(torch.cat(outs["a"]), want[0, pad:], dtype)
    close(torch.cat(outs["b"] + [rest]), want[1], dtype)


def test_speculative_draft_rows_with_offset_positions():
    """Verify steps whose rejected drafts held RoPE positions the accepted tokens reuse."""
    hf, layers = make()
    x = inputs(60, torch.float32, 5)
    junk = inputs(60, torch.float32, 6)
    pos = compacted_positions(60)
    r = runner(layers, num_speculative_tokens=3)
    outs = [r.step({"a": x[:21]}, rope_positions={"a": pos[:21]})["a"]]
    n = 21
    for accepted in [2, 4, 1, 3, 0, 4, 2, 1, 3, 4, 2]:
        rows = torch.cat([x[n : n + accepted], junk[n + accepted : n + 4]])
        draft_pos = torch.cat([pos[n : n + accepted], pos[n + accepted - 1 : n + 3] * 7 + 1])[:4]
        outs.append(r.step({"a": rows}, rope_positions={"a": draft_pos})["a"][:accepted])
        n += accepted
        r.truncate("a", n)
        if n >= 44:
            break
    close(torch.cat(outs), hf_forward(hf, x[:n], pos[:n]), torch.float32)


def test_exact_zero_ties_at_the_boundary_follow_spec_order():
    """Indexer queries anti-correlated with the keys: most scores are exact ReLU zeros and the
    top-k boundary falls inside a zero tie in many rows, so design.md §2.7's tie rule decides the
    selection. The core must match HF with ties broken by 2.7, and must NOT match HF with
    ties broken the other way (which proves the ties reach the output)."""
    hf, layers = make(correlation=-0.1)
    L = 80
    x = inputs(L, torch.float32)
    scores = hf_group_scores(hf[0], x)
    tied = 0
    for t in range(20, L):  # visible > Kb = 4
        top = scores[t, : (t + 1) // 4].sort(descending=True).values
        tied += bool(top[0] > 0 and top[3] == 0 and top[4] == 0)
    assert tied >= 10, f"only {tied} rows with a zero tie at the boundary"
    for bounds in ([0, L], [0, 7, 30, 31, 45] + list(range(46, L + 1))):
        out = run_chunks(runner(layers), "a", x, bounds).cpu()
        close(out, hf_forward(hf, x), torch.float32)
        wrong = hf_forward(hf, x, tie_order="reversed")
        assert (out - wrong).abs().max() > 0.1 * wrong.abs().max()


def test_freed_request_pages_and_ring_are_reused():
    hf, layers = make()
    r = runner(layers, num_pages=8, max_requests=1)  # room for exactly one 64-token request
    xa, xb = inputs(62, torch.float32, 3), inputs(64, torch.float32, 4)
    run_chunks(r, "a", xa, [0, 30, 61, 62])
    with pytest.raises(RuntimeError, match="ring row"):
        r.step({"b": xb[:4]})
    r.free("a")
    out = run_chunks(r, "b", xb, [0, 31, 45] + list(range(46, 65)))
    close(out, hf_forward(hf, xb), torch.float32)


def test_speculative_rows_rolled_back_never_corrupt_the_ring():
    """Verify steps of 1 + 3 rows; rejected drafts are overwritten by the accepted tokens."""
    hf, layers = make()
    x = inputs(60, torch.float32, 5)
    junk = inputs(60, torch.float32, 6)
    r = runner(layers, num_speculative_tokens=3)
    outs = [r.step({"a": x[:21]})["a"]]
    n = 21
    for accepted in [2, 4, 1, 3, 0, 4, 2, 1, 3, 4, 2]:
        # rows n .. n+accepted-1 are the real tokens, the rest are drafts to be rejected
        rows = torch.cat([x[n : n + accepted], junk[n + accepted : n + 4]])
        outs.append(r.step({"a": rows})["a"][:accepted])
        n += accepted
        r.truncate("a", n)
        if n >= 44:
            break
    out = torch.cat(outs)
    close(out, hf_forward(hf, x[:n]), torch.float32)


def stored(x: torch.Tensor, dtype: torch.dtype, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the core keeps it in `dtype` (as fp32; e4m3: rounded, no scale: design.md §2.2 / §2.4), and
    per element a bound on how far the kept value of any x' within eps of x is from it: the
    gap between the roundings of x - eps and x + eps (2 eps in fp32; in e4m3 0 unless a
    rounding midpoint lies within eps of x)."""
    lo, hi = ((x + sign * eps).to(dtype).float() for sign in (-1, 1))
    return x.to(dtype).float(), hi - lo


def spec_top(scores: torch.Tensor, k: int) -> list[int]:
    """The k groups design.md §2.7 chooses from a row of scores (ties to the lower index), ascending."""
    return sorted(torch.sort(scores, descending=True, stable=True).indices[:k].tolist())


@pytest.mark.parametrize("index_dtype", ["auto", "fp8_e4m3"])
def test_selection_is_the_hf_top_k_of_the_stored_index_values(index_dtype):
    """design.md §2.2 / §2.4 / §6.8: the core keeps HF's indexer queries (prepare's q_idx) and group
    keys (the compressed cache) in the index dtype (fp8 e4m3: rounded, no scale) and chooses
    the top Kb groups by their scores. Oracle: HF's own q and keys kept the same way, scored in
    fp32, top-k in design.md §2.7 order. Every row's chosen set must equal the oracle's exactly; with
    fp8 keys the rounding decides some rows (the oracle's fp32 sets differ there)."""
    hf, [_] = make()
    L, Hi, Di, Kb, r = 80, 4, 128, 4, 4
    x = inputs(L, torch.float32)
    dtype = torch.float8_e4m3fn if index_dtype == "fp8_e4m3" else torch.float32
    q, keys = hf_indexer(hf[0], x)
    # The one tolerance left, `err` [L, L / r], bounds |core score - oracle score| and only
    # serves to prove that no row's top-k boundary lies within it. The core's fp32 q and keys
    # equal HF's up to op order (measured: bit-equal with the reference ops, within 2 fp32 ulps
    # of the largest element with the Triton kernels in the interpreter); eps = 2^-20 of the
    # largest, ~10 such ulps, bounds that. So each stored element is off by at most `stored`'s
    # bound (in e4m3: nonzero only next to a rounding midpoint) and a score (ReLU is
    # 1-Lipschitz, per head) by that times the other side. Both sides then sum Hi * Di exact
    # fp32 products of stored values in other orders: each within (Di + Hi) 2^-24 of the sum
    # of the |products|.
    (q_s, q_off), (k_s, k_off) = (stored(t, dtype, 2**-20 * t.abs().max()) for t in (q, keys))

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("thd,gd->tg", a, b) / Di**0.5

    err = (dot(q_off, k_s.abs() + k_off) + dot(q_s.abs(), k_off)
           + 2 * (Di + Hi) * 2**-24 * dot(q_s.abs(), k_s.abs()))
    oracle, unrounded = group_scores(q_s, k_s), group_scores(q, keys)

    layer = QSAAttention.from_hf(hf[0], index_dtype=index_dtype).to(DEVICE)
    run = runner([layer])
    run.step({"a": x})  # fills the caches; the indexer half re-runs on its plan below
    plan, cache, h = run.last_plan, run.caches[0], x.to(DEVICE)
    with torch.no_grad():
        q_idx = qsa_prepare(plan, layer.norm_weights(), layer.indexer.index_qk_proj(h), layer.q_proj(h),
                            layer.k_proj(h), layer.v_proj(h), cache)[0]
        sel = qsa_select(plan, q_idx, cache).cpu()
    core_keys = paged_rows(cache.compressed, compressed_rows(plan.meta.block_table, 0, L // r, run.page_size, r))
    # The bound's premise: the core kept HF's values in the index dtype, within `stored`'s bound.
    assert ((q_idx.cpu().float() - q_s).abs() <= q_off).all()
    assert ((core_keys.cpu().float() - k_s).abs() <= k_off).all()
    rounding_decides = 0
    for t in range(L):
        vis = (t + 1) // r
        top = spec_top(oracle[t, :vis], Kb)
        rest = [g for g in range(vis) if g not in top]
        if rest:  # these inputs keep every row's top-k boundary wider than the error bound
            assert (oracle[t, top] - err[t, top]).min() > (oracle[t, rest] + err[t, rest]).max(), t
        toks = sel[t, : sel[t, -1]]
        assert torch.unique(toks[toks < vis * r] // r).tolist() == top, t
        rounding_decides += top != spec_top(unrounded[t, :vis], Kb)
    if index_dtype == "fp8_e4m3":  # 5 rows: an fp8 core that scored unrounded values would fail
        assert rounding_decides > 0


def hf_indexer(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's indexer queries [L, Hi, Di] and group keys [L / r, Di] (fp32), from the HF module's
    own norms and rotary."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    idx = attn.indexer
    L = x.shape[0]
    cos, sin = Qwen4ExpTextRotaryEmbedding(attn.config)(x[None], torch.arange(L)[None])
    with torch.no_grad():
        q, k = idx.index_qk_proj(x[None]).split([4 * 128, 128], -1)
        q = apply_rotary_pos_emb(idx.q_layernorm(q.view(1, L, 4, 128)), cos=cos, sin=sin, unsqueeze_dim=2)[0]
        pooled = idx.k_layernorm(k[0].view(L // 4, 4, 128).mean(1))
        starts = torch.arange(0, L, 4)
        kc = apply_rotary_pos_emb(pooled[:, None], cos=cos[0, starts], sin=sin[0, starts])[:, 0]
    return q, kc


def group_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[L, G] design.md §2.6 scores of queries [L, Hi, Di] against keys [G, Di], in fp32."""
    return torch.einsum("thd,gd->tgh", q.float(), keys.float()).relu().sum(-1) / q.shape[-1] ** 0.5


def hf_group_scores(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[L, L / r] indexer scores from the HF module's own norms and rotary (fp32)."""
    return group_scores(*hf_indexer(attn, x))
