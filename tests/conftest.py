import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # The longest tests first (Megatron launches, then the other multi-process ones): pytest-xdist workers take
    # tests in this order, so no worker is left with a long one while the others have finished.
    items.sort(key=lambda item: 0 if "megatron" in item.keywords and "distributed" in item.keywords
               else 1 if "distributed" in item.keywords else 2)  # fmt: skip
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: see README 'GPU tests')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def dispatches(monkeypatch):
    """The ops that reach NVFP4Tensor.__torch_dispatch__ while the test runs, in order."""
    from fp4_dist.tensor import NVFP4Tensor

    seen = []
    original = NVFP4Tensor.__dict__["__torch_dispatch__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(NVFP4Tensor, "__torch_dispatch__", classmethod(counting))
    return seen


@pytest.fixture
def launches(monkeypatch):
    """The stage kernels launched while the test runs (their names, in order), counted by wrapping (not mocking)
    the one function every CUDA launch of fp4_dist goes through; clear it with ``launches.clear()``."""
    from fp4_dist.kernels import _launch

    names = []
    real = _launch._launch

    def counting(index, key, units, args):
        names.append(key[0])
        return real(index, key, units, args)

    monkeypatch.setattr(_launch, "_launch", counting)
    return names
