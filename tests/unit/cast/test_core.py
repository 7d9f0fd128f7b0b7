"""fp4_dist.cast.core: the shard cast every public cast is built on (one process; the distributed suites
run it across ranks through the three public casts)."""

from __future__ import annotations

import pytest
import torch

import fp4_dist
from fp4_dist import kernels
from fp4_dist.cast.core import CastCore, plan_for, shard_bytes
from fp4_dist.testing import assert_bytes_equal, poison_, random_weight

SHAPES = [(33, 80), (48, 16), (20, 144)]


def _core(weights, masters, exchanged):
    plan = plan_for(weights)

    def fused(g, block, enc):
        ws = [weights[i] for i in g.indices]
        return kernels.bind_fused_scale(block, g.shapes, [w.rowwise_scale_inv for w in ws], [w.amax for w in ws],
                                        enc, numerics=g.numerics)  # fmt: skip

    entries = {"all": None, "tensor amaxes": plan.tensor_amax_entries(),
               "every entry": list(range(plan.amax_numel))}[exchanged]  # fmt: skip
    frags = [shard_bytes(w.rowwise_data, m, 0) for w, m in zip(weights, masters)]
    return CastCore(plan, masters, [0] * len(weights), frags, fused, names=[f"w{i}" for i in range(len(weights))],
                    exchanged=entries, device="cpu")  # fmt: skip


def _weights_and_masters(seed):
    gen = torch.Generator().manual_seed(seed)
    full = [random_weight(m, k, generator=gen) for m, k in SHAPES]
    weights = [fp4_dist.NVFP4Tensor.empty(s, dtype=torch.float16 if i == 1 else torch.bfloat16)
               for i, s in enumerate(SHAPES)]  # fmt: skip
    for w in weights:
        poison_(w.rowwise_data), poison_(w.rowwise_scale_inv), poison_(w.amax)
    return full, weights, [f.reshape(-1) for f in full]


@pytest.mark.parametrize("exchanged", ["all", "tensor amaxes", "every entry"])
def test_a_rank_owning_everything_writes_quantizes_bytes_whatever_it_exchanges(exchanged):
    full, weights, masters = _weights_and_masters(1)
    core = _core(weights, masters, exchanged)
    assert core.launches == 3 * 2, "one launch per stage per (dtype, numerics) group"
    for _ in range(2):
        core.local_amaxes()
        core.exchange(local=True)
        core.scales()
        core.cast()
        for f, w in zip(full, weights):
            ref = fp4_dist.quantize(f.to(w.dtype))
            for field in ("rowwise_data", "rowwise_scale_inv", "amax"):
                assert_bytes_equal(getattr(w, field), getattr(ref, field), f"{list(w.shape)} {field}")


def test_a_non_finite_master_raises_naming_the_weight_before_any_byte_is_written():
    full, weights, masters = _weights_and_masters(2)
    masters[2][77] = float("inf")
    core = _core(weights, masters, "tensor amaxes")
    before = [w.rowwise_data.clone() for w in weights]
    core.local_amaxes()
    with pytest.raises(ValueError, match=r"w2: values are not finite"):
        core.exchange(local=True)
    assert all(torch.equal(b, w.rowwise_data) for b, w in zip(before, weights))
