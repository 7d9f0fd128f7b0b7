"""fp4_dist/buffers/shard_buffer.py: the views agree with the layout (packed = element / 2)."""

import pytest
import torch

from fp4_dist.buffers import ShardBuffer, build_layout

NUMELS = [40 * 48, 33 * 80, 16 * 16, 2 * 144]


@pytest.mark.parametrize("dp", [1, 2, 3, 5, 7], ids=lambda d: f"dp{d}")
def test_master_pieces_of_all_ranks_reassemble_every_weight(dp):
    layout = build_layout(NUMELS, dp, bucket_numel=3000, align=2)
    full = [torch.randn(n) for n in NUMELS]
    rebuilt = [torch.full((n,), float("nan")) for n in NUMELS]
    for rank in range(dp):
        buf = ShardBuffer(layout, rank, packed=True)
        for i, piece in enumerate(buf.pieces):
            if piece is None:
                continue
            buf.master_piece(i).copy_(full[i][piece.span.start:piece.span.end])
            assert buf.start_offset(i) == piece.span.start
        # The same values read back through the bucket views of the buffer layout.
        for i, piece in enumerate(buf.pieces):
            if piece is not None:
                bucket = layout.buckets[piece.bucket]
                local = layout.weights[i].span.start + piece.span.start - bucket.shard(rank).start
                got = buf.bucket_master(piece.bucket)[local:local + piece.span.numel]
                rebuilt[i][piece.span.start:piece.span.end] = got
    for i in range(len(NUMELS)):
        assert torch.equal(rebuilt[i], full[i])


def test_packed_param_views_are_half_the_elements_and_shards_cover_only_own_bytes():
    layout = build_layout(NUMELS, 3, align=2)
    buf = ShardBuffer(layout, 1, packed=True)
    assert buf.param.numel() == layout.total // 2 and buf.param.dtype == torch.uint8
    for i, n in enumerate(NUMELS):
        assert buf.param_view(i).numel() == n // 2
    shard = buf.shard_param_view(0)
    assert shard.numel() == layout.buckets[0].shard_numel // 2
    assert shard.data_ptr() == buf.param.data_ptr() + layout.buckets[0].shard(1).start // 2


def test_dense_buffer_keeps_the_param_dtype():
    buf = ShardBuffer(build_layout([7, 5], 2), 0, packed=False, param_dtype=torch.bfloat16)
    assert buf.param.dtype == torch.bfloat16 and buf.param.numel() == buf.layout.total


def test_packed_buffer_refuses_odd_numel():
    with pytest.raises(ValueError, match="odd number of elements"):
        ShardBuffer(build_layout([15], 1), 0, packed=True)


def test_check_shards_names_the_weight_whose_shard_does_not_match_the_layout():
    buf = ShardBuffer(build_layout(NUMELS, 2, align=2), 0, packed=True)
    masters, starts = buf.master_pieces(), buf.start_offsets()
    buf.check_shards(masters, starts)  # the buffer's own pieces pass
    bad = list(masters)
    i = next(i for i, m in enumerate(masters) if m is not None)
    bad[i] = masters[i][:-2]
    with pytest.raises(ValueError, match=f"fc{i}: rank 0"):
        buf.check_shards(bad, starts, names=[f"fc{j}" for j in range(len(NUMELS))])
    shifted = list(starts)
    shifted[i] = starts[i] + 2
    with pytest.raises(ValueError, match="buffer layout assigns"):
        buf.check_shards(masters, shifted)
