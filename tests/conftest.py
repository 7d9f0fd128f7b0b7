import json
from pathlib import Path

import pytest
import torch

# Seconds each test took in a whole-suite run (setup, call and teardown, under `bash scripts/test.sh`), the longest
# first; `--record-durations tests/durations.json` writes it again from the run it ends. Tests under 0.3 s are left
# out. The values only order the queue: a stale or missing entry costs time, never a test.
DURATIONS = Path(__file__).with_name("durations.json")
# A test the file does not name yet: Megatron launches and other multi-process tests take seconds, the rest less.
GUESS_S = {"megatron": 10.0, "distributed": 5.0, "other": 0.0}


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's seconds (setup + call + teardown) to PATH as JSON, the longest first "
                          "(tests/durations.json orders the queue)")  # fmt: skip


def _guess(item) -> float:
    kind = "distributed" if "distributed" in item.keywords else "other"
    return GUESS_S["megatron" if kind == "distributed" and "megatron" in item.keywords else kind]


def pytest_collection_modifyitems(config, items):
    # The longest tests first, by their recorded durations: pytest-xdist workers take tests in this order, so the
    # last test a worker takes is a short one and no worker is left with a long one while the others have finished
    # (ordering by kind alone put a 40-second unit test, the inductor compile, at the very end).
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items.sort(key=lambda item: -recorded.get(item.nodeid, _guess(item)))
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


_seconds: dict = {}


def pytest_runtest_logreport(report):
    # On the pytest-xdist controller too: the workers' reports reach it through this hook.
    if report.when in ("setup", "call", "teardown"):
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-durations")
    if path is None or hasattr(session.config, "workerinput"):  # a worker's reports reach the controller's file
        return
    kept = sorted(((k, round(v, 1)) for k, v in _seconds.items() if v >= 0.3), key=lambda kv: -kv[1])
    Path(path).write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {v}" for k, v in kept) + "\n}\n")
