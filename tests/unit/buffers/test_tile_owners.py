"""buffers/tile_owners.py: every tile has one scale owner that touches it, cut tiles are exactly the shared ones,
and the gathered compact bytes map back to every tile (checked against brute force over elements)."""

import random

import pytest

from fp4_dist.buffers.layout import Span, build_layout
from fp4_dist.buffers.tile_owners import first_tile_at, scale_tiles, tile_exchange, touched_bands


def _brute_first(m, k, e):
    tk, tm = -(-k // 16), -(-m // 16)
    return next((t for t in range(tm * tk) if 16 * (t // tk) * k + 16 * (t % tk) >= e), tm * tk)


def test_first_tile_at_matches_brute_force_on_ragged_shapes():
    rng = random.Random(0)
    for _ in range(2000):
        m, k = rng.randint(1, 70), rng.choice([16, 48, 80, 128, 144])
        e = rng.randint(0, m * k)
        assert first_tile_at((m, k), e) == _brute_first(m, k, e), (m, k, e)


def test_scale_and_enc_ranges_of_an_empty_shard_are_empty():
    assert scale_tiles((32, 48), None) == (0, 0) == touched_bands((32, 48), Span(5, 5))


def _touching_ranks(layout, i, m, k):
    tk, touch = -(-k // 16), {}
    for r in range(layout.dp_size):
        p = layout.pieces(r)[i]
        if p is not None:
            for e in range(p.span.start, p.span.end):
                touch.setdefault((e // k // 16) * tk + (e % k) // 16, set()).add(r)
    return touch


@pytest.mark.parametrize("seed", range(40))
def test_each_tile_has_one_scale_owner_that_touches_it_and_shared_tiles_are_cut(seed):
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 60), rng.choice([16, 48, 80, 128])) for _ in range(rng.randint(1, 5))]
    dp = rng.randint(1, 6)
    layout = build_layout([m * k for m, k in shapes], dp, align=rng.choice([2, 2, 64]),
                          bucket_numel=rng.choice([None, 500, 3000]))
    order = list(range(len(shapes)))
    rng.shuffle(order)
    ex = tile_exchange(layout, shapes, order)
    for i, (m, k) in enumerate(shapes):
        tiles = -(-m // 16) * -(-k // 16)
        touch = _touching_ranks(layout, i, m, k)
        owner = {}
        for r in range(dp):
            a, b = ex.scale[r][i]
            lo, hi = ex.enc[r][i]
            for t in range(a, b):
                assert t not in owner and r in touch[t], f"weight {i} tile {t}"
                owner[t] = r
            assert all(lo <= t < hi for t, rs in touch.items() if r in rs), f"enc range of rank {r} misses a tile"
        assert sorted(owner) == list(range(tiles))
        assert sorted(t for t, rs in touch.items() if len(rs) > 1) == list(ex.cut[i])
        for t in range(tiles):
            tile_start, offset = [s for s in ex.sources[i] if s[0] <= t][-1]
            assert owner[t] * ex.cap <= t + offset < (owner[t] + 1) * ex.cap


def test_compact_bytes_of_a_rank_follow_the_given_weight_order():
    layout = build_layout([32 * 16, 16 * 32], 1, align=2)
    ex = tile_exchange(layout, [(32, 16), (16, 32)], order=[1, 0])
    assert ex.sources[1] == ((0, 0),) and ex.sources[0] == ((0, 2),)  # weight 1's 2 tiles come first


def test_tile_exchange_refuses_shapes_that_do_not_match_the_layout():
    with pytest.raises(ValueError, match="shapes"):
        tile_exchange(build_layout([256], 2, align=2), [(16, 32)])
