"""`kernels.outputs`: a kernel's output is allocated without the fill of torch's deterministic mode, and the mode's
setting is left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.utils.deterministic as deterministic
from torch.profiler import profile

from fp4_dist.kernels import outputs


def _fills(make) -> int:
    with profile() as prof:
        make()
    return sum(e.name == "aten::fill_" for e in prof.events())


@pytest.fixture
def deterministic_mode():
    before = torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(before[0])
    deterministic.fill_uninitialized_memory = before[1]


def test_under_deterministic_mode_torch_empty_fills_and_an_output_does_not(deterministic_mode):
    assert _fills(lambda: torch.empty(64, 32, dtype=torch.uint8)) == 1  # what the helper leaves out
    assert _fills(lambda: outputs.empty(64, 32, dtype=torch.uint8, device="cpu")) == 0
    assert deterministic.fill_uninitialized_memory is True
    with outputs.unfilled():
        assert _fills(lambda: torch.empty(8, dtype=torch.float32)) == 0
    assert deterministic.fill_uninitialized_memory is True


def test_the_fill_setting_comes_back_after_an_error(deterministic_mode):
    with pytest.raises(ValueError), outputs.unfilled():
        raise ValueError("a kernel's argument check")
    assert deterministic.fill_uninitialized_memory is True
    assert _fills(lambda: torch.empty(8)) == 1


def test_outside_deterministic_mode_nothing_changes():
    assert not torch.are_deterministic_algorithms_enabled()
    before = deterministic.fill_uninitialized_memory
    assert _fills(lambda: outputs.empty(8, dtype=torch.float32, device="cpu")) == 0
    with outputs.unfilled():
        assert deterministic.fill_uninitialized_memory == before
