"""Launch a case script under torchrun and read what each rank said: the ``RESULT <rank> <outcome>`` lines that
tests/distributed/torch_user_cases.py and export_cases.py print (no pytest inside the ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_ranks(script: Path, args: list, ranks: int, timeout_s: float) -> dict[int, str]:
    """{rank: outcome} of `script args...` on `ranks` gloo ranks; asserts that every rank reported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
           *map(str, args)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, rank, outcome = line.split(" ", 2)
            results[int(rank)] = outcome
    assert sorted(results) == list(range(ranks)), \
        f"not every rank reported:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return results
