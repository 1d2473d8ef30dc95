"""The GPU scripts' own logic on the CPU (no server): scripts/gpu_sglang.py's tie-aware comparison,
run plan, two waves of prompts, kept results and summary, and bench_serving.py's table. The scripts themselves run on a GPU host
(`--smoke` / `--dry-run` run them end to end through SGLang's CPU build)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "scripts"), os.path.join(ROOT, "benchmarks")]

import bench_serving  # noqa: E402
import gpu_sglang as g  # noqa: E402

TIE = g.TIE


def result(tokens, margins=None, **kw):
    return {"tokens": tokens, "margins": margins, **kw}


def test_compare_passes_equal_runs_and_bf16_ties_only():
    a = result([[1, 2, 3], [4, 5, 6]], [[1.0, 1.0, 1.0], [1.0, TIE, 1.0]])
    assert g.compare(a, result([[1, 2, 3], [4, 5, 6]]))[0]
    # Parting at token 1 of prompt 1, where both runs stand at a tie: allowed.
    b = result([[1, 2, 3], [4, 9, 9]], [[1.0, 1.0, 1.0], [1.0, TIE / 2, 1.0]])
    ok, notes = g.compare(a, b)
    assert ok and "prompt 1 at token 1" in notes
    # Only one run at a tie: a real difference.
    c = result([[1, 2, 3], [4, 9, 9]], [[1.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    assert not g.compare(a, c)[0]
    # No log-probs on either side (two speculative runs): no tie can be shown.
    assert not g.compare(result([[1, 2]]), result([[1, 3]]))[0]
    # A shorter output is a difference too.
    assert not g.compare(result([[1, 2]], [[1.0, 1.0]]), result([[1]], [[1.0]]))[0]
    # So is a run with fewer prompts, even where those it has are equal.
    assert g.compare(result([[1, 2]] * 2), result([[1, 2]])) == (False, "2 against 1 prompts")


def test_the_second_wave_has_the_first_wave_lengths_and_nothing_in_common():
    for profile in (g.GPU, g.SMOKE):
        first, second = (g.prompts(profile, seed) for seed in g.WAVE_SEEDS)
        assert [len(p) for p in first] == [len(p) for p in second] == list(profile.lengths)
        # No second-wave prompt starts as any first-wave prompt: no prefix to reuse.
        assert not {p[0] for p in first} & {p[0] for p in second}
        assert g.prompt_count(profile) == 2 * len(profile.lengths)


def test_a_result_without_the_second_wave_counts_as_not_run(tmp_path):
    run = g.Run("qsa_core", "eager")
    one_wave = result([[1, 2, 3]] * 6, generate_s=27.2)
    assert not g.counts(one_wave)
    assert g.counts(dict(one_wave, warm_s=1.5)) and g.counts({"error": "start: exited"})
    (tmp_path / f"{run.name}.json").write_text(json.dumps(one_wave))
    assert g.load(str(tmp_path), run) is None  # so main runs it again and the summary shows it not run
    g.summarize(str(tmp_path), [run], g.GPU)
    assert f"| {run.name} | | | | | | not run |" in (tmp_path / "summary.md").read_text()


def test_plan_puts_qsa_core_first_and_nextn_after_the_graphs_run():
    names = [r.name for r in g.plan(["qsa", "qsa_core"], ["eager", "graphs"], spec=True)]
    assert names == ["qsa_core-eager", "qsa_core-graphs", "qsa_core-graphs-nextn3", "qsa-eager", "qsa-graphs",
                     "qsa-graphs-nextn3"]
    names = [r.name for r in g.plan(["qsa_core"], ["graphs"], spec=True)]
    assert names == ["qsa_core-graphs", "qsa_core-graphs-nextn3"]
    assert [r.name for r in g.plan(["qsa_core"], ["eager"], spec=True)] == ["qsa_core-eager", "qsa_core-eager-nextn3"]
    assert [r.name for r in g.plan(["qsa"], ["eager", "decodegraphs"], spec=False)] == ["qsa-eager", "qsa-decodegraphs"]


def test_a_server_log_must_name_its_backend_and_hold_no_guard_report():
    run = g.plan(["qsa_core"], ["graphs"], True)[1]  # qsa_core-graphs-nextn3
    served = f"x\n[t] qsa_core: {g.CORE_LINE} (ratio 4, ..., {g.RING_LINE}, ...)\nCapture target verify CUDA graph end\n"
    assert g.log_error(run, served) is None
    assert "lacks" in g.log_error(run, served.replace(g.RING_LINE, "raw-key ring 4 rows per request"))
    report = ("[t] qsa_core: malformed step metadata: the rows of the requests concerned were made inert (output 0, "
              "no cache write) instead of giving a wrong answer: a ring_index entry was another request's with rows too")
    error = g.log_error(run, served + "\rCapturing prefill shape (num_tokens=64)" + report + "\n")
    assert error.startswith("1 guard report(s) in the log") and "ring_index entry" in error


def test_summary_checks_what_ran_and_leaves_the_rest_pending(tmp_path):
    runs = g.plan(["qsa_core", "qsa"], ["eager", "graphs"], spec=True)
    n = g.prompt_count(g.GPU)  # both waves
    tokens = [[1, 2, 3]] * n
    margins = [[1.0, 1.0, 1.0]] * n
    write = lambda name, r: (tmp_path / f"{name}.json").write_text(json.dumps(dict(r, warm_s=1.5)))  # noqa: E731
    write("qsa_core-eager", result(tokens, margins, start_s=90.0, generate_s=27.2))
    write("qsa-eager", result(tokens, margins))
    assert g.summarize(str(tmp_path), runs, g.GPU) == []
    text = (tmp_path / "summary.md").read_text()
    assert "| run | start s | first wave s (compiles included) | second wave s | CUDA graphs captured |" in text
    assert "| qsa_core-eager | 90.0 | 27.2 | 1.5 | - | - | ok |" in text
    assert "| eager: qsa_core vs qsa | 12/12 | - | ok |" in text
    assert "| qsa_core: graphs vs eager | | | pending |" in text and "| qsa-graphs | | | | | | not run |" in text
    # qsa_core's graphs part from its eager run beyond a tie in the second wave (prompt 7): a failure;
    # qsa's own parting is reported only.
    other = tokens[:7] + [[1, 9, 9]] + tokens[8:]
    write("qsa_core-graphs", result(other, margins))
    write("qsa-graphs", result(other, margins))
    write("qsa_core-graphs-nextn3", result(other, None, spec=[{"spec_verify_ct": 0}] * n))
    write("qsa-graphs-nextn3", result(tokens, None, spec=[{"spec_verify_ct": 2}] * n))
    failures = g.summarize(str(tmp_path), runs, g.GPU)
    assert "qsa_core: graphs vs eager" in failures and "qsa: graphs vs eager (reported)" not in failures
    assert "| qsa_core: graphs vs eager | 11/12 | prompt 7 at token 1: margins [1.0, 1.0] (not a tie) | FAILED |" \
        in (tmp_path / "summary.md").read_text()
    assert "qsa_core-graphs-nextn3: no verify step: speculation did not run" in failures
    assert not any(f.startswith("qsa graphs: NEXTN") or f.startswith("qsa-graphs-nextn3") for f in failures)
    assert "differs (reported)" in (tmp_path / "summary.md").read_text()


def test_serving_table_compares_qsa_core_with_the_engine_own_qsa():
    wave = dict(prompt_len=8192, concurrency=8, output_tokens=128)
    results = [dict(wave, backend="qsa_core", ttft_ms=50.0, tpot_ms=4.0, output_tok_s=2000.0),
               dict(wave, backend="qsa", ttft_ms=100.0, tpot_ms=0.0, output_tok_s=1000.0)]
    text = bench_serving.tables(results, "sglang")
    assert "| 8192 | 8 | 128 | qsa_core | 50 | 4.00 | 2000.0 |" in text
    assert "| 8192 | 8 | 128 | 0.50 | - | 2.00 |" in text


def test_serving_table_names_the_engine_kernels_compiled_in_a_timed_wave():
    log = ("(EngineCore pid=1) INFO 12-07 11:20:29 [jit_monitor.py:84] Kernel JIT monitor activated\n"
           "(EngineCore pid=1) WARNING 12-07 11:20:33 [jit_monitor.py:140] Triton kernel JIT compilation during "
           "inference: fused_moe_kernel. This causes a latency spike; consider extending warmup\n")
    assert bench_serving.engine_jit(log) == ["fused_moe_kernel"]
    wave = dict(prompt_len=32768, concurrency=8, output_tokens=64, ttft_ms=410.0, tpot_ms=20.2, output_tok_s=296.0,
                max_gap_ms=920.0)
    results = [dict(wave, backend="QSA_CORE", engine_jit=bench_serving.engine_jit(log)),
               dict(wave, backend="upstream", engine_jit=[])]
    text = bench_serving.tables(results, "vllm")
    assert "| 32768 | 8 | 64 | QSA_CORE | 410 | 20.20 | 296.0 | 920 | fused_moe_kernel |" in text
    assert "| 32768 | 8 | 64 | upstream | 410 | 20.20 | 296.0 | 920 | none |" in text


def test_serving_fails_a_run_whose_server_log_holds_a_guard_report():
    from qsa_core.guard import REPORT_PREFIX
    log = ("INFO 12-07 11:20:29 served\n"
           f"ERROR 12-07 11:20:30 {REPORT_PREFIX}: the rows of the requests concerned were made inert\n")
    assert bench_serving.guard_reports(log) == [log.splitlines()[1]]
    assert bench_serving.guard_reports("INFO served\n") == []

