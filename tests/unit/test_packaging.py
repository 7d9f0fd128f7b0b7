"""`pip install .` builds the package without a warning, and the wheel holds every module and the CUDA sources the
kernel loader reads (`fp4_dist/kernels/cuda`, a folder of .cu files without an __init__.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_the_wheel_builds_without_a_warning_and_holds_the_cuda_sources(tmp_path):
    pytest.importorskip("setuptools", reason="the build backend pyproject.toml names")
    source = tmp_path / "source"
    # the package as a used checkout has it (with __pycache__ folders), beside the files the build reads
    shutil.copytree(ROOT / "fp4_dist", source / "fp4_dist")
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-w", str(tmp_path / "wheel"), str(source)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # pip's own notes about this machine's package mirrors are not the build's
    warned = [line for line in log.splitlines() if "warning" in line.lower() and "WARNING: Location" not in line]
    assert warned == [], log[-4000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "fp4_dist").rglob("*") if p.suffix in (".py", ".cu", ".cuh")}
    assert tree - names == set(), sorted(tree - names)
    assert not any("__pycache__" in n for n in names)
