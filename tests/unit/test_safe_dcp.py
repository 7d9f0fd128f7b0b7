"""`fp4_dist.checkpoint.load_distributed_checkpoint`: a DCP checkpoint loads as dcp.load loads it, and neither its
``.metadata`` file nor a non-tensor entry of its state dict can run code (dcp.load unpickles both in full)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fp4_dist.checkpoint import SafeReader, UnsafeCheckpointError, load_distributed_checkpoint
from fp4_dist.checkpoint.safe_dcp import SafeLoadPlanner

from .pickle_payload import GLOBAL, TouchOnLoad, assert_refused


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
            "optimizer": {"step": seed, "param_groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.95), "name": "x"}]}}


def test_a_checkpoint_loads_as_dcp_loads_it(tmp_path):
    dcp.save(_state(3), checkpoint_id=tmp_path / "ck")
    want, got = _state(5), _state(5)
    dcp.load(want, checkpoint_id=tmp_path / "ck")
    load_distributed_checkpoint(got, tmp_path / "ck")
    assert torch.equal(got["model"]["w"], _state(3)["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["optimizer"] == want["optimizer"] == _state(3)["optimizer"]
    assert SafeReader(tmp_path / "ck").read_metadata().state_dict_metadata.keys() == \
        dcp.FileSystemReader(tmp_path / "ck").read_metadata().state_dict_metadata.keys()  # fmt: skip


def test_a_metadata_file_that_would_run_code_is_refused(tmp_path):
    dcp.save(_state(3), checkpoint_id=tmp_path / "ck")
    metadata, marker = tmp_path / "ck" / ".metadata", tmp_path / "ran"
    real = pickle.loads(metadata.read_bytes())
    real.storage_meta.modules = [TouchOnLoad(marker)]  # a field the loader never reads: only unpickling runs it
    metadata.write_bytes(pickle.dumps(real))
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_distributed_checkpoint(_state(5), tmp_path / "ck")
    assert_refused(refused.value, metadata, marker)
    dcp.FileSystemReader(tmp_path / "ck").read_metadata()  # what dcp.load does: the payload runs
    assert marker.exists()


def test_a_state_dict_entry_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    state = _state(3)
    state["optimizer"]["step"] = TouchOnLoad(marker)  # a non-tensor entry: pickled whole by dcp.save
    dcp.save(state, checkpoint_id=tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError, match="optimizer.step") as refused:
        load_distributed_checkpoint(_state(5), tmp_path / "ck")
    assert GLOBAL in str(refused.value) and "trusted=True" in str(refused.value) and not marker.exists()
    # A planner of the caller's: DCP's own unpickles in full, so it is refused unless trusted; ours takes its options
    with pytest.raises(TypeError, match="SafeLoadPlanner with the same arguments"):
        load_distributed_checkpoint(_state(5), tmp_path / "ck", planner=DefaultLoadPlanner(allow_partial_load=True))
    with pytest.raises(UnsafeCheckpointError, match="optimizer.step"):
        load_distributed_checkpoint(_state(5), tmp_path / "ck", planner=SafeLoadPlanner(allow_partial_load=True))
    assert not marker.exists()
    load_distributed_checkpoint(_state(5), tmp_path / "ck", trusted=True)  # as dcp.load: the payload runs
    assert marker.exists()
