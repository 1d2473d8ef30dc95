"""The built wheel holds every module of the three packages.

The suites import the packages from the checkout (editable install), so a subpackage missing
from pyproject's `packages` list would pass them all and break only a plain `pip install .`,
as GPU hosts and users run it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder in the checkout (pyproject's package-dir)
PACKAGE_DIRS = {"qsa_core": "qsa_core", "qsa_kernels": "kernels/qsa_kernels", "qsa_adapters": "adapters/qsa_adapters"}


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    # Built from a copy: setuptools would reuse a checkout's build/ folder from an earlier build.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path), str(src)], check=True, timeout=300, cwd=tmp_path)
    wheels = list(tmp_path.glob("qsa-*.whl"))
    assert len(wheels) == 1, f"expected one qsa wheel in {tmp_path}, found {wheels}"
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    expected = {f"{name}/{path.relative_to(ROOT / folder).as_posix()}"
                for name, folder in PACKAGE_DIRS.items() for path in (ROOT / folder).rglob("*.py")
                if "__pycache__" not in path.parts}
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject's packages): {missing}"
