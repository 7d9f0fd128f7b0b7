"""`fp4_dist.cast.sharded.ShardedCast` and the bound-cast cache of cast_master_weights_to_nvfp4, in one
process. Multi-rank parity of ShardedCast (ws 1-6, gloo) is in tests/distributed/suite_cast.py and suite_train.py.
"""

import random

import pytest
import torch

import fp4_dist
from fp4_dist.buffers import ShardBuffer, build_layout
from fp4_dist.cast import master_weights as cast_mod
from fp4_dist.cast import cast_master_weights_to_nvfp4
from fp4_dist.cast.collectives import CommStats
from fp4_dist.cast.core import BINDINGS
from fp4_dist.cast.sharded import ShardedCast
from fp4_dist.tensor import NVFP4Tensor
from fp4_dist.testing import assert_bytes_equal, awkward_shapes, poison_, random_weight

FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv")


def buffered_weights(shapes, masters):
    buf = ShardBuffer(build_layout([m * k for m, k in shapes], 1, align=2), 0, packed=True)
    poison_(buf.param)
    ws = [NVFP4Tensor.empty(s) for s in shapes]
    for i, w in enumerate(ws):
        poison_(w.rowwise_scale_inv)
        poison_(w.amax)
        w.set_rowwise_storage(buf.param_view(i))
        buf.master_piece(i).copy_(masters[i].view(-1))
    return buf, ws


def test_sharded_cast_of_one_rank_equals_quantize_with_columnwise_copies():
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    shapes = awkward_shapes(rng, 6, max_m=70) + [(34, 80)]
    shapes = [(m + m % 2, k) for m, k in shapes]
    masters = [random_weight(m, k, generator=gen, heavy_tailed=i % 2 == 0) for i, (m, k) in enumerate(shapes)]
    buf, ws = buffered_weights(shapes, masters)
    cast = ShardedCast.from_buffer(ws, buf)
    for step in range(2):  # the second step re-quantizes new master values in the same bound buffers
        if step:
            for i, m in enumerate(masters):
                m.mul_(-3.0)
                buf.master_piece(i).copy_(m.view(-1))
        cast.cast()
        cast.gather_scales()
        cast.after_gather()
        for i, (w, m) in enumerate(zip(ws, masters)):
            ref = fp4_dist.quantize(m.to(torch.bfloat16))
            ref.make_columnwise()
            for f in FIELDS:
                assert_bytes_equal(getattr(w, f), getattr(ref, f), f"step {step} weight {i} {shapes[i]} {f}")


def test_sharded_cast_raises_naming_the_weight_on_a_non_finite_master_before_writing_bytes():
    shapes = [(32, 48), (16, 16)]
    masters = [random_weight(m, k) for m, k in shapes]
    masters[1][3, 5] = float("inf")
    buf, ws = buffered_weights(shapes, masters)
    before = buf.param.clone()
    with pytest.raises(ValueError, match=r"model_weights\[1\].*not finite"):
        ShardedCast.from_buffer(ws, buf, columnwise=False).cast(stats=CommStats())
    assert torch.equal(buf.param, before)


def test_second_cast_with_the_same_tensors_skips_the_checks_and_writes_new_bytes(monkeypatch):
    shapes = [(32, 48), (20, 80)]
    masters = [random_weight(m, k).view(-1) for m, k in shapes]
    ws = [NVFP4Tensor.empty(s) for s in shapes]
    BINDINGS.clear()
    calls = []
    real = cast_mod._check_shard
    monkeypatch.setattr(cast_mod, "_check_shard", lambda *a: (calls.append(1), real(*a))[1])
    for step in range(3):
        for m in masters:
            m.normal_()
        cast_master_weights_to_nvfp4(ws, masters, [0, 0])
        for i, (w, m) in enumerate(zip(ws, masters)):
            ref = fp4_dist.quantize(m.view(shapes[i]).to(torch.bfloat16))
            assert_bytes_equal(w.rowwise_data, ref.rowwise_data, f"step {step} weight {i}")
    assert len(calls) == 2  # checked on the first call only
    other = [m.clone() for m in masters]  # new tensors: a new key, checked again
    cast_master_weights_to_nvfp4(ws, other, [0, 0])
    assert len(calls) == 4


def test_cached_cast_still_refuses_a_new_bad_shard():
    ws = [NVFP4Tensor.empty((16, 32))]
    good = torch.randn(512)
    cast_master_weights_to_nvfp4(ws, [good], [0])
    with pytest.raises(ValueError, match="contiguous"):
        cast_master_weights_to_nvfp4(ws, [torch.randn(1024)[::2]], [0])
    with pytest.raises(TypeError, match="int element offset"):
        cast_master_weights_to_nvfp4(ws, [good], [0.0])
