"""fp4_dist.checkpoint in one process (DCP without a process group): a save is committed whole, and the newest
complete step folder is found again, naming what it skips."""

from __future__ import annotations

import os
import shutil
import signal
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp4_dist.checkpoint import latest_complete_checkpoint, save, step_folder
from fp4_dist.checkpoint.lock import LOCK

from .killed_writer import die_at


def state(value: float) -> dict:
    return {"w": torch.full((64,), value), "b": torch.full((8,), -value)}


def loaded(path) -> dict:
    out = state(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note on loading without a process group
        dcp.load(out, checkpoint_id=path)
    return out


def test_the_newest_complete_step_is_found_and_newer_unfinished_saves_are_named(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on saving without a process group
        for step in (2, 4):
            save(state(step), step_folder(tmp_path, step))
    step_folder(tmp_path, 6).mkdir()  # a plain dcp.save killed before it wrote .metadata
    (tmp_path / ".step_00000008.tmp-somehost-1-ab").mkdir()  # fp4_dist.checkpoint.save killed mid-write
    with pytest.warns(UserWarning, match="resuming from .*step_00000004") as said:
        found = latest_complete_checkpoint(tmp_path)
    assert found.step == 4 and found.path == step_folder(tmp_path, 4)
    assert len(found.skipped) == 2 and "step_00000006 (no .metadata" in found.skipped[1]
    assert ".step_00000008.tmp-somehost-1-ab (a save of step 8 that did not finish)" in found.skipped[0]
    assert "step_00000006" in str(said[0].message)
    assert torch.equal(loaded(found.path)["w"], state(4)["w"])
    assert latest_complete_checkpoint(tmp_path / "nothing") is None
    # a folder named by hand (a copy as step_12) is named for what it is, not taken for the missing step_00000012
    shutil.copytree(step_folder(tmp_path, 4), tmp_path / "step_12")
    with pytest.warns(UserWarning, match="step_12 .not a name step_folder gives"):
        found = latest_complete_checkpoint(tmp_path)
    assert found.step == 4 and not any("step_00000012" in s for s in found.skipped), found.skipped


def test_a_save_killed_at_any_point_leaves_the_earlier_checkpoint_or_the_new_one(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = save(state(1.0), step_folder(tmp_path, 10))
    seen = []
    for k in range(8):  # the commit's fsyncs, renames and delete
        assert die_at(k, lambda: save(state(2.0), path)) in (-signal.SIGKILL, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = latest_complete_checkpoint(tmp_path)
        assert found is not None and found.step == 10
        seen.append(float(loaded(found.path)["w"][0]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save(state(1.0), path)  # back to the earlier one (and what the kill left is cleaned up)
        assert sorted(os.listdir(tmp_path)) == [LOCK, "step_00000010"]  # the lock: this process saves there
    assert seen[0] == 1.0 and seen[-1] == 2.0 and set(seen) == {1.0, 2.0}, seen
