"""`examples.megatron_checkpoint.load_checkpoint` reads common.pt, rng.pt and model.pt weights-only, before it
restores anything: one that carries code is refused before that code runs. (Genuine checkpoints resume bit for
bit: the resume suite of tests/distributed/megatron_suite.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from examples.megatron_checkpoint import LATEST, iteration_dir, load_checkpoint
from fp4_dist.checkpoint.safe_load import UnsafeCheckpointError

from ..pickle_payload import TouchOnLoad, assert_refused


def write_checkpoint(root, payload_in: str, payload) -> None:
    """The three files `load_checkpoint` reads itself, as `save_checkpoint` lays them out, with `payload` added
    to the one named `payload_in`."""
    folder = iteration_dir(str(root), 10)
    folder.mkdir(parents=True)
    files = {
        "common.pt": {"iteration": 10, "config": {"seed": 7}, "optimizer": {}, "scheduler": {}},
        "rng.pt": {"world_size": 1, "states": [{"python": random.getstate(), "numpy": np.random.get_state(),
                                                "torch": torch.get_rng_state(), "tracker": {}}]},
        "model.pt": {"embedding.weight": torch.ones(4, 8, dtype=torch.bfloat16)},
    }  # fmt: skip
    files[payload_in]["x"] = payload
    for name, state in files.items():
        torch.save(state, folder / name)
    (root / LATEST).write_text("10")


@pytest.mark.parametrize("name", ["common.pt", "rng.pt", "model.pt"])
def test_a_file_carrying_code_is_refused_before_it_runs_and_before_anything_is_restored(tmp_path, name):
    marker = tmp_path / "payload_ran"
    write_checkpoint(tmp_path, name, TouchOnLoad(marker))
    # No model, optimizer or scheduler: the refusal comes before anything would touch them.
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint(str(tmp_path), None, None, None, {"seed": 7})
    assert_refused(refused.value, iteration_dir(str(tmp_path), 10) / name, marker)


def test_a_checkpoint_from_before_the_tensor_parallel_size_was_recorded_resumes_at_size_1_only(tmp_path):
    write_checkpoint(tmp_path, "common.pt", 0)  # its config holds no tensor_model_parallel_size
    with pytest.raises(ValueError, match="before its tensor-parallel size was recorded"):
        load_checkpoint(str(tmp_path), None, None, None, {"seed": 7, "tensor_model_parallel_size": 2})
