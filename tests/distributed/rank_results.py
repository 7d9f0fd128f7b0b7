"""Launch a case script under torchrun and read what each rank said: the ``RESULT <rank> [<case>] <outcome>`` lines
that tests/distributed/torch_user_cases.py and export_cases.py print (no pytest inside the ranks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def say(rank: int, *words: str) -> None:
    """In a rank of a case script: the one line ``RESULT <rank> <words...>`` the test reads (newlines folded: the
    ranks share torchrun's stdout, one write each)."""
    sys.stdout.write(" ".join(["RESULT", str(rank), *words]).replace("\n", " ").rstrip() + "\n")
    sys.stdout.flush()


def run_ranks(script: Path, args: list, ranks: int, timeout_s: float) -> dict[int, str]:
    """{rank: outcome} of `script args...` on `ranks` gloo ranks; asserts that every rank reported."""
    return _launch(script, args, ranks, timeout_s, lambda rest: ((), rest), [()])[()]


def run_cases(script: Path, cases: list[str], ranks: int, timeout_s: float) -> dict[str, dict[int, str]]:
    """{case: {rank: outcome}} of `script case...` on `ranks` gloo ranks, the cases one after the other in one job,
    each rank saying ``RESULT <rank> <case> <outcome>``; asserts that every rank reported every case."""
    return _launch(script, cases, ranks, timeout_s, lambda rest: tuple(rest.split(" ", 1)), cases)


def _launch(script: Path, args: list, ranks: int, timeout_s: float, split, keys) -> dict:
    from . import forked_ranks  # here: the case scripts import this module on its own, outside the package

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
           *map(str, args)]  # fmt: skip
    proc = forked_ranks.run(cmd, env=env, timeout=timeout_s)
    results: dict = {key: {} for key in keys}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, rank, rest = line.split(" ", 2)
            key, outcome = split(rest)
            results.setdefault(key, {})[int(rank)] = outcome
    missing = [key for key in keys if sorted(results[key]) != list(range(ranks))]
    assert not missing, f"not every rank reported {missing}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return results
