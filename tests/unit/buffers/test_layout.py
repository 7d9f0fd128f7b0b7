"""fp4_dist/buffers/layout.py: element layout, packed = element / 2, shard ranges, buckets, cut tiles."""

import random

import pytest

from fp4_dist.buffers.layout import Span, build_layout, cut_tiles

DP_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]


def random_numels(rng, n):
    # NVFP4 weights: K % 16 == 0, ragged M; plus some tiny ones.
    return [rng.randint(1, 70) * 16 * rng.choice([1, 3, 5]) * rng.randint(1, 9) for _ in range(n)]


def owners(layout, rank_count):
    """Element -> rank map of every weight, built from `pieces` (brute force)."""
    own = [[None] * n for n in layout.numels]
    for rank in range(rank_count):
        for piece in layout.pieces(rank):
            if piece is None:
                continue
            for e in range(piece.span.start, piece.span.end):
                assert own[piece.weight][e] is None, "two ranks own one element"
                own[piece.weight][e] = rank
    return own


@pytest.mark.parametrize("dp", DP_SIZES, ids=lambda d: f"dp{d}")
@pytest.mark.parametrize("bucket_numel", [None, 1, 3000], ids=lambda b: f"bucket{b}")
def test_every_rank_boundary_is_even_and_pieces_cover_each_weight_once(dp, bucket_numel):
    rng = random.Random(dp * 1000 + (bucket_numel or 0))
    numels = random_numels(rng, 9) + [16, 48, 80 * 3]
    layout = build_layout(numels, dp, bucket_numel=bucket_numel)
    assert layout.total % (2 * dp) == 0
    for bucket in layout.buckets:
        assert bucket.span.numel == dp * bucket.shard_numel
        for rank in range(dp):
            shard = bucket.shard(rank)
            assert shard.start % 2 == 0 and shard.end % 2 == 0
            assert shard.start % layout.align == 0
    own = owners(layout, dp)
    assert all(None not in per_weight for per_weight in own)


@pytest.mark.parametrize("dp", DP_SIZES, ids=lambda d: f"dp{d}")
def test_packed_offsets_are_exactly_half_the_element_offsets(dp):
    layout = build_layout([48 * 40, 64 * 64, 16 * 16, 272 * 80], dp, bucket_numel=5000)
    for slot in layout.weights:
        assert slot.span.packed() == Span(slot.span.start // 2, slot.span.end // 2)
    for bucket in layout.buckets:
        for rank in range(dp):
            shard = bucket.shard(rank)
            packed = shard.packed()
            assert (packed.start * 2, packed.end * 2) == (shard.start, shard.end)


def test_master_offsets_tile_the_rank_shard_without_gaps_or_overlap():
    layout = build_layout([1600, 336, 4096, 80 * 48, 16], 3, bucket_numel=2000)
    for rank in range(3):
        used = []
        for piece in layout.pieces(rank):
            if piece is not None:
                used.append((piece.master_offset, piece.master_offset + piece.span.numel))
                # The master offset maps back to the same buffer element.
                bucket = layout.buckets[piece.bucket]
                buffer_pos = layout.weights[piece.weight].span.start + piece.span.start
                local = buffer_pos - bucket.shard(rank).start
                assert piece.master_offset == layout.bucket_master_offset(piece.bucket) + local
        used.sort()
        for (a0, a1), (b0, _) in zip(used, used[1:]):
            assert a1 <= b0
        assert all(0 <= a and b <= layout.shard_numel for a, b in used)


def test_weights_start_aligned_and_never_span_two_buckets():
    layout = build_layout([100 * 16, 7 * 16, 33 * 32, 16], 5, bucket_numel=1000, align=64)
    for slot in layout.weights:
        assert slot.span.start % 64 == 0
        bucket = layout.buckets[slot.bucket]
        assert bucket.span.start <= slot.span.start and slot.span.end <= bucket.span.end
        assert slot.index in bucket.weights


def test_bucket_closes_once_it_holds_bucket_numel_elements():
    layout = build_layout([600, 600, 600, 600, 600], 2, bucket_numel=1000)
    assert [b.weights for b in layout.buckets] == [(0, 1), (2, 3), (4,)]
    assert len(build_layout([600] * 5, 2).buckets) == 1


def test_layout_is_identical_on_every_rank_and_deterministic():
    a = build_layout([480, 1600, 96], 6, bucket_numel=700)
    b = build_layout([480, 1600, 96], 6, bucket_numel=700)
    assert a == b and hash(a) == hash(b)


def test_cuts_are_the_rank_boundaries_inside_a_weight():
    layout = build_layout([64 * 64], 3)
    # 4096 elements padded to 3*64 multiples: 4224, shards of 1408.
    assert layout.cuts(0) == (1408, 2816)


@pytest.mark.parametrize("bad", [dict(dp_size=0), dict(dp_size=2, align=3), dict(dp_size=2, bucket_numel=0)])
def test_build_layout_rejects_bad_arguments(bad):
    dp = bad.pop("dp_size")
    with pytest.raises(ValueError):
        build_layout([256], dp, **bad)


def test_build_layout_rejects_non_positive_numel_naming_the_weight():
    with pytest.raises(ValueError, match="weight 1"):
        build_layout([256, 0], 2)


def test_pieces_rejects_rank_outside_group():
    with pytest.raises(ValueError, match="rank 3"):
        build_layout([256], 3).pieces(3)


def brute_cut_tiles(m, k, cut):
    hit = set()
    tiles_k = -(-k // 16)
    for tr in range(-(-m // 16)):
        for tc in range(tiles_k):
            idx = [r * k + c for r in range(16 * tr, min(16 * tr + 16, m))
                   for c in range(16 * tc, min(16 * tc + 16, k))]
            if min(idx) < cut <= max(idx):
                hit.add(tr * tiles_k + tc)
    return hit


@pytest.mark.parametrize("m,k", [(40, 48), (33, 80), (16, 16), (17, 32), (64, 16)], ids=lambda v: str(v))
def test_cut_tiles_matches_brute_force_for_every_even_cut(m, k):
    for cut in range(2, m * k, 2):
        first, last = cut_tiles((m, k), cut)
        assert set(range(first, last)) == brute_cut_tiles(m, k, cut), f"cut {cut}"


@pytest.mark.parametrize("dp", DP_SIZES, ids=lambda d: f"dp{d}")
def test_packed_layout_of_an_element_layout_is_every_range_halved(dp):
    from fp4_dist.buffers.layout import packed_layout_of

    layout = build_layout(random_numels(random.Random(dp), 9), dp, bucket_numel=20000)
    index = {i: (s.span.start, s.span.end, s.bucket) for i, s in enumerate(layout.weights)}
    buckets = [(b.span.start, b.span.end) for b in layout.buckets]
    packed, packed_buckets, unpadded = packed_layout_of(index, buckets, dp)
    assert packed == {i: (s // 2, e // 2, b) for i, (s, e, b) in index.items()}
    assert packed_buckets == [(s // 2, e // 2) for s, e in buckets]
    last = {b: max(e for _, e, bb in index.values() if bb == b) for b in range(len(buckets))}
    assert unpadded == sum((last[b] - s) // 2 for b, (s, _) in enumerate(buckets))


def test_packed_layout_of_refuses_odd_boundaries_and_uneven_buckets_by_name():
    from fp4_dist.buffers.layout import packed_layout_of

    with pytest.raises(ValueError, match="qkv.*odd boundary at element 33"):
        packed_layout_of({"w": (33, 97, 0)}, [(0, 128)], 2, {"w": "qkv"})
    with pytest.raises(ValueError, match="bucket 0, rank 0.*odd boundary at element 63"):
        packed_layout_of({"w": (0, 64, 0)}, [(0, 126)], 2)
    with pytest.raises(ValueError, match="not divisible into 3 rank shards"):
        packed_layout_of({"w": (0, 64, 0)}, [(0, 128)], 3)
