"""The main job's options are recorded with each checkpoint: a --save folder saved with other options is refused,
naming each differing option with both values, before anything is loaded; the options a resumed run may change
(--steps, --save-every, paths, logging) resume."""

from __future__ import annotations

import sys

import pytest

from . import forked_ranks
from .test_launch import _env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 300
SMALL = ["--dim", "32", "--hidden", "64", "--seq", "32", "--batch", "4", "--backend", "gloo", "--no-progress"]


def train(tmp_path, *options: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "examples.train_lm", *options]  # fmt: skip
    return forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)


def test_a_save_folder_of_other_options_is_refused_naming_them(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = train(tmp_path, *SMALL, "--steps", "2", "--save", ckpt, "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]

    other = train(tmp_path, *SMALL[:1], "48", *SMALL[2:], "--lr", "0.01", "--steps", "4", "--save", ckpt)
    said = other.stdout + other.stderr
    assert other.returncode != 0
    assert "holds checkpoints of a run with other options (--dim 32 there, 48 here; --lr 0.006 there, 0.01 here)" in said
    assert "resumed from" not in said and "trained " not in said

    # Only what may differ on resume: the run's length, checkpoint interval, logging
    same = train(tmp_path, *SMALL, "--steps", "4", "--save", ckpt, "--save-every", "4", "--log-every", "1")
    assert same.returncode == 0, same.stderr[-3000:]
    assert "step 2 of 4" in same.stdout and "trained 2 steps" in same.stdout
