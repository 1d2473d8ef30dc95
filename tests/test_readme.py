"""The README's quickstart runs exactly as written, on the example config it names."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def quickstart_code() -> str:
    """The first ```python block of the README's Quickstart section, verbatim."""
    section = (ROOT / "README.md").read_text().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under ## Quickstart"
    return match.group(1)


def test_quickstart_runs_as_written(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the README says: from the repository root
    namespace: dict = {"__name__": "__main__"}
    exec(compile(quickstart_code(), "README.md#quickstart", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "prefill: {'req-0': (5000, 2048)}",
        "mixed step: {'req-0': (1, 2048), 'req-1': (700, 2048)}",
    ]
    assert all(torch.isfinite(o).all() for o in namespace["out"].values())
    assert namespace["runner"].seq_len("req-1") == 700


def test_example_config_is_a_transformers_config_at_production_geometry():
    from transformers import AutoConfig, Qwen4ExpTextConfig

    from qsa_core import QSAConfig

    path = ROOT / "examples" / "qwen4-exp-qsa"
    assert isinstance(AutoConfig.from_pretrained(path), Qwen4ExpTextConfig)
    cfg = QSAConfig.from_hf(path)
    got = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim,
           cfg.token_topk, cfg.compress_ratio, cfg.rotary_dim)
    assert got == (24, 2, 256, 4, 128, 2048, 4, 64)  # design.md §1
