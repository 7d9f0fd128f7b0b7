"""fp4_dist.fsdp.wire: what ranks send FSDP2's all-gather for an NVFP4 weight, and how the gathered bytes are read."""

from __future__ import annotations

import pytest
import torch

import fp4_dist
from fp4_dist.format import TILE, tile_grid
from fp4_dist.fsdp import wire
from fp4_dist.testing import assert_bytes_equal, random_weight


def _rank_inputs(q, m: int, k: int, world: int):
    """Each rank's (packed bands, tile scale bands, amax) cut from a whole-weight quantize, as the cast leaves them."""
    grid = q.rowwise_scale_inv[0:m:TILE, :tile_grid(m, k)[1]]
    rows = m // world
    return [(q.rowwise_data[r * rows:(r + 1) * rows].contiguous(),
             grid[r * rows // TILE:(r + 1) * rows // TILE].contiguous(), q.amax) for r in range(world)]  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", [(96, 80), (48, 4096), (144, 16)])
def test_gathered_inputs_unpack_to_the_whole_weights_bytes_and_scales(world, shape):
    m, k = shape
    q = fp4_dist.quantize(random_weight(m, k, generator=torch.Generator().manual_seed(m + k)))
    sent = [wire.pack(*inputs, world) for inputs in _rank_inputs(q, m, k, world)]
    # FSDP2 concatenates every rank's inputs in rank order; metadata is rank 0's
    outputs = tuple(torch.cat([s[0][i] for s in sent]) for i in range(len(sent[0][0])))
    data, scales, amax = wire.unpack(outputs, sent[0][1], tile_grid(*shape))
    assert_bytes_equal(data, q.rowwise_data, "gathered rowwise data")
    assert_bytes_equal(scales, q.rowwise_scale_inv[0:m:TILE, :tile_grid(m, k)[1]], "gathered tile grid")
    assert_bytes_equal(amax, q.amax, "amax")
    assert sum(t.numel() * t.element_size() for s in sent for t in s[0]) + (0 if world > 1 else scales.numel()) \
        == wire.gathered_bytes(shape, "nvfp4")
    out = torch.empty(m, k, dtype=torch.bfloat16)
    fp4_dist.kernels.dequantize([data], [scales], [amax], [out])
    assert_bytes_equal(out, q.dequantize(torch.bfloat16), "dequantize of the gathered bytes")


def test_bf16_rows_are_padded_to_fsdps_shard_size_and_counted_at_two_bytes():
    values = torch.randn(5, 32, dtype=torch.bfloat16)
    (sent,) = wire.pack_rows(values, 17, 3)  # ceil(17 / 3) = 6 rows per rank
    assert sent.shape == (6, 32) and torch.equal(sent[:5], values) and not sent[5].any()
    assert wire.gathered_bytes((17, 32), "bf16") == 2 * 17 * 32


def test_a_shard_that_is_not_whole_tile_bands_is_refused():
    assert wire.local_tiles((64, 48), 16, 32) == (3, 9)
    with pytest.raises(ValueError, match="whole 16-row tile bands"):
        wire.local_tiles((64, 48), 8, 16)


def test_scale_views_follow_the_owner_scales_order_one_weight_after_another():
    shapes, rows = [(64, 48), (32, 16)], [32, 16]
    tiles = [wire.local_tiles(s, 0, r) for s, r in zip(shapes, rows)]
    compact = torch.arange(sum(b - a for a, b in tiles), dtype=torch.uint8)
    a, b = wire.scale_views(compact, shapes, tiles, rows)
    assert a.shape == (2, 3) and b.shape == (1, 1)
    assert a.flatten().tolist() == list(range(6)) and b.item() == 6
