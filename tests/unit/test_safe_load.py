"""fp4_dist.checkpoint.safe_load: a checkpoint file that names code is refused before the code runs; one that holds
NVFP4 weights and plain state loads as saved."""

from __future__ import annotations

import pytest
import torch

import fp4_dist
from fp4_dist.checkpoint.safe_load import NVFP4_GLOBALS, UnsafeCheckpointError, load_checkpoint_file
from fp4_dist.testing import assert_bytes_equal

from .pickle_payload import TouchOnLoad, assert_refused


def test_a_file_that_names_a_function_is_refused_before_the_function_runs(tmp_path):
    path, marker = tmp_path / "ckpt.pt", tmp_path / "payload_ran"
    torch.save({"w": torch.ones(4), "x": TouchOnLoad(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint_file(path, NVFP4_GLOBALS)
    assert_refused(refused.value, path, marker)
    assert isinstance(refused.value, ValueError)


def test_trusted_unpickles_in_full_and_so_runs_the_payload(tmp_path):
    path, marker = tmp_path / "ckpt.pt", tmp_path / "payload_ran"
    torch.save({"x": TouchOnLoad(marker)}, path)
    load_checkpoint_file(path, trusted=True)
    assert marker.exists()


def test_nvfp4_weights_and_plain_state_load_bit_for_bit(tmp_path):
    q = fp4_dist.quantize(torch.randn(32, 48)).make_columnwise()
    path = tmp_path / "ckpt.pt"
    torch.save({"w": q, "step": 3, "name": "run", "shape": (2, 3), "dtype": torch.bfloat16}, path)
    got = load_checkpoint_file(path, NVFP4_GLOBALS)
    assert isinstance(got["w"], fp4_dist.NVFP4Tensor)
    for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv"):
        assert_bytes_equal(getattr(got["w"], f), getattr(q, f), f)
    assert (got["step"], got["name"], got["shape"], got["dtype"]) == (3, "run", (2, 3), torch.bfloat16)


class Unlisted:
    """Reaches torch's unpickler as an object to fill in (BUILD) after an allowed call made it: torch names the
    class in another form of its message than for a refused global."""

    def __reduce__(self):
        return make_unlisted, (), {"field": 1}


def make_unlisted():
    return object.__new__(Unlisted)


def test_a_refused_class_is_named_also_when_torch_refuses_to_fill_it_in(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"x": Unlisted()}, path)
    with pytest.raises(UnsafeCheckpointError, match=rf"{path} asks to unpickle {__name__}\.Unlisted, "):
        load_checkpoint_file(path, (make_unlisted,))


def test_a_load_leaves_what_torch_load_accepts_elsewhere_as_it_was(tmp_path):
    before = set(torch.serialization.get_safe_globals())
    path = tmp_path / "ckpt.pt"
    torch.save({"w": fp4_dist.quantize(torch.randn(16, 16))}, path)
    load_checkpoint_file(path, (*NVFP4_GLOBALS, make_unlisted))
    assert set(torch.serialization.get_safe_globals()) == before
    assert isinstance(torch.load(path)["w"], fp4_dist.NVFP4Tensor)  # the global allowance of the rebuild stays


def test_a_torch_whose_weights_only_load_can_be_bypassed_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(RuntimeError, match=r"needs torch 2\.6 or later: .* torch 2\.5\.1\+cpu .*CVE-2025-32434"):
        load_checkpoint_file(path)
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    assert torch.equal(load_checkpoint_file(path)["w"], torch.ones(2))


class _System:
    """A pickle that calls os.system when loaded: torch's unpickler blocks the module and says so in other words."""

    def __reduce__(self):
        import os

        return os.system, ("true",)


def test_a_call_into_a_module_torch_blocks_is_refused_by_its_name(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"x": _System()}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"asks to unpickle (posix|nt)\.system"):
        load_checkpoint_file(path)
