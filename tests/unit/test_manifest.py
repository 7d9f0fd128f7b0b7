"""Every file a commit writes is in its manifest, and a load checks it first: one flipped byte in an export's
safetensors or an example-trainer file is refused, naming the file and offset, before anything is loaded."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fp4_dist
from examples.megatron_checkpoint import LATEST, iteration_dir, load_checkpoint
from fp4_dist.checkpoint import atomic
from fp4_dist.checkpoint.manifest import CHUNK_BYTES, MANIFEST, DamagedCheckpointError, verify_folder
from fp4_dist.export import export_compressed_tensors, load_compressed_tensors


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def committed(tmp_path, files: dict):
    with atomic.commit_folder(tmp_path / "out") as w:
        for name, data in files.items():
            w.file(name).write_bytes(data)
    return tmp_path / "out"


def test_a_flipped_byte_is_named_by_file_and_chunk(tmp_path):
    big = random.Random(0).randbytes(2 * CHUNK_BYTES + 10)
    out = committed(tmp_path, {"a.bin": big, "sub/b.txt": b"hello"})
    assert verify_folder(out)
    flip(out / "a.bin", CHUNK_BYTES + 5)
    with pytest.raises(DamagedCheckpointError) as e:
        verify_folder(out)
    assert str(e.value).startswith(f"{out / 'a.bin'}: bytes {CHUNK_BYTES}..{2 * CHUNK_BYTES - 1} (chunk 2 of 3)")
    assert "nothing was loaded" in str(e.value) and "verify=False" in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "appended", "missing", "manifest"])
def test_a_changed_length_a_missing_file_and_a_damaged_manifest_are_refused(tmp_path, damage):
    out = committed(tmp_path, {"a.bin": b"x" * 100, "b.bin": b"y" * 10})
    a = out / "a.bin"
    if damage == "truncated":
        a.write_bytes(b"x" * 99)
    elif damage == "appended":
        a.write_bytes(b"x" * 101)
    elif damage == "missing":
        a.unlink()
    else:
        flip(out / MANIFEST, 40)
    with pytest.raises(DamagedCheckpointError) as e:
        verify_folder(out)
    named = out / MANIFEST if damage == "manifest" else a
    assert str(e.value).startswith(f"{named}: "), str(e.value)


def test_a_folder_without_a_manifest_loads_with_a_one_line_note(tmp_path):
    out = committed(tmp_path, {"a.bin": b"x"})
    (out / MANIFEST).unlink()
    with pytest.warns(UserWarning, match="has no fp4_dist_manifest.json .*: loading it unverified") as caught:
        assert verify_folder(out) is False
    assert "\n" not in str(caught[0].message)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 64)).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    return model


def test_a_flipped_byte_in_an_exports_safetensors_is_refused_and_nothing_is_loaded(tmp_path):
    pytest.importorskip("safetensors")
    export_compressed_tensors(_model(0), tmp_path / "export")
    shard = tmp_path / "export" / "model.safetensors"
    flip(shard, shard.stat().st_size - 3)  # a tensor byte: safetensors itself would load it
    fresh = _model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(DamagedCheckpointError, match=f"^{shard}: bytes 0\\.\\."):
        load_compressed_tensors(fresh, tmp_path / "export")
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_compressed_tensors(fresh, tmp_path / "export", verify=False)  # the explicit way past the check


def test_a_flipped_byte_in_an_example_trainer_file_is_refused_before_any_file_is_read(tmp_path):
    # The iteration folder as `save_checkpoint` of examples/megatron_checkpoint.py commits it (its files, then swap_in).
    folder = iteration_dir(str(tmp_path), 10)
    tmp = atomic.temporary_folder(folder)
    torch.save({"iteration": 10, "config": {"seed": 7}, "optimizer": {}, "scheduler": {}}, tmp / "common.pt")
    torch.save({"world_size": 1, "states": [{"python": random.getstate(), "numpy": np.random.get_state(),
                                             "torch": torch.get_rng_state(), "tracker": {}}]}, tmp / "rng.pt")
    torch.save({"embedding.weight": torch.ones(64, 64, dtype=torch.bfloat16)}, tmp / "model.pt")
    atomic.swap_in(tmp, folder)
    atomic.write_file_atomically(tmp_path / LATEST, "10")
    flip(folder / "model.pt", 3000)
    # No model, optimizer or scheduler: the refusal comes before anything would touch them.
    with pytest.raises(DamagedCheckpointError, match=f"^{folder / 'model.pt'}: bytes 0\\.\\."):
        load_checkpoint(str(tmp_path), None, None, None, {"seed": 7})
