"""`fp4_dist.megatron.gradnorm.l2_norm_read_once`: Megatron's fallback gradient norm (no TransformerEngine or Apex)
with one device read instead of one per gradient tensor, and the same bits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import utils  # noqa: E402

from fp4_dist.megatron.gradnorm import l2_norm_read_once, make_l2_norm  # noqa: E402

pytestmark = pytest.mark.megatron


def _grads(device, n=63, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5000, (n,), generator=g)
    scales = torch.rand(n, generator=g) * 10
    return [(torch.randn(int(k), generator=g) * s).to(device) for k, s in zip(sizes, scales)]


def _upstream_formula(tensor_lists) -> float:
    """megatron.core.utils.local_multi_tensor_l2_norm's arithmetic (it builds its result on "cuda", which a CPU
    machine lacks): fp32 norms per tensor, read one by one, and their norm on the host."""
    return float(torch.norm(torch.tensor([[float(torch.norm(t)) for t in ts] for ts in tensor_lists])))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_norm_equals_upstreams_bit_for_bit_on_the_cpu(seed):
    grads = _grads("cpu", seed=seed)
    got, per_tensor = l2_norm_read_once(2048 * 32, None, [grads], False)
    assert per_tensor is None and got.dtype == torch.float32 and tuple(got.shape) == (1,)
    assert float(got) == _upstream_formula([grads])


def test_the_fallback_is_replaced_and_an_accelerated_kernel_is_kept():
    assert make_l2_norm(utils.local_multi_tensor_l2_norm) is l2_norm_read_once

    def fused(*args):  # TransformerEngine's or Apex's multi_tensor_l2norm: reads nothing, stays
        raise AssertionError("not called")

    assert make_l2_norm(fused) is fused


@pytest.mark.gpu
def test_on_a_gpu_it_equals_upstream_and_reads_the_device_once_not_once_per_tensor():
    grads = _grads("cuda")
    want, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    torch.cuda.synchronize()
    waits = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, _ = l2_norm_read_once(2048 * 32, None, [grads], False)
        waits = [w for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device == want.device and torch.equal(got, want)
    assert len(waits) <= 2, f"{len(waits)} synchronising calls for {len(grads)} tensors"
