"""torch.compile over a model with NVFP4 linear weights: no traceback in the log, a number of recompiles that does
not grow with the number of layers, and (with aot_eager, which keeps eager numerics) the eager result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def compile_log(backend: str, blocks: int) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_LOGS="recompiles", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_case.py")), backend, str(blocks)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
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
