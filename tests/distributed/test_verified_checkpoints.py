"""Stored bytes verified, one writer per checkpoint root (gloo ranks, CPU).

- One flipped byte in a ``.distcp`` shard or in ``.metadata`` of a Zero1 checkpoint: both loaders
  (`fp4_dist.optim.load_checkpoint`, `fp4_dist.checkpoint.load_distributed_checkpoint`) refuse on every rank,
  naming the file and the offset, and every rank's masters and Adam state are the ones it had (nothing loaded);
  ``verify=False`` loads it.
- Two jobs of the main job (examples/train_lm.py) saving into one root: the second is refused on every rank within
  seconds, naming the first; the first ends as it would alone and every checkpoint it wrote verifies and resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp4_dist.checkpoint import verify_folder
from fp4_dist.checkpoint.lock import LOCK

from . import forked_ranks
from .test_launch import REPO, TIMEOUT_S, _env

SCRIPT = REPO / "tests" / "distributed" / "damaged_checkpoint.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(mode: str, folder: Path, out: Path, *extra: str) -> list[dict]:
    proc = forked_ranks.run([*TORCHRUN, str(SCRIPT), "--mode", mode, "--dir", str(folder), "--out", str(out),
                             *extra], env=_env(), timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["__1_0.distcp", ".metadata"])
def test_a_flipped_byte_in_a_dcp_file_is_refused_on_every_rank_naming_it_and_nothing_is_loaded(tmp_path, name):
    folder = tmp_path / "ckpt" / "step_00000002"
    saved = _launch("save", folder, tmp_path / "save.json")
    assert verify_folder(folder)
    damaged = folder / name
    offset = damaged.stat().st_size // 2
    flip(damaged, offset)
    for rank, r in enumerate(_launch("load", folder, tmp_path / "load.json")):
        for loader in ("zero1", "dcp"):
            error = r[loader]["error"] or ""
            assert error.startswith(f"DamagedCheckpointError: {damaged}: bytes 0..") and "nothing was loaded" in error, \
                (rank, loader, error)
            assert f"first damaged byte is at offset 0 or after" in error, error  # one chunk: the file is small
            assert r[loader]["unchanged"], (rank, loader, "state changed though the load was refused")
    # verify=False loads it: the damage is in the bytes, not in what the loaders accept
    if name.endswith(".distcp"):
        flip(damaged, offset)  # back: an unchecked load of a flipped tensor byte would load it (the point of the check)
        (folder / "fp4_dist_manifest.json").write_text("{}")  # a damaged manifest: refused unless unchecked
        r = _launch("load", folder, tmp_path / "unchecked.json", "--no-verify")
        assert all(x["zero1"]["error"] is None and x["zero1"]["state"] == saved[0]["saved"] for x in r), r


def _train_cmd(root: Path, steps: int, every: int) -> list:
    return [*TORCHRUN, "-m", "examples.train_lm", "--steps", str(steps), "--dim", "32", "--hidden", "64", "--seq",
            "32", "--backend", "gloo", "--no-progress", "--save", str(root), "--save-every", str(every)]


def _train(root: Path, steps: int, every: int = 2) -> subprocess.Popen:
    """The job started under real torchrun, running beside the test (whose launcher a kill of a rank ends)."""
    cmd = _train_cmd(root, steps, every)
    return subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _train_to_end(root: Path, steps: int, every: int = 2) -> subprocess.CompletedProcess:
    """The job to its end, its ranks forked (forked_ranks), stderr after stdout in `stdout`."""
    proc = forked_ranks.run(_train_cmd(root, steps, every), env=_env(), timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout + proc.stderr)


def test_a_second_job_saving_into_the_same_root_is_refused_on_every_rank_and_the_first_is_intact(tmp_path):
    root = tmp_path / "ckpt"
    # The second job's ranks fork from a process that has imported torch: started before the first job, it does not
    # delay the second while the first trains.
    forked_ranks.prepare(_env())
    first = _train(root, 120, every=20)  # long enough to outlive the second job's start-up (ranks forked: 1-3 s)
    deadline = time.monotonic() + TIMEOUT_S
    while not (root / LOCK).is_file():  # the first job holds the root from its start-up
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.2)
    holder = json.loads((root / LOCK).read_text())
    t0 = time.monotonic()
    second = _train_to_end(root, 120, every=20)
    out = second.stdout
    took = time.monotonic() - t0
    assert first.poll() is None, "the first job ended before the second was refused: make it longer"
    assert second.returncode != 0, out[-3000:]
    for rank in range(2):
        assert f"train_lm: rank {rank}: --save {root}: {root} is the checkpoint root of another job" in out, out[-3000:]
    assert f"pid {holder['pid']} on host {holder['host']}" in out and "trained" not in out, out[-3000:]
    assert took < 60, f"refused only after {took:.0f} s (start-up of the second job included)"
    log, _ = first.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0 and "PASS (bit-identical)" in log, log[-3000:]
    steps = sorted(p.name for p in root.iterdir())
    assert steps == [f"step_{s:08d}" for s in range(20, 121, 20)], steps  # every save, and the lock released
    assert all(verify_folder(root / s) for s in steps)
    resumed = _train_to_end(root, 122)
    assert resumed.returncode == 0 and "step 120 of 122" in resumed.stdout, resumed.stdout[-3000:]


def test_a_lock_left_by_a_killed_job_is_taken_over_and_its_unfinished_save_deleted(tmp_path):
    root = tmp_path / "ckpt"
    first = _train(root, 400)
    deadline = time.monotonic() + TIMEOUT_S
    while not (root / "step_00000002").is_dir():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.2)
    holder = json.loads((root / LOCK).read_text())
    os.kill(holder["pid"], 9)  # rank 0, the holder: SIGKILL, as the OOM killer would; its launcher ends the rest
    first.communicate(timeout=TIMEOUT_S)
    left = root / ".step_00000004.tmp-otherhost-1-0123abcd"  # what a save killed mid-write leaves
    shutil.copytree(root / "step_00000002", left)
    proc = _train_to_end(root, 4)
    log = proc.stdout
    assert proc.returncode == 0, log[-3000:]
    assert f"took over {root / LOCK}, left by pid {holder['pid']} on host {holder['host']}" in log, log[-3000:]
    assert f"deleted {left}" in log and not left.exists(), log[-3000:]
    assert not (root / LOCK).exists()
