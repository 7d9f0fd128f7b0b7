"""The CPU stand-ins Megatron needs: active only while enabled, fully undone by disable()."""

from __future__ import annotations

import pytest
import torch

from fp4_dist.megatron import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer refuses to run beside CUDA")


@pytest.fixture
def compat():
    cpu_compat.enable()
    yield
    cpu_compat.disable()


def test_cuda_devices_map_to_cpu_and_cpu_tensors_report_cuda_type_strings(compat):
    t = torch.zeros(3, device="cuda", dtype=torch.bfloat16)
    assert t.device.type == "cpu" and torch.ones(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert t.type() == "torch.cuda.BFloat16Tensor" and t.cuda() is t
    assert t.type(torch.float32).dtype == torch.float32  # conversions are untouched


def test_cuda_rng_api_is_a_private_generator_that_leaves_the_cpu_generator_alone(compat):
    torch.manual_seed(5)
    cpu_before = torch.get_rng_state()
    torch.cuda.manual_seed(123)
    state = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(7)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.equal(torch.get_rng_state(), cpu_before)


def test_disable_restores_torch_exactly():
    names = ("current_device", "current_stream", "Stream", "synchronize", "manual_seed", "get_rng_state")
    before = {n: getattr(torch.cuda, n) for n in names}
    from torch import _dynamo

    dynamo = _dynamo.config.disable
    cpu_compat.enable()
    cpu_compat.enable()  # idempotent
    assert _dynamo.config.disable
    cpu_compat.disable()
    cpu_compat.disable()
    assert {n: getattr(torch.cuda, n) for n in names} == before and _dynamo.config.disable == dynamo
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_compile_runs_eagerly_on_cpu_ranks_without_importing_dynamo():
    # A fresh interpreter: nothing has imported dynamo yet, as on a Megatron CPU rank before megatron is imported.
    import subprocess
    import sys

    code = """
import sys, torch
from fp4_dist.megatron import cpu_compat
real = torch.compile
def f(x):
    return x + 1
cpu_compat.enable()
assert torch.compile(f) is f and torch.compile(mode="max-autotune")(f) is f
assert "torch._dynamo" not in sys.modules, "dynamo imported"
cpu_compat.disable()
assert torch.compile is real
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(__import__("os").environ, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_gloo_coalescing_collects_async_work_and_waits_for_all():
    gloo = cpu_compat.GlooCoalescing()

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    collective = gloo.wrap(lambda *a, **k: Work())
    with gloo.manager(None, async_ops=True) as cm:
        collective()
        collective()
    assert Work.waited == 0
    cm.wait()
    assert Work.waited == 2
    collective()  # outside a manager: nothing is collected
    cm.wait()
    assert Work.waited == 2
