"""The benchmark's own logic on the CPU: the byte/FLOP model against the issue's figures,
target verdicts, the writers, one configuration of the dry run end to end, the other commands
of its CLI, and the run of record behind the docs' tables."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_report as rep  # noqa: E402
from bench_report import Case, Geometry, Result  # noqa: E402

G = Geometry()
M = 1 << 20


def decode_model(ctx: int, batch: int, index_dtype: str = "bf16") -> dict:
    """One row per request selecting the full budget (W distinct tokens)."""
    case = Case("decode", ctx, batch, 1, index_dtype)
    return rep.traffic(case, G, kv_tokens=batch * G.selection_width, scored_groups=batch * ctx // 4,
                       selected_tokens=batch * G.selection_width)


def test_decode_bytes_match_the_issue_floors():
    # issue 12: decode 128K batch 4 reads about 50 MB (about 12 us); 1M batch 4 about 285 MB
    # (66 us with bf16 index keys, about 33 us with fp8)
    m128 = decode_model(131072, 4)
    assert 48e6 < m128["bytes"] < 53e6
    assert 11 < rep.floor_us(m128["bytes"], m128["flops"]) < 12.5
    m1 = decode_model(M, 4)
    assert 280e6 < m1["bytes"] < 290e6 and 64 < rep.floor_us(m1["bytes"], m1["flops"]) < 68
    fp8 = decode_model(M, 4, "fp8_e4m3")
    assert 32 < rep.floor_us(fp8["bytes"], fp8["flops"]) < 36


def test_prefill_flops_match_the_issue_floor():
    # issue 12: a 16K chunk at 128K is about 1.4-1.7 ms of tensor-core work
    case = Case("prefill", 131072, 1, 16384)
    scored = sum((case.context - case.rows + 1 + j) // 4 for j in range(case.rows))
    m = rep.traffic(case, G, kv_tokens=case.context, scored_groups=scored, selected_tokens=case.rows * G.selection_width)
    assert 1300 < m["flops"] / rep.PEAK_FLOPS * 1e6 < 1800
    assert m["dense_flops"] > 10 * m["flops"]


def test_targets_are_held_only_when_the_whole_step_meets_them():
    r = Result(Case("decode", 131072, 4, 1), us={rep.WHOLE: 19.0})
    assert rep.held(r) == ("<= 20", "yes")
    r.us[rep.WHOLE] = 21.0
    assert rep.held(r) == ("<= 20", "no")
    d = Result(Case("decode", 8192, 1, 1), us={rep.WHOLE: 30.0})
    assert rep.held(d) == ("<= dense", "?")  # no dense figure: no verdict
    d.us[rep.DENSE] = 13.0
    assert rep.held(d) == ("<= dense", "no")
    assert rep.held(Result(Case("decode", 32768, 4, 1))) == ("", "")  # not an issue row


def test_results_round_trip_and_render_into_the_marked_sections(tmp_path):
    r = Result(Case("decode", 131072, 4, 1, "fp8_e4m3"), us={"prepare": 5.0, "select+expand": 10.0, "attention": 8.0,
                                                             rep.WHOLE: 21.0, rep.WHOLE_CLEAN: 17.5, rep.DENSE: 250.0,
                                                             rep.SGL_ALL: 150.0},
               model=decode_model(131072, 4, "fp8_e4m3"), check="ok", agreement={"rows": 4, "gapped": 3, "agree": 3})
    rep.save(tmp_path / "results.json", {"device": "H200"}, [r])
    assert json.loads((tmp_path / "results.json").read_text())["schema"] == rep.SCHEMA
    meta, back = rep.load(tmp_path / "results.json")
    assert back == [r] and meta == {"device": "H200"}
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{rep.MARK_START}\nold\n{rep.MARK_END}\nafter\n")
    rep.render(tmp_path, back, meta, markdown=doc, with_plot=False)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{rep.MARK_END}\nafter\n") and "old" not in text
    row = next(line for line in text.splitlines() if line.startswith("| decode 128K, B4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "fp8_e4m3" and cells[5:8] == ["23.0", "21.0", "17.5"]  # sum of ops, whole step, clean L2
    assert cells[14:16] == ["<= 20", "no"] and cells[-1] == "3/3"
    assert "- decode 128K, B4 (fp8_e4m3): whole step 21.0 us, target <= 20 (dense 250.0 us): not held" in text
    assert "the largest part is select+expand: 10.0 of 23.0 us" in text
    gbs = float(cells[17].split()[0])
    assert gbs == pytest.approx(r.model["bytes"] / 21e-6 / 1e9, rel=1e-2)
    with pytest.raises(ValueError, match="markers"):
        rep.replace_section(tmp_path / "table.md", "x")  # table.md has no markers


def test_dry_run_checks_and_writes_one_configuration(tmp_path):
    import bench_qsa

    key = Case("decode", 4096, 1, 1).key
    bench_qsa.main(["--dry-run", "--no-plot", "--out", str(tmp_path), "--only", key])
    _, results = rep.load(tmp_path / "results.json")
    (r,) = results
    assert r.case.key == key and r.check.startswith("ok")
    assert {"prepare", "select+expand", "attention", rep.NO_PREP, rep.WHOLE, rep.WHOLE_WARM, rep.WHOLE_CLEAN} <= set(r.us)
    # the model's inputs come from the step's own selection: one row at position 4095 sees 1024
    # complete groups and no open tail, so it selects exactly the budget
    assert r.model["selected_tokens"] == r.model["kv_tokens"] == G.token_topk
    assert r.model["scored_groups"] == 4096 // 4
    assert "| decode 4K, B1 |" in (tmp_path / "table.md").read_text()


def test_neighbour_overlap_samples_pairs_across_the_chunk():
    """Rows 0-99 choose the same 4 of 8 groups, rows 100-999 alternate between it and a disjoint
    set (row 100 takes the first): pairs spread over the chunk see both parts (~0.1), not the
    first rows' 1.0; rows that take every group they see count for nothing."""
    from bench_qsa import neighbour_overlap

    T, W = 1000, 16
    sets = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    which = torch.where(torch.arange(T) < 100, 0, torch.arange(T) % 2)
    groups = sets[which]
    sel = torch.cat([(groups[:, :, None] * 4 + torch.arange(4)).flatten(1), torch.full((T, 1), W)], 1).int()
    visible = torch.full((T,), 8, dtype=torch.int32)
    assert neighbour_overlap(sel, visible, max_pairs=T) == pytest.approx(100 / 999, abs=1e-6)
    assert neighbour_overlap(sel, visible, max_pairs=50) == pytest.approx(0.1, abs=0.05)
    everything = torch.cat([torch.arange(16).expand(T, 16), torch.full((T, 1), W)], 1).int()
    assert math.isnan(neighbour_overlap(everything, torch.full((T,), 4, dtype=torch.int32)))


def test_overlap_data_and_its_period_belong_to_the_run(tmp_path, capsys):
    """`--prefill-data overlap --overlap-period L` is recorded with the results, and a rerun on
    other data starts over instead of resuming them."""
    import bench_qsa

    key = Case("prefill", 4096, 1, 8).key
    args = ["--dry-run", "--no-plot", "--out", str(tmp_path), "--only", key, "--prefill-data", "overlap"]
    bench_qsa.main(args + ["--overlap-period", "32"])
    meta, (r,) = rep.load(tmp_path / "results.json")
    assert meta["prefill_data"] == "overlap period 32" and r.check.startswith("ok")
    bench_qsa.main(args + ["--overlap-period", "32"])
    assert "starting over" not in capsys.readouterr().out
    bench_qsa.main(args + ["--overlap-period", "8"])
    assert "starting over" in capsys.readouterr().out
    assert rep.load(tmp_path / "results.json")[0]["prefill_data"] == "overlap period 8"


def sample_bound_candidates(step) -> tuple[torch.Tensor, int]:
    """Each row's sample-bound candidate count over its reference scores, with the tiles the kernel
    takes for the step's context (as select_overflow.main): (int64 [rows], cap)."""
    import select_overflow
    from qsa_core.planner import column_bucket
    from qsa_kernels import select, select_prefill

    Kb, n_cols = step.cfg.block_topk, column_bucket(step.context // G.compress_ratio)
    block_g = select.score_block_g(n_cols)
    tiles = select_prefill.prefill_tiles(n_cols, Kb, block_g, small=False)
    assert select_prefill.prefill_route(n_cols, Kb, tiles, block_g)  # the sample-bounded route
    S = select_prefill.sample_cols(tiles, block_g)
    rows = range(step.batch * step.rows)
    return torch.tensor([select_overflow.candidates(step.ref_scores(t), int(step.meta.visible_blocks[t]), S, Kb,
                                                    tiles.lbits) for t in rows]), tiles.cap


def test_recency_data_overflows_the_sample_bound_where_random_data_does_not():
    """`--prefill-data recency` at 16K (the kernel's sample-bounded route, S = 4): every row has more
    candidates than the cap (1024), as the served checkpoint's rows (select_overflow: median 1376,
    32/32 over), while random data stays below it (about 650)."""
    import bench_qsa

    case = Case("prefill", 16384, 1, 8)
    random, cap = sample_bound_candidates(bench_qsa.Step(case, torch.device("cpu")))
    recency, _ = sample_bound_candidates(bench_qsa.Step(case, torch.device("cpu"), prefill_data="recency"))
    assert int(random.max()) < cap < int(recency.min())
    assert float(recency.float().median()) > 1.2 * cap


def test_recency_data_runs_end_to_end_and_belongs_to_the_run(tmp_path, capsys):
    """The dry run checks one configuration on `--prefill-data recency` (decode too) and records
    it; a rerun on random data starts over instead of resuming it."""
    import bench_qsa

    key = Case("decode", 4096, 1, 1).key
    args = ["--dry-run", "--no-plot", "--out", str(tmp_path), "--only", key]
    bench_qsa.main(args + ["--prefill-data", "recency"])
    meta, (r,) = rep.load(tmp_path / "results.json")
    assert meta["prefill_data"] == "recency" and r.check.startswith("ok") and rep.WHOLE in r.us
    bench_qsa.main(args)
    assert "starting over" in capsys.readouterr().out
    assert rep.load(tmp_path / "results.json")[0]["prefill_data"] == "random"


def test_results_timed_another_way_are_not_resumed(tmp_path, capsys):
    """A results.json whose timing method differs (another L2 flush, `--flush`) starts over
    instead of mixing figures of two methods in one table; an unknown flush is refused."""
    import bench_qsa

    key = Case("decode", 4096, 1, 1).key
    args = ["--dry-run", "--no-plot", "--out", str(tmp_path), "--only", key]
    bench_qsa.main(args)
    bench_qsa.main(args)
    assert "starting over" not in capsys.readouterr().out
    meta, results = rep.load(tmp_path / "results.json")
    read = "CUDA-graph replays, L2 flushed before each replay (by a 256 MB read)"
    rep.save(tmp_path / "results.json", dict(meta, method=read), results)
    bench_qsa.main(args)
    assert "starting over" in capsys.readouterr().out
    assert rep.load(tmp_path / "results.json")[0]["method"] != read
    with pytest.raises(ValueError, match=r"flush must be one of \('write', 'read'\), got 'dirty'"):
        bench_qsa.GraphTimer(flush="dirty")


def test_the_run_of_record_renders_the_docs_tables(tmp_path):
    """benchmarks/results/ is the run of record: `bench_qsa.py report` renders from its results.json
    exactly the table it holds and the table sections that BENCHMARKS.md and README.md carry."""
    import bench_qsa

    record = tmp_path / "record"
    record.mkdir()
    shutil.copy(ROOT / "benchmarks" / "results" / "results.json", record)
    docs = {name: tmp_path / name for name in ("BENCHMARKS.md", "README.md")}
    for name, path in docs.items():
        path.write_text(f"before\n{rep.MARK_START}\nstale\n{rep.MARK_END}\nafter\n")
    bench_qsa.main(["report", str(record), "--markdown", str(docs["BENCHMARKS.md"]),
                    "--readme", str(docs["README.md"]), "--no-plot"])
    assert (record / "table.md").read_text() == (ROOT / "benchmarks" / "results" / "table.md").read_text()
    for name, path in docs.items():
        section = path.read_text().split(rep.MARK_START)[1].split(rep.MARK_END)[0]
        assert "stale" not in section and section in (ROOT / name).read_text(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["host", "launch", "tp", "serving", "peers"])
def test_the_gpu_commands_refuse_clearly_without_cuda(command, tmp_path, capsys):
    import bench_qsa

    with pytest.raises(SystemExit) as exit_:
        bench_qsa.main([command, "--out", str(tmp_path / "r")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"python benchmarks/bench_qsa.py {command}" in err and "needs a CUDA GPU" in err
    assert not (tmp_path / "r").exists()


# -- `bench_qsa.py peers`: a peer column is held to the reference before it is timed --------------

def test_valid_topk_accepts_any_tie_order_and_names_what_is_wrong():
    from bench_peers import valid_topk

    s = torch.tensor([0.5, 3.0, 1.0, 1.0, 2.0, 0.0])
    assert valid_topk(s, torch.tensor([1, 4, 2]), 3) == ""
    assert valid_topk(s, torch.tensor([3, 1, 4]), 3) == ""  # the other member of the tie at the boundary
    assert valid_topk(s, torch.tensor([1, 4, 2]) , 3, rtol=0.0) == ""
    assert valid_topk(s, torch.tensor([1, 4, 0]), 3) == "chose a group scoring 0.5 over one scoring 1"
    assert valid_topk(s, torch.tensor([1, 4]), 3) == "2 groups chosen, expected 3 (visible 6)"
    assert valid_topk(s, torch.tensor([1, 4, 6]), 3) == "group 6 outside 0..5"
    assert valid_topk(s, torch.tensor([1, 1, 4]), 3) == "a group chosen twice"
    assert valid_topk(s[:2], torch.tensor([0, 1]), 3) == ""  # fewer visible than k: every group
    assert valid_topk(s[:2], torch.tensor([1]), 3) == "1 groups chosen, expected 2 (visible 2)"
    # a near tie within rtol of the boundary score passes; beyond it fails
    near = torch.tensor([1.0, 1.0 - 5e-5, 3.0])
    assert valid_topk(near, torch.tensor([2, 1]), 2) == ""
    assert valid_topk(near, torch.tensor([2, 1]), 2, rtol=1e-5) != ""


class FakePeer:
    """A peer that returns our reference selection and the reference attention, ungated
    (optionally with one row's group swapped, or its output scaled)."""

    def __init__(self, step, swap_row: int | None = None, scale: float = 1.0):
        from qsa_core.reference import qsa_sparse_attention as ref_attention

        self.step, W = step, step.cfg.selection_width
        packed = step.select().clone()
        if swap_row is not None:  # replace its best group by the best unchosen one (a lower score)
            vis = int(step.meta.visible_blocks[swap_row])
            scores = step.ref_scores(swap_row)
            chosen = torch.zeros(vis, dtype=torch.bool)
            toks = packed[swap_row, : int(packed[swap_row, -1])].long()
            chosen[toks[toks < vis * 4] // 4] = True
            best = int(torch.where(chosen, scores, -torch.inf).argmax())
            other = int(torch.where(chosen, -torch.inf, scores).argmax())
            row = packed[swap_row, :W]
            row[(row >= 4 * best) & (row < 4 * best + 4)] += 4 * (other - best)
        self.selection = packed[:, :W]
        m = step.meta
        T = self.selection.shape[0]
        ungated = torch.full_like(step.gate, 100.0)  # sigmoid(100) == 1 in fp32
        self.out = ref_attention(step.q, ungated, step.cache.k, step.cache.v, m.block_table, m.token_to_req[:T],
                                 m.seq_lens, packed, softmax_scale=step.cfg.softmax_scale) * scale

    def indexer(self):
        return self.selection

    def packed(self):
        return torch.cat([self.selection, (self.selection >= 0).sum(1, dtype=torch.int32)[:, None]], 1)

    def attention(self):
        return self.out


def test_a_peer_is_checked_against_the_reference_before_it_is_timed():
    import bench_peers
    import bench_qsa

    step = bench_qsa.Step(Case("prefill", 4096, 1, 8), torch.device("cpu"))
    step.select()
    text, counts = bench_peers.check_peer(step, FakePeer(step))
    assert counts == {"rows": 8, "valid": 8, "equal": 8, "all_rows": 8, "all_equal": 8}
    assert text.startswith("selection a top-k of the reference in 8/8 rows (8 equal to ours; all rows 8/8)")
    assert float(text.rsplit("attention err ", 1)[1]) < 1e-2
    with pytest.raises(bench_peers.PeerMismatch, match=r"^row 7: not a top-k of the reference scores: chose a group"):
        bench_peers.check_peer(step, FakePeer(step, swap_row=7))
    with pytest.raises(bench_peers.PeerMismatch, match=r"attention on its own selection differs from the reference"):
        bench_peers.check_peer(step, FakePeer(step, scale=1.1))


def test_peers_records_a_peer_that_cannot_run_and_writes_its_table(tmp_path):
    """Without SGLang installed (the core environment) the peer column records why and ours
    are still measured, checked and written (peers.json, peers.md)."""
    import bench_qsa

    key = Case("decode", 4096, 2, 1).key
    bench_qsa.main(["peers", "--sglang-cuda", "--dry-run", "--out", str(tmp_path), "--only", key])
    meta, (r,) = rep.load(tmp_path / "peers.json")
    assert r.case.key == key and r.check.startswith("ok") and r.done
    assert {"select+expand", "attention", rep.NO_PREP, rep.WHOLE} <= set(r.us)
    assert [n for n in r.notes if n.startswith("sglang-cuda: ModuleNotFoundError: No module named 'sglang")]
    table = (tmp_path / "peers.md").read_text()
    assert "| decode 4K, B2 | bf16 |" in table and "sglang-cuda: ModuleNotFoundError" in table


@pytest.mark.parametrize("swap_row", [None, 3])
def test_a_peer_that_disagrees_is_recorded_and_never_timed(monkeypatch, swap_row):
    import types

    import bench_peers
    import bench_qsa
    import bench_sglang_cuda

    def fake(mods, step, **kw):
        peer = FakePeer(step, swap_row=swap_row)
        peer.routes = {"top-k": "fake"}
        return peer

    monkeypatch.setattr(bench_sglang_cuda, "SGLangCudaPath", fake)
    mods = types.SimpleNamespace(missing={"fast_topk_v2": "not applicable"}, topk_v2=None)
    r = Result(Case("prefill", 4096, 1, 8))
    bench_peers.measure(r.case, torch.device("cpu"), bench_qsa.WallTimer(), mods, "", r, lambda: None)
    assert r.check.startswith("ok") and rep.WHOLE in r.us  # ours, measured first
    assert "sglang-cuda routes: top-k: fake" in r.notes and "sglang-cuda import fast_topk_v2: not applicable" in r.notes
    peer_cols = {c for c in r.us if c.startswith("sglang-cuda")}
    if swap_row is None:
        assert peer_cols == {bench_peers.SG_INDEXER, bench_peers.SG_ATTN} and "sglang-cuda: selection a top-k" in r.check
    else:
        assert not peer_cols and "sglang-cuda" not in r.check
        assert [n for n in r.notes if n.startswith("sglang-cuda: PeerMismatch: row 3: not a top-k of the reference")]


def test_single_stage_prefill_rebuilds_sglangs_tilelang_prefill_kernels_once():
    import types

    from bench_sglang_cuda import PREFILL_KERNELS, single_stage_prefill

    calls = []
    mqa = types.SimpleNamespace(HAS_TILELANG=True, **{n: (lambda n: lambda **kw: calls.append((n, kw)))(n)
                                                      for n in PREFILL_KERNELS})
    mods = types.SimpleNamespace(mqa=mqa)
    assert single_stage_prefill(mods) and not single_stage_prefill(mods)
    for n in PREFILL_KERNELS:
        getattr(mqa, n)(heads=4)
    assert calls == [(n, {"heads": 4, "num_stages": 1}) for n in PREFILL_KERNELS]
    assert not single_stage_prefill(types.SimpleNamespace(mqa=types.SimpleNamespace(HAS_TILELANG=False)))


# -- `bench_qsa.py peers --vllm`: vLLM 0.33's upstream ops on our caches, FA3 dense ----------------

@pytest.mark.parametrize("case", [Case("decode", 4096, 2, 3), Case("prefill", 4096, 1, 8)], ids=["decode-mtp", "prefill"])
def test_vllm_inputs_are_our_caches_in_upstreams_layout(case):
    """Upstream's scoring addresses compressed group c of request b at k_cache[page_table[b, c //
    (page / r)], c % (page / r), 0] and scores sum_h relu(q . k) (no 1/sqrt(Di): the same order);
    its decode rows are request-major. Emulated here in torch on VLLMStepInputs, it must give the
    reference scores, over exactly the groups the reference says each row sees."""
    import bench_qsa
    from bench_vllm import VLLMStepInputs

    step = bench_qsa.Step(case, torch.device("cpu"))
    inp = VLLMStepInputs(step, ratio=G.compress_ratio, token_topk=G.token_topk)
    T = case.batch * case.rows
    per_page = G.page_size // G.compress_ratio
    assert inp.k_cache.shape == (step.cache.compressed.shape[0], per_page, 1, G.index_head_dim)
    assert inp.k_cache.data_ptr() == step.cache.compressed.data_ptr()  # the same bytes, no copy
    assert torch.equal(inp.visible, step.meta.visible_blocks[:T])
    assert torch.equal(inp.token_to_req, torch.arange(case.batch, dtype=torch.int32).repeat_interleave(case.rows))
    assert inp.query_start_loc.tolist() == list(range(0, T + 1, case.rows))
    assert inp.positions.tolist() == [case.context - case.rows + j for _ in range(case.batch) for j in range(case.rows)]
    assert inp.block_indices.shape == (T, G.token_topk // G.compress_ratio)
    assert inp.packed_out.shape == (T, step.cfg.packed_width) and inp.out.shape == inp.q.shape == inp.gate.shape
    for r in range(T):
        req, vis = int(inp.token_to_req[r]), int(inp.visible[r])
        c = torch.arange(vis)
        keys = inp.k_cache[inp.page_table[req, c // per_page].long(), c % per_page, 0].float()
        upstream = (inp.q_idx[r].float() @ keys.T).relu().sum(0)
        torch.testing.assert_close(upstream / math.sqrt(G.index_head_dim), step.ref_scores(r), rtol=1e-5, atol=1e-6)


def _varlen_paged_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                            block_table, out, fa_version):
    """FlashAttention's documented varlen paged contract in plain torch (causal aligned
    bottom-right), to hold fa3_dense's arguments to the dense reference on the CPU."""
    assert causal and fa_version == 3 and q.dtype == k.dtype == torch.bfloat16
    Hkv, D = k.shape[-2:]
    for b in range(cu_seqlens_q.numel() - 1):
        a, e, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert e - a <= max_seqlen_q and L <= max_seqlen_k
        kb = k[block_table[b].long()].reshape(-1, Hkv, D)[:L].float()
        vb = v[block_table[b].long()].reshape(-1, Hkv, D)[:L].float()
        s = torch.einsum("qhgd,lhd->qhgl", q[a:e].float().view(e - a, Hkv, -1, D), kb) * softmax_scale
        visible = torch.arange(L)[None, :] <= (L - (e - a) + torch.arange(e - a))[:, None]
        s = s.masked_fill(~visible[:, None, None, :], -torch.inf)
        out[a:e] = torch.einsum("qhgl,lhd->qhgd", s.softmax(-1), vb).reshape(e - a, -1, D).to(out.dtype)
    return out


@pytest.mark.parametrize("case", [Case("decode", 1024, 2, 2), Case("prefill", 1024, 1, 8)], ids=["decode-mtp", "prefill"])
def test_dense_reference_and_fa3_arguments_against_the_sparse_reference(case):
    """Below the budget the selection holds every token, so the sparse reference (ungated) is
    dense attention: dense_reference must match it, and fa3_dense's varlen arguments, run through
    FlashAttention's documented contract in torch, must pass check_dense."""
    import types

    import bench_peers
    import bench_qsa
    from bench_vllm import dense_reference, fa3_dense

    from qsa_core.reference import qsa_sparse_attention as ref_attention

    step = bench_qsa.Step(case, torch.device("cpu"))
    packed, m = step.select(), step.meta
    T = case.batch * case.rows
    assert (packed[:, -1] == m.positions[:T].int() + 1).all()  # every token of each row's prefix chosen
    rows = list(range(T))
    ungated = ref_attention(step.q, torch.full_like(step.gate, 100.0), step.cache.k, step.cache.v, m.block_table,
                            m.token_to_req[:T], m.seq_lens, packed, softmax_scale=step.cfg.softmax_scale)
    assert bench_qsa.attention_error(ungated, dense_reference(step, rows)) < 1e-2  # bf16 rounding of the reference
    mods = types.SimpleNamespace(fa3=_varlen_paged_attention, missing={})
    assert bench_peers.check_dense(step, fa3_dense(mods, step)(), rows) < 1e-2
    with pytest.raises(bench_peers.PeerMismatch, match="dense attention differs from the reference"):
        bench_peers.check_dense(step, fa3_dense(mods, step)() * 1.1, rows)
    with pytest.raises(RuntimeError, match="FA3 cannot run here: FA3 is only supported on devices with compute"):
        fa3_dense(types.SimpleNamespace(fa3=None, missing={"fa3": "FA3 is only supported on devices with compute "
                                                                  "capability 9.x"}), step)


class FakeVLLMPath(FakePeer):
    """A vLLM-like peer: fused gate (attention gated by ours), block indices from select()."""

    gated = True

    def __init__(self, step, swap_row=None, fuse_gate=True):
        super().__init__(step, swap_row=swap_row)
        if fuse_gate:
            self.out = (self.out.float().view(step.gate.shape) * torch.sigmoid(step.gate.float())).to(self.out.dtype)
        self.routes = {"top-k": "fake"}

    def select(self):
        return self.selection

    def expand(self):
        return self.packed()

    def full(self):
        return self.attention()


@pytest.mark.parametrize("variant", ["agrees", "swapped", "ungated"])
def test_a_vllm_peer_is_checked_gated_before_it_is_timed_and_dense_columns_record_why_not(monkeypatch, variant):
    import types

    import bench_peers
    import bench_qsa
    import bench_vllm

    monkeypatch.setattr(bench_vllm, "VLLMPath", lambda mods, step, **kw: FakeVLLMPath(
        step, swap_row=3 if variant == "swapped" else None, fuse_gate=variant != "ungated"))
    mods = types.SimpleNamespace(fa3=None, missing={"fa3": "FA3 is unavailable due to: no GPU"},
                                 prepare=types.SimpleNamespace(qsa_prepare=_upstream_prepare))
    r = Result(Case("prefill", 4096, 1, 8))
    bench_peers.measure(r.case, torch.device("cpu"), bench_qsa.WallTimer(), None, "", r, lambda: None, vllm=mods)
    assert r.check.startswith("ok") and rep.WHOLE in r.us  # ours, measured first
    assert "vllm routes: top-k: fake" in r.notes and "vllm import fa3: FA3 is unavailable due to: no GPU" in r.notes
    assert "FA3 dense: RuntimeError: FA3 cannot run here: FA3 is unavailable due to: no GPU" in r.notes
    assert bench_peers.FA3 not in r.us
    vl = {c for c in r.us if c.startswith("vllm")}
    if variant == "agrees":
        assert vl == {bench_peers.VL_PREP, bench_peers.VL_SELECT, bench_peers.VL_EXPAND, bench_peers.VL_INDEXER,
                      bench_peers.VL_ATTN, bench_peers.VL_ALL, bench_peers.VL_WHOLE}
        assert "vllm: selection a top-k of the reference in 8/8 rows (8 equal to ours" in r.check
        assert "vllm prepare err q_idx" in r.check
    else:
        want = "row 3: not a top-k" if variant == "swapped" else "attention on its own selection differs"
        assert not vl and "vllm:" not in r.check
        assert [n for n in r.notes if n.startswith(f"vllm: PeerMismatch: {want}")]
    table = bench_peers.table([r])
    assert ("| vllm score+top-k |" in table) == (variant == "agrees") and "FA3 dense" in table
    assert ("| vllm whole step / ours whole step |" in table) == (variant == "agrees")


def test_peers_vllm_records_that_vllm_cannot_run_here(tmp_path):
    """In the core environment (no vllm) the vLLM column records the import error; ours run."""
    import bench_qsa

    key = Case("decode", 4096, 2, 1).key
    bench_qsa.main(["peers", "--vllm", "--dry-run", "--out", str(tmp_path), "--only", key])
    meta, (r,) = rep.load(tmp_path / "peers.json")
    assert r.check.startswith("ok") and rep.WHOLE in r.us
    assert [n for n in r.notes if n.startswith("vllm: ModuleNotFoundError: No module named 'vllm")]
    assert not [n for n in r.notes if n.startswith("sglang")]  # not asked for
    assert "vllm: ModuleNotFoundError" in (tmp_path / "peers.md").read_text()


def _upstream_prepare(q, k, positions, cos_sin, q_norm_weight, k_norm_weight, eps, q_out, state_cache, state_slots,
                      state_block_table, query_start_loc, logical_positions, compressed_cache, compressed_slots,
                      k_work_metadata, *, compress_ratio, mrope_section, rope_pos_offset, main_qkv,
                      main_q_norm_weight, main_k_norm_weight, main_eps, main_kv_cache, main_slot_mapping,
                      main_k_scale, main_v_scale):
    """vLLM 0.33's `_qsa_prepare_kernel` as its source reads, in plain torch, one work item at a
    time (1-D positions, bf16 caches): Gemma RMSNorm (1 + w) in fp32, cast to the cos/sin
    table's dtype, NeoX RoPE on the first Rd = cos_sin.shape[1] dims; its K work first reads
    raw keys from the chunk or the ring, pools them to bf16 and stores normed, rotated group
    keys; item 0 of a request then stores the request's last STATE_SIZE raw keys; the main
    heads of each token come from [q_h | gate_h]... | K... | V..., K and V into [page, Hkv, 2D]."""
    assert mrope_section is None and rope_pos_offset is None and main_k_scale == main_v_scale == 1.0
    T, Hi, Di = q_out.shape
    half = cos_sin.shape[1] // 2

    def norm_rope(x, pos, weight, epsilon):
        x = x.float()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * (1.0 + weight.float())).to(cos_sin.dtype)
        cos, sin = cos_sin[pos, :half].float(), cos_sin[pos, half:].float()
        r0, r1 = y[:, :half].float(), y[:, half: 2 * half].float()
        return torch.cat([r0 * cos - r1 * sin, r1 * cos + r0 * sin, y[:, 2 * half:].float()], 1)

    q_out.copy_(norm_rope(q.reshape(T * Hi, Di), positions.repeat_interleave(Hi), q_norm_weight, eps)
                .view(T, Hi, Di).to(q_out.dtype))
    r, C = compress_ratio, state_cache.shape[1]
    ring, comp = state_cache.view(-1, Di), compressed_cache.view(-1, Di)
    ring_stores = []
    for b, w in k_work_metadata.tolist():
        qs, qe = int(query_start_loc[b]), int(query_start_loc[b + 1])
        end = int(logical_positions[qe - 1])
        start = end - (qe - qs) + 1
        if w < (end + 1) // r - start // r:
            last = ((start + r) // r) * r - 1 + w * r
            src = [k[qs + p - start] if p >= start else state_cache[int(state_block_table[b, 0]), p % C]
                   for p in range(last - r + 1, last + 1)]
            pooled = (torch.stack(src).float().sum(0) / r).to(torch.bfloat16)
            comp[int(compressed_slots[qs + last - start])] = norm_rope(
                pooled[None], torch.tensor([last - r + 1]), k_norm_weight, eps)[0].to(comp.dtype)
        if w == 0:
            ring_stores += [t for t in range(qe - min(qe - qs, C), qe) if state_slots[t] >= 0]
    for t in ring_stores:  # after every read of the ring
        ring[int(state_slots[t])] = k[t]
    P, Hkv, D2 = main_kv_cache.shape[1:]
    D = D2 // 2
    Hq = main_qkv.shape[1] // D2 - Hkv
    heads = main_qkv.view(T, -1, D)
    main_pos = positions.repeat_interleave(Hq)
    qm = norm_rope(heads[:, 0: 2 * Hq: 2].reshape(-1, D), main_pos, main_q_norm_weight, main_eps)
    km = norm_rope(heads[:, 2 * Hq: 2 * Hq + Hkv].reshape(-1, D), positions.repeat_interleave(Hkv),
                   main_k_norm_weight, main_eps).view(T, Hkv, D)
    for t in range(T):
        slot = int(main_slot_mapping[t])
        main_kv_cache[slot // P, slot % P, :, :D] = km[t].to(main_kv_cache.dtype)
        main_kv_cache[slot // P, slot % P, :, D:] = heads[t, 2 * Hq + Hkv:]
    return qm.view(T, Hq, D).to(main_qkv.dtype), heads[:, 1: 2 * Hq: 2].clone()


@pytest.mark.parametrize("case", [Case("decode", 4096, 2, 1), Case("decode", 4096, 2, 4), Case("prefill", 4096, 1, 8)],
                         ids=["decode", "decode-mtp", "prefill"])
def test_vllm_prepare_inputs_reproduce_our_prepare_through_upstreams_kernel_contract(case):
    """VLLMPrepare's inputs (index q | raw key split, cos/sin table, norm weights, the fused main
    projection, ring slots and history, group slots, work list) run through upstream's prepare
    as its source reads (emulated in torch) must give what our prepare left in the step; a
    main projection with q and gate swapped must be caught."""
    import types

    import bench_peers
    import bench_qsa
    from bench_vllm import VLLMPrepare, k_work_metadata

    step = bench_qsa.Step(case, torch.device("cpu"))
    mods = types.SimpleNamespace(prepare=types.SimpleNamespace(qsa_prepare=_upstream_prepare))
    prep = VLLMPrepare(mods, step, ratio=G.compress_ratio, page_size=G.page_size)
    m, C = step.meta, step.cache.ring.shape[1]
    assert torch.equal(prep.state_slots, torch.where(m.ring_slot >= 0, m.ring_slot + C, -1))  # ring_index + 1
    work = k_work_metadata(case.batch, case.rows, case.context, G.compress_ratio, torch.device("cpu")).tolist()
    closes = max(1, case.context // 4 - (case.context - case.rows) // 4)
    assert work == [[b, w] for b in range(case.batch) for w in range(closes)]
    text = bench_peers.check_prepare(step, prep)
    errs = dict(kv.split(" ") for kv in text.removeprefix("prepare err ").split(", "))
    assert float(errs["gate"]) == float(errs["V"]) == float(errs["ring"]) == 0.0
    assert int((prep.comp_slots >= 0).sum()) == case.batch * (case.context // 4 - (case.context - case.rows) // 4)
    D = step.cfg.head_dim
    swapped = prep.main_qkv.view(prep.main_qkv.shape[0], -1, D).clone()
    Hq = step.cfg.num_heads
    swapped[:, 0: 2 * Hq: 2], swapped[:, 1: 2 * Hq: 2] = swapped[:, 1: 2 * Hq: 2].clone(), swapped[:, 0: 2 * Hq: 2].clone()
    prep.main_qkv = swapped.view_as(prep.main_qkv)
    with pytest.raises(bench_peers.PeerMismatch, match=r"^prepare's q differs from ours"):
        bench_peers.check_prepare(step, prep)


def test_vllm_prepare_refuses_a_step_whose_ring_history_our_prepare_replaced():
    """6 rows from position 4090 close the group of 4088..4091, whose first two raw keys live in
    the ring (capacity 4) until our prepare stores rows 4092..4095 over them."""
    import types

    import bench_qsa
    from bench_vllm import VLLMPrepare

    step = bench_qsa.Step(Case("prefill", 4096, 2, 6), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^rows=6 at context 4096: the step starts inside a group"):
        VLLMPrepare(types.SimpleNamespace(), step, ratio=G.compress_ratio, page_size=G.page_size)


def test_select_overflow_counts_the_served_checkpoints_candidates_against_shuffled_columns(capsys):
    """benchmarks/select_overflow.py at 16K: the served checkpoint's scores (a recency bias)
    give more sample-bound candidates than the same scores shuffled, with the kernel's tiles,
    on the prefill route and (--decode) the decode route."""
    import select_overflow

    select_overflow.main(["--contexts", "16384", "--rows", "4", "--decode"])
    prefill, decode = capsys.readouterr().out.split("\nDecode rows")
    rows = [line.split("|")[1:-1] for line in prefill.splitlines()[2:]]
    by_data = {cells[5].strip(): cells for cells in rows}
    assert set(by_data) == {"served", "shuffled"} and all(c[1].strip() == "sample-bounded" for c in rows)
    served, shuffled = (int(by_data[d][6]) for d in ("served", "shuffled"))
    assert served > shuffled > 0
    # the decode route's counts of the same rows: at least Kb each (the bound is the Kb-th
    # largest sample), the served rows crowding past the shuffled ones
    rows = [line.split("|")[1:-1] for line in decode.splitlines() if line.startswith("| 16384")]
    by_data = {cells[4].strip(): cells for cells in rows}
    assert set(by_data) == {"served", "shuffled"}
    served, shuffled = (int(by_data[d][5]) for d in ("served", "shuffled"))
    assert served > shuffled >= 512


def test_select_overflow_what_if_more_samples_a_window_tightens_the_bound():
    """select_overflow's --top-m: the m largest of each window are distinct columns, so the bound
    stays a lower bound of the Kb-th largest score (every count >= Kb) and, on clustered rows, sits
    higher than one sample a window (fewer candidates); --top-m 1 is the kernel's own count."""
    import select_overflow

    g = torch.Generator().manual_seed(3)
    # a row whose high scores cluster in runs of 8 columns, as a recency bias makes them
    base = torch.rand(4096, generator=g)
    base[2048:3072] += 2 * torch.rand(128, generator=g).repeat_interleave(8)
    kb, window = 64, 16
    one, two, four = (select_overflow.candidates(base, 4096, window, kb, 31, m) for m in (1, 2, 4))
    keys = base.view(torch.int32)
    assert one == int((keys >= keys.view(-1, window).amax(1).topk(kb).values[-1]).sum())
    assert one > two > four >= kb


def test_select_overflow_on_recency_data_sends_no_32k_decode_row_past_the_second_tier(capsys):
    """select_overflow --data recency at 32K (bench_qsa's recency step, no model): every row
    crowds past the decode cap (1024), as the served rows do, and the decode tier (cap2 4096, no
    list past cap) takes them all, so none goes to the whole-row resolve; shuffled, none passes
    the cap."""
    import select_overflow

    select_overflow.main(["--contexts", "32768", "--rows", "4", "--decode", "--data", "recency"])
    decode = capsys.readouterr().out.split("\nDecode rows")[1]
    rows = [line.split("|")[1:-1] for line in decode.splitlines() if line.startswith("| 32768")]
    by_data = {cells[4].strip(): [c.strip() for c in cells] for cells in rows}
    assert set(by_data) == {"recency", "shuffled"}
    recency, shuffled = by_data["recency"], by_data["shuffled"]
    assert recency[2:4] == ["1024", "4096"] and 1024 < int(recency[5]) <= int(recency[7]) <= 4096
    assert recency[9:] == ["4 of 4", "0 of 4", "0 of 4"], recency
    assert shuffled[9:] == ["0 of 4", "0 of 4", "0 of 4"], shuffled


@pytest.mark.interpreter
@pytest.mark.parametrize("context", [16384, 32768])
def test_production_tiles_select_the_reference_groups_where_recency_data_overflows_the_lists(monkeypatch, context):
    """The sample-bounded prefill top-k with the GPU's tiles, in the interpreter, on
    --prefill-data recency: every row has more candidates than the cap, and the selection still
    equals the reference's (Step.check). At 16K (4096 columns, one tier) the whole-row resolve
    runs; at 32K the second tier's lists hold them (cap 1024 < candidates <= cap2 4096)."""
    import functools

    import bench_qsa
    import select_overflow
    from qsa_core import QSAOptions
    from qsa_kernels import select, select_prefill
    from qsa_kernels.options import KernelOptions

    options = QSAOptions(backend="triton",
                         kernel=KernelOptions(interpreter=True, small_tiles=False, select_prefill_min_rows=1))
    monkeypatch.setattr(bench_qsa, "QSAPlanner", functools.partial(bench_qsa.QSAPlanner, options=options))
    rows = 4
    step = bench_qsa.Step(Case("prefill", context, 1, rows, "bf16"), torch.device("cpu"), prefill_data="recency",
                          backend="triton")
    n_cols = context // 4
    block_g = select.score_block_g(n_cols)
    tiles = select_prefill.prefill_tiles(n_cols, 512, block_g, small=False)
    assert select_prefill.prefill_route(n_cols, 512, tiles, block_g)
    assert (tiles.cap2, tiles.lists) == ((0, tiles.cap) if context == 16384 else (4 * tiles.cap, 4 * tiles.cap))
    S = select_prefill.sample_cols(tiles, block_g)
    for r in range(rows):
        scores = step.ref_scores(r)
        n = select_overflow.candidates(scores, scores.shape[0], S, 512, tiles.lbits)
        assert n > tiles.cap and (tiles.cap2 == 0 or n <= tiles.lists), (r, n)
    assert step.check(rows).startswith("ok")
