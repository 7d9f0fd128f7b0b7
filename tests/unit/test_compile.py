"""torch.compile over a model with NVFP4 linear weights: no traceback in the log, a number of recompiles that does
not grow with the number of layers, and (with aot_eager, which keeps eager numerics) the eager result."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.distributed import forked_ranks

REPO = Path(__file__).resolve().parents[2]


def compile_log(backend: str, blocks: int) -> str:
    # A process of its own, forked from a process that has imported torch with the same environment (TORCH_LOGS
    # included: torch reads it at import) instead of a fresh interpreter importing torch again for each of the four.
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_LOGS="recompiles", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).with_name("compile_case.py")), backend, str(blocks)]
    proc = forked_ranks.run_python(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_prints_no_traceback_and_recompiles_do_not_grow_with_layers(backend):
    logs = {blocks: compile_log(backend, blocks) for blocks in (2, 6)}
    for blocks, log in logs.items():
        assert "Traceback" not in log, f"{blocks} blocks, {backend}:\n{log[-4000:]}"
        assert "_stable_hash_for_caching" not in log and "recompile_limit" not in log, log[-4000:]
    recompiles = {b: log.count("Recompiling function") for b, log in logs.items()}
    assert recompiles[2] == recompiles[6] <= 5, f"recompiles by number of blocks: {recompiles}"
    if backend == "aot_eager":
        assert "COMPILED_EQUALS_EAGER output True gradients True" in logs[2], logs[2][-2000:]
