"""Which rank computes each 16x16 tile's scale, and which tile amaxes must cross ranks (pure ints).

Under ZeRO a rank owns a contiguous element range of each weight. A tile's amax is complete on a rank that
owns all of the tile; only tiles *cut* by a rank boundary (`layout.cut_tiles`) have elements on two or more
ranks, so only their amaxes need a cross-rank MAX. Every tile gets one *scale owner*: the rank that owns
its first element (row 16 tr, column 16 tc). That rank owns the tile whole or the tile is cut, so after the
small all-reduce it has the tile's amax and computes the scale byte that every rank then receives::

    weight (row-major elements)   |----- rank 0 -----|----- rank 1 -----|
    tiles in flat order            t0 t1 ... ta | ta+1 ...          tb
                                   ^ first elements in rank 0's range: rank 0's scales

Because first elements increase with the flat tile index (tr * tiles_k + tc), each rank's scale tiles of a
weight are one contiguous range, and the ranges of ranks 0..dp-1 follow each other and cover the weight.
A rank packs its scale bytes in one compact buffer (weights in a given order); the ranks all-gather these
buffers (`cap` bytes each) and every rank expands them with `sources`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..format import TILE, ceil_div, round_up, tile_grid
from .layout import BufferLayout, Span, cut_tiles

Shape = Tuple[int, int]
Range = Tuple[int, int]

CAP_ALIGN = 16
"""Bytes a rank's compact scale chunk is rounded up to: each chunk of the all-gather buffer starts 16-byte aligned."""


def first_tile_at(shape: Shape, element: int) -> int:
    """Smallest flat tile index whose first element is >= `element` (tiles of the weight if none)."""
    rows, cols = shape
    tiles_m, tiles_k = tile_grid(rows, cols)
    band, rem = divmod(element, TILE * cols)
    if band >= tiles_m:
        return tiles_m * tiles_k
    # Tile (band, tc) starts at band * TILE * cols + TILE * tc: all inside the band's first row.
    return band * tiles_k + min(ceil_div(rem, TILE), tiles_k)


def scale_tiles(shape: Shape, span: Optional[Span]) -> Range:
    """[a, b): the tiles whose scale the owner of element range `span` computes (empty for None)."""
    if span is None or span.numel == 0:
        return (0, 0)
    return first_tile_at(shape, span.start), first_tile_at(shape, span.end)


def touched_bands(shape: Shape, span: Optional[Span]) -> Range:
    """[lo, hi): flat tiles of the 16-row bands that hold an element of `span` (the encode multipliers the
    partial cast of that span reads); empty for None."""
    if span is None or span.numel == 0:
        return (0, 0)
    rows, cols = shape
    tiles_k = tile_grid(rows, cols)[1]
    first, last = span.start // cols // TILE, (span.end - 1) // cols // TILE
    return first * tiles_k, (last + 1) * tiles_k


@dataclass(frozen=True)
class TileExchange:
    """What crosses ranks for the scales of one list of weights under one `BufferLayout`.

    Attributes:
        cut: per weight, sorted flat indices of its tiles cut by a rank boundary (their amaxes are MAX-reduced).
        scale: per rank, per weight, the [a, b) tile range whose scale bytes that rank computes.
        enc: per rank, per weight, the [lo, hi) tile range whose encode multipliers its partial cast reads.
        cap: compact scale bytes per rank in the all-gather buffer (the largest rank's count, rounded up to 16).
        sources: per weight, (tile_start, offset) segments: flat tile t, in the last segment with
            tile_start <= t, has its byte at gathered[t + offset] (gathered = rank r's compact at r * cap).
        order: the weight order of each rank's compact bytes.
    """

    cut: Tuple[Tuple[int, ...], ...]
    scale: Tuple[Tuple[Range, ...], ...]
    enc: Tuple[Tuple[Range, ...], ...]
    cap: int
    sources: Tuple[Tuple[Tuple[int, int], ...], ...]
    order: Tuple[int, ...]


def tile_exchange(layout: BufferLayout, shapes: Sequence[Shape], order: Optional[Sequence[int]] = None) -> TileExchange:
    """The `TileExchange` of weights `shapes` (element counts must match ``layout.numels``).

    Args:
        order: weight order of the compact bytes (default 0..n-1); a permutation of the weights.
    """
    n = len(shapes)
    if tuple(m * k for m, k in shapes) != tuple(layout.numels):
        raise ValueError("tile_exchange: shapes do not match the element counts of the buffer layout")
    order = tuple(range(n)) if order is None else tuple(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"tile_exchange: order must be a permutation of range({n}), got {order}")
    cut = tuple(_cut_tiles_of(shapes[i], layout.cuts(i)) for i in range(n))
    spans = [[None if p is None else p.span for p in layout.pieces(r)] for r in range(layout.dp_size)]
    scale = tuple(tuple(scale_tiles(shapes[i], spans[r][i]) for i in range(n)) for r in range(layout.dp_size))
    enc = tuple(tuple(touched_bands(shapes[i], spans[r][i]) for i in range(n)) for r in range(layout.dp_size))
    bases, counts = [], []
    for r in range(layout.dp_size):
        base, acc = [0] * n, 0
        for i in order:
            base[i] = acc
            acc += scale[r][i][1] - scale[r][i][0]
        bases.append(base)
        counts.append(acc)
    cap = round_up(max(counts, default=0), CAP_ALIGN)
    sources = []
    for i in range(n):
        segs = tuple((a, r * cap + bases[r][i] - a) for r in range(layout.dp_size)
                     for a, b in [scale[r][i]] if b > a)  # fmt: skip
        assert segs and segs[0][0] == 0, f"weight {i}: tile 0 has no scale owner"
        sources.append(segs)
    return TileExchange(cut, scale, enc, cap, tuple(sources), order)


def _cut_tiles_of(shape: Shape, cuts: Sequence[int]) -> Tuple[int, ...]:
    tiles = set()
    for c in cuts:
        first, last = cut_tiles(shape, c)
        tiles.update(range(first, last))
    return tuple(sorted(tiles))
