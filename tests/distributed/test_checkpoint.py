"""Zero1Optimizer checkpoints with torch.distributed.checkpoint: saved at one world size, loaded at the same and
at others (gloo, CPU), every master, Adam moment and step and every NVFP4 weight byte bit for bit
(zero1_checkpoint.py does the work and writes digests of the full tensors; the tests compare them)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from . import forked_ranks
from .test_launch import REPO, TIMEOUT_S, _env
from .shared import once_per_session

SCRIPT = REPO / "tests" / "distributed" / "zero1_checkpoint.py"

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(world_size: int, mode: str, ckpt: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           str(SCRIPT), "--mode", mode, "--dir", str(ckpt), "--out", str(out)]
    proc = forked_ranks.run(cmd, env=_env(), timeout=TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), f"{mode} at world size {world_size} failed:\n" + \
        (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


@once_per_session
def saved(world_size: int) -> tuple[str, dict]:
    tmp = Path(tempfile.mkdtemp(prefix=f"fp4_dist_ckpt_ws{world_size}_"))
    report = _launch(world_size, "save", tmp / "ckpt", tmp / "save.json")
    return str(tmp / "ckpt"), report


@pytest.mark.parametrize("save_ws,load_ws", [(2, 2), (2, 3), (3, 2), (1, 3), (3, 4)],
                         ids=lambda v: f"ws{v}")
def test_a_checkpoint_saved_at_one_world_size_restores_bit_for_bit_at_another(save_ws, load_ws, tmp_path):
    ckpt, before = saved(save_ws)
    after = _launch(load_ws, "load", Path(ckpt), tmp_path / "load.json")
    assert after["failures"] == []
    differ = sorted(k for k, v in before["digests"].items() if after["digests"].get(k) != v)
    assert not differ, f"saved at {save_ws} ranks, loaded at {load_ws}: {len(differ)} tensors differ: {differ[:8]}"
    assert len(before["digests"]) >= 25  # masters, exp_avg, exp_avg_sq and step of 7 params, and NVFP4 bytes
