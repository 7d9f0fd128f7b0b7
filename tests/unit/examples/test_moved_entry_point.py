"""`python -m fp4_dist.examples.train_lm`, the example trainer's name from when it was part of the package: it warns
and runs `python -m examples.train_lm` in a checkout, and stops naming that command in an installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
OLD, NEW = "python -m fp4_dist.examples.train_lm", "python -m examples.train_lm"


def _run(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "fp4_dist.examples.train_lm", "--help"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_old_name_warns_and_runs_the_moved_trainer_in_a_checkout():
    proc = _run(REPO, REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"`{OLD}` is deprecated" in proc.stderr and f"`{NEW}`" in proc.stderr
    assert "--steps" in proc.stdout and "usage:" in proc.stdout  # examples/train_lm.py's own options


def test_the_old_name_stops_naming_the_new_command_where_no_examples_folder_sits_beside_the_package(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(REPO / "fp4_dist", site / "fp4_dist", ignore=shutil.ignore_patterns("__pycache__"))
    proc = _run(tmp_path, site)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "holds no examples/ folder (an installed package)" in proc.stderr and f"`{NEW}`" in proc.stderr
    assert "usage:" not in proc.stdout
