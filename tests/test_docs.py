"""The docs point at files that exist: every repository path that README.md, BENCHMARKS.md,
NOTES.md and docs/design.md name (in a link or in backticks) is in the tree, but those named
with the commit that last held them (`... at <commit>`: git history). The code cites the design
by section (`design.md §2.7`): every cited section exists, and nothing cites SPEC.md, which the
repository does not contain."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "BENCHMARKS.md", "NOTES.md", "docs/design.md"]
TOP = ("adapters/", "benchmarks/", "docs/", "examples/", "kernels/", "qsa_core/", "scripts/", "tests/")
# `path`, `path ARGS` or ](path): the first word of a code span, or a link target
NAMED = re.compile(r"`([\w./-]+)[^`]*`|\]\(([\w./-]+)\)")
IN_HISTORY = re.compile(r"\s+at [0-9a-f]{7,40}\b")


def named_paths(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    base = (ROOT / doc).parent
    found = []
    for m in NAMED.finditer(text):
        name = m.group(1) or m.group(2)
        if IN_HISTORY.match(text, m.end()):
            continue
        if m.group(2) is not None:  # a link, relative to the doc
            found.append(str((base / name).resolve().relative_to(ROOT)))
        elif name.startswith(TOP):
            found.append(name)
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc):
    paths = named_paths(doc)
    assert paths, f"{doc} names no repository path: the pattern is broken"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{doc} names paths that are not in the tree: {missing}"


def test_a_missing_path_is_reported(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("run `benchmarks/gone.py --x` and `benchmarks/device/` at 7bb3f93, see [it](docs/design.md)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("")
    assert named_paths("doc.md") == ["benchmarks/gone.py", "docs/design.md"]


SOURCES = ("*.py", "*.sh", "*.md", "*.toml")
SPEC = re.compile(r"\bSPEC\b|SPEC\.md")
CITED = re.compile(r"§(\d+(?:\.\d+)?)")


def design_sections() -> set[str]:
    """`## N.` headings and the numbered paragraphs `N.M ` inside them."""
    text = (ROOT / "docs" / "design.md").read_text()
    return set(re.findall(r"^## (\d+)\.", text, re.M)) | set(re.findall(r"^(\d+\.\d+) ", text, re.M))


def source_files() -> list[Path]:
    files = [f for pattern in SOURCES for f in ROOT.glob(pattern)]
    for top in TOP:
        files += [f for pattern in SOURCES for f in (ROOT / top).rglob(pattern)]
    return [f for f in files if f.name != "design.md" and f != Path(__file__).resolve()]


def test_design_md_numbers_the_sections_the_code_cites():
    sections = design_sections()
    assert {"1", "2.7", "3", "4", "5", "6.11", "7", "8", "9"} <= sections, sorted(sections)
    cited, stale = {}, []
    for f in source_files():
        text = f.read_text(errors="replace")
        for m in CITED.finditer(text):
            cited.setdefault(m.group(1), str(f.relative_to(ROOT)))
        stale += [str(f.relative_to(ROOT))] if SPEC.search(text) else []
    assert len(cited) > 10, "the code cites design.md: the pattern is broken"
    assert not stale, f"cite docs/design.md §N (SPEC trap N is §6.N), not SPEC: {stale}"
    unknown = {n: where for n, where in cited.items() if n not in sections}
    assert not unknown, f"sections docs/design.md does not have (section: first file citing it): {unknown}"
