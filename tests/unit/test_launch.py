"""fp4_dist/launch.py: which launcher started us, and the single-process fallback."""

import torch

from fp4_dist import launch


def test_launcher_is_detected_from_the_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", *launch._MPI_ENV):
        monkeypatch.delenv(k, raising=False)
    assert launch.launched_by() == "single"
    monkeypatch.setenv("PMI_RANK", "0")
    assert launch.launched_by() == "mpi"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch.launched_by() == "torchrun"


def test_single_process_needs_no_process_group(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", *launch._MPI_ENV):
        monkeypatch.delenv(k, raising=False)
    info = launch.init_distributed()
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single")
    assert not torch.distributed.is_initialized()
