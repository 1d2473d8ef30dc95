"""`qsa_kernels` is a leaf package: it imports nothing from `qsa_core`, its modules import each
other without a cycle and no module takes another's private (`_`) names."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels",
                       "qsa_kernels")
MODULES = sorted(f[:-3] for f in os.listdir(KERNELS) if f.endswith(".py") and f != "__init__.py")


def _imports(name: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken) of every import statement in module `name` (any depth:
    function-level imports count), package-relative ones as 'qsa_kernels.<module>'."""
    tree = ast.parse(open(os.path.join(KERNELS, f"{name}.py")).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "qsa_kernels" + (f".{node.module}" if node.module else "")
                if node.module is None:  # `from . import x`: x is a module
                    found += [(f"qsa_kernels.{a.name}", []) for a in node.names]
                    continue
            else:
                base = node.module or ""
            found.append((base, [a.name for a in node.names]))
    return found


def test_no_module_imports_the_core_or_a_private_name():
    for name in MODULES + ["__init__"]:
        for module, names in _imports(name):
            assert not module.startswith("qsa_core"), f"qsa_kernels.{name} imports {module}"
            if module.startswith("qsa_kernels."):
                private = [n for n in names if n.startswith("_")]
                assert not private, f"qsa_kernels.{name} takes private names {private} from {module}"


def test_module_imports_have_no_cycle():
    graph = {name: {m.removeprefix("qsa_kernels.") for m, _ in _imports(name) if m.startswith("qsa_kernels.")}
             for name in MODULES}
    assert set().union(*graph.values()) <= set(MODULES), graph
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + (name,))
        done.add(name)

    for name in MODULES:
        visit(name, ())


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_importing_every_module_loads_no_core_module(interpret):
    """In a fresh interpreter (with and without TRITON_INTERPRET): every `qsa_kernels` module
    imports, and no `qsa_core` module is loaded afterwards."""
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}:\n"
            "    importlib.import_module('qsa_kernels.' + m)\n"
            "print(sorted(k for k in sys.modules if k == 'qsa_core' or k.startswith('qsa_core.')))\n")
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
