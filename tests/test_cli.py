"""The command lines: `python -m qsa_core` (the demo against transformers) and the benchmark's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qsa_core.__main__ as demo

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_qsa.py"


def test_demo_prints_each_step_and_matches_transformers(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == len(demo.SCHEDULE) and steps[-1].startswith(f"step {len(demo.SCHEDULE)}/")
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("request ")] == [
        "request a", "request b", "request c"]
    assert "OK: standalone QSA matches transformers" in out


def test_demo_fails_when_the_difference_exceeds_the_tolerance(monkeypatch, capsys):
    monkeypatch.setattr(demo, "TOLERANCE", 0.0)  # fp32 summation order differs: > 0
    assert demo.main(["--seed", "1"]) == 1
    assert "FAIL: standalone QSA differs from transformers" in capsys.readouterr().err


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)


def test_bench_help_explains_every_option():
    res = _bench("--help")
    assert res.returncode == 0, res.stderr
    for option, words in [("--out DIR", "results.json"), ("--smoke", "two small"), ("--dry-run", "CPU"),
                          ("--sglang-dir SITE", "SGLang 0.5.23"), ("--no-plot", "matplotlib"),
                          ("--budget-s", "resume"), ("--markdown", "BENCHMARKS.md"),
                          ("`host`", "host side"), ("`tp`", "rank's"), ("`report DIR`", "re-renders"),
                          ("`serving`", "TTFT")]:
        assert option in res.stdout and words in res.stdout, option


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_clearly_without_cuda(tmp_path):
    res = _bench("--out", str(tmp_path / "r"), "--smoke")
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()
