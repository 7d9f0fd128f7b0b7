"""fp4_dist.fsdp.dequant_batch: a parameter group's gathered weights are dequantized together, once the group is
complete, and nothing is left unwritten (CPU path; the CUDA launch is the same `kernels.dequantize`, covered by
tests/unit/kernels/test_stages_dequantize.py on the GPU)."""

from __future__ import annotations

import pytest
import torch

import fp4_dist
from fp4_dist.format import tile_grid
from fp4_dist.fsdp.dequant_batch import DequantBatch, check_flushed
from fp4_dist.testing import random_weight

SHAPES = [(48, 80), (32, 144), (16, 16)]


def gathered(shape, seed):
    """(data, scale form, amax, expected bf16 values) of one weight; odd seeds give the compact tile grid (as
    FSDP2 gathers it), even ones the row-expanded form (a weight quantized after a bf16 gather)."""
    w = fp4_dist.quantize(random_weight(*shape, generator=torch.Generator().manual_seed(seed)))
    scales = w.rowwise_scale_inv
    if seed % 2:
        tm, tk = tile_grid(*shape)
        scales = scales[: tm * 16 : 16, :tk].contiguous()
    return w.rowwise_data, scales, w.amax, w.dequantize(torch.bfloat16)


def test_a_group_is_dequantized_when_its_last_weight_arrives_and_not_before():
    batch = DequantBatch(len(SHAPES))
    outs = [torch.full(s, float("nan"), dtype=torch.bfloat16) for s in SHAPES]  # poisoned: unwritten values show
    parts = [gathered(s, seed) for seed, s in enumerate(SHAPES)]
    for i, ((data, scales, amax, _), out) in enumerate(zip(parts, outs)):
        batch.add(i, data, scales, amax, out)
        if i < len(SHAPES) - 1:
            assert torch.isnan(outs[0]).all() and batch.pending
    assert not batch.pending
    for out, (*_, want) in zip(outs, parts):
        assert torch.equal(out, want)


def test_a_weight_gathered_again_before_its_group_completes_flushes_what_is_queued():
    batch = DequantBatch(3)
    outs = [torch.full(s, float("nan"), dtype=torch.bfloat16) for s in SHAPES[:2]]
    parts = [gathered(s, seed) for seed, s in enumerate(SHAPES[:2])]
    batch.add("a", *parts[0][:3], outs[0])
    batch.add("b", *parts[1][:3], outs[1])
    batch.add("a", *parts[0][:3], outs[0])  # "a" again: "a" and "b" go now, the second "a" waits
    assert torch.equal(outs[1], parts[1][3]) and batch.pending


def test_a_group_left_half_queued_after_the_forward_is_written_and_reported():
    batch = DequantBatch(2)
    out = torch.full(SHAPES[0], float("nan"), dtype=torch.bfloat16)
    data, scales, amax, want = gathered(SHAPES[0], 1)
    batch.add("only", data, scales, amax, out)
    with pytest.raises(RuntimeError, match="1 of 2"):
        check_flushed([batch])
    assert torch.equal(out, want) and not batch.pending
