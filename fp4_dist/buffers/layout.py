"""Contiguous buffer layout of a list of weights across a data-parallel group.

One layout serves three buffers that must agree exactly:

* the element buffer (fp32 masters, fp32 grads), in elements;
* the packed NVFP4 buffer (uint8 ``rowwise_data`` bytes, all-gathered), in bytes;
* each rank's master shard (the concatenation of its shard of every bucket).

The packed layout is *derived*: byte offset == element offset / 2 everywhere. It is never
recomputed with its own padding (the source of Megatron's stale-byte bug at dp=3/6).

Padding rules (all offsets are element offsets)::

    bucket b:  |w0 .. pad|w1 .. pad|w2 ..........|pad to dp*align|
               ^ weight starts are multiples of `align`
    shards:    |  rank 0   |  rank 1   |  rank 2   |     (each bucket.numel / dp elements)

* a weight starts at a multiple of ``align`` (even, default 64: 32-byte aligned packed rows,
  256-byte aligned fp32 masters, and the same SIMD phase for shard-local and whole-weight
  elementwise optimizer steps);
* a bucket's padded length is a multiple of ``dp * align``, so every rank boundary is a
  multiple of ``align``, hence an even element for every dp size (3, 5, 6, 7 included);
* a weight never spans two buckets.

Everything here is plain ints and frozen dataclasses, computed once; nothing touches tensors.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..format import TILE, check_even_boundary, round_up, tile_grid

DEFAULT_ALIGN = 64


@dataclass(frozen=True)
class Span:
    """Half-open element range ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self):
        assert 0 <= self.start <= self.end, f"bad span [{self.start}, {self.end})"

    @property
    def numel(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Span") -> Optional["Span"]:
        """Overlap with ``other``, or None when it is empty."""
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return Span(lo, hi) if lo < hi else None

    def shift(self, offset: int) -> "Span":
        """The same range with ``offset`` subtracted (e.g. buffer -> weight-local coordinates)."""
        return Span(self.start - offset, self.end - offset)

    def packed(self) -> "Span":
        """Byte range of the packed (2 elements per byte) buffer: the element range / 2 (both ends even)."""
        check_even_boundary("span", self.start, self.end)
        return Span(self.start // 2, self.end // 2)


@dataclass(frozen=True)
class WeightSlot:
    """Where weight ``index`` lives in the buffer (element coordinates)."""

    index: int
    span: Span
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous group of weights, sharded evenly over the data-parallel ranks.

    ``span`` includes the tail padding; ``shard_numel = span.numel // dp_size`` is a multiple
    of the layout's ``align``.
    """

    index: int
    span: Span
    weights: Tuple[int, ...]
    shard_numel: int

    def shard(self, rank: int) -> Span:
        """Element range of the buffer owned by ``rank`` in this bucket."""
        start = self.span.start + rank * self.shard_numel
        return Span(start, start + self.shard_numel)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one weight that one rank owns.

    Attributes:
        weight: index of the weight.
        bucket: index of its bucket.
        span: owned elements in weight-local coordinates (``span.start`` is the
            ``start_offset`` of ``cast_master_weights_to_nvfp4``).
        master_offset: offset of ``span.start`` inside the rank's master shard buffer.
    """

    weight: int
    bucket: int
    span: Span
    master_offset: int


@dataclass(frozen=True)
class BufferLayout:
    """Layout of ``numels`` in buckets sharded over ``dp_size`` ranks (build with `build_layout`)."""

    numels: Tuple[int, ...]
    dp_size: int
    align: int
    weights: Tuple[WeightSlot, ...]
    buckets: Tuple[Bucket, ...]

    @property
    def total(self) -> int:
        """Padded element count of the whole buffer (a multiple of ``dp_size * align``)."""
        return self.buckets[-1].span.end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's master shard (the same on every rank)."""
        return self.total // self.dp_size

    def bucket_master_offset(self, bucket: int) -> int:
        """Offset of ``bucket``'s shard inside a rank's master shard buffer."""
        return sum(b.shard_numel for b in self.buckets[:bucket])

    def pieces(self, rank: int) -> Tuple[Optional[ShardPiece], ...]:
        """Per weight: the piece ``rank`` owns, or None. Pieces are disjoint across ranks and
        cover every weight exactly once."""
        _check_rank(rank, self.dp_size)
        out = []
        for slot in self.weights:
            bucket = self.buckets[slot.bucket]
            shard = bucket.shard(rank)
            own = slot.span.intersect(shard)
            if own is None:
                out.append(None)
                continue
            master_offset = self.bucket_master_offset(slot.bucket) + own.start - shard.start
            out.append(ShardPiece(slot.index, slot.bucket, own.shift(slot.span.start), master_offset))
        return tuple(out)

    def select(self, indices: Sequence[int]) -> "BufferLayout":
        """The layout of some of the weights, where they are (same buckets and shards): weight j of the result is
        weight ``indices[j]`` of this one. A cast of part of a buffer's weights works on it."""
        slots = tuple(WeightSlot(j, self.weights[i].span, self.weights[i].bucket) for j, i in enumerate(indices))
        keep = {i: j for j, i in enumerate(indices)}
        buckets = tuple(Bucket(b.index, b.span, tuple(keep[w] for w in b.weights if w in keep), b.shard_numel)
                        for b in self.buckets)  # fmt: skip
        return BufferLayout(tuple(self.numels[i] for i in indices), self.dp_size, self.align, slots, buckets)

    def cuts(self, weight: int) -> Tuple[int, ...]:
        """Weight-local element offsets where ownership changes rank (strictly inside the weight)."""
        slot = self.weights[weight]
        bucket = self.buckets[slot.bucket]
        found = []
        for rank in range(1, self.dp_size):
            boundary = bucket.shard(rank).start
            if slot.span.start < boundary < slot.span.end:
                found.append(boundary - slot.span.start)
        return tuple(found)


def _check_rank(rank: int, dp_size: int) -> None:
    if not (isinstance(rank, int) and 0 <= rank < dp_size):
        raise ValueError(f"rank {rank!r} is out of range for a data-parallel group of size {dp_size}")


def _check_args(numels: Sequence[int], dp_size: int, align: int, bucket_numel) -> None:
    if not (isinstance(dp_size, int) and dp_size >= 1):
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if not (isinstance(align, int) and align >= 2 and align % 2 == 0):
        raise ValueError(f"align must be a positive even int (keeps rank boundaries on whole bytes), "
                         f"got {align!r}")
    if bucket_numel is not None and not (isinstance(bucket_numel, int) and bucket_numel >= 1):
        raise ValueError(f"bucket_numel must be a positive int or None (one bucket), got {bucket_numel!r}")
    for i, n in enumerate(numels):
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"weight {i}: numel must be a positive int, got {n!r}")


def _as_int(n):
    # numpy / torch integer scalars are fine; floats and bools are caller mistakes.
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        return n
    return operator.index(n)


def build_layout(numels: Sequence[int], dp_size: int, *, bucket_numel: Optional[int] = None,
                 align: int = DEFAULT_ALIGN) -> BufferLayout:
    """Lay out weights of ``numels`` elements in order, in buckets, sharded over ``dp_size`` ranks.

    Args:
        numels: element count of each weight (M*K for an NVFP4 weight), in buffer order.
        dp_size: data-parallel world size.
        bucket_numel: a bucket is closed as soon as its weights hold at least this many elements
            (None: one bucket for everything). Each bucket is one reduce-scatter and one all-gather.
        align: even element alignment of weight starts and of every rank boundary.

    Returns:
        A `BufferLayout`; every rank boundary is a multiple of ``align`` (so even), and byte
        offsets of the packed buffer are element offsets / 2.
    """
    numels = tuple(_as_int(n) for n in numels)
    _check_args(numels, dp_size, align, bucket_numel)
    weights, buckets = [], []
    bucket_start, cursor, members = 0, 0, []

    def close_bucket():
        nonlocal bucket_start, cursor, members
        end = bucket_start + round_up(cursor - bucket_start, dp_size * align)
        buckets.append(Bucket(len(buckets), Span(bucket_start, end), tuple(members),
                              (end - bucket_start) // dp_size))
        bucket_start, cursor, members = end, end, []

    for i, n in enumerate(numels):
        start = round_up(cursor, align)
        weights.append(WeightSlot(i, Span(start, start + n), len(buckets)))
        members.append(i)
        cursor = start + n
        if bucket_numel is not None and cursor - bucket_start >= bucket_numel:
            close_bucket()
    if members:
        close_bucket()
    return BufferLayout(numels, dp_size, align, tuple(weights), tuple(buckets))


def cut_tiles(shape: Tuple[int, int], cut: int) -> Tuple[int, int]:
    """16x16 tiles of a row-major ``shape`` weight that hold elements on both sides of element ``cut``.

    Only these tiles have owners on two ranks, so only their amaxes need a cross-rank MAX
    (every other tile's amax is complete on the one rank that owns it).

    Returns:
        ``(first, last)``: flat tile indices ``tr * tiles_k + tc`` of the cut tiles are
        ``range(first, last)``; empty (``first == last``) when the cut is on a tile-row boundary.
    """
    rows, cols = shape
    if not 0 < cut < rows * cols:
        raise ValueError(f"cut {cut} must be strictly inside the weight of {rows * cols} elements")
    row, col = divmod(cut, cols)
    tr = row // TILE
    tiles_k = tile_grid(rows, cols)[1]
    last_row = min(TILE * tr + TILE - 1, rows - 1)
    hit = []
    for tc in range(tiles_k):
        lo = TILE * tr * cols + TILE * tc                         # first element of the tile
        hi = last_row * cols + min(TILE * tc + TILE - 1, cols - 1)  # last element of the tile
        if lo < cut <= hi:
            hit.append(tc)
    if not hit:
        return (tr * tiles_k, tr * tiles_k)
    # Cut tiles form one run of a tile row (see tests); return it as a flat range.
    assert hit == list(range(hit[0], hit[-1] + 1)), f"non-contiguous cut tiles {hit}"
    return (tr * tiles_k + hit[0], tr * tiles_k + hit[-1] + 1)


def packed_layout_of(index_map: dict, bucket_spans: Sequence[Tuple[int, int]], dp_size: int,
                     labels: Optional[dict] = None) -> tuple[dict, list, int]:  # fmt: skip
    """The packed (byte) layout of an element layout made elsewhere (Megatron's param and bucket indices): every
    range / 2, after checking that every boundary a byte all-gather or a cast depends on is even.

    Args:
        index_map: {key: (start, end, bucket)} element ranges of the weights.
        bucket_spans: [(start, end)] element range of each bucket (padding included).
        dp_size: data-parallel size; each bucket is split into that many equal rank shards.
        labels: {key: name} for errors.
    Returns:
        ({key: (byte start, byte end, bucket)}, [(byte start, byte end)] per bucket, bytes of the buckets up to
        their last weight's end).
    Raises:
        ValueError naming the weight, bucket or rank whose boundary is odd or whose bucket does not split evenly.
    """
    labels = labels or {}
    packed_map = {}
    for key, (start, end, bucket) in index_map.items():
        check_even_boundary(labels.get(key, f"weight {key!r}"), start, end)
        packed = Span(start, end).packed()
        packed_map[key] = (packed.start, packed.end, bucket)
    packed_buckets = []
    for b, (start, end) in enumerate(bucket_spans):
        if (end - start) % dp_size:
            raise ValueError(f"bucket {b} spans elements [{start}, {end}), not divisible into {dp_size} rank shards "
                             "(with Megatron: is the adapter's pad_bucket_end row installed?)")
        bucket = Bucket(b, Span(start, end), (), (end - start) // dp_size)
        for r in range(dp_size):
            shard = bucket.shard(r)
            check_even_boundary(f"bucket {b}, rank {r}", shard.start, shard.end)
        packed = bucket.span.packed()
        packed_buckets.append((packed.start, packed.end))
    last_end = {b: start for b, (start, _) in enumerate(bucket_spans)}
    for _, end, b in index_map.values():
        last_end[b] = max(last_end[b], end)
    unpadded = sum(Span(start, last_end[b]).packed().numel for b, (start, _) in enumerate(bucket_spans))
    return packed_map, packed_buckets, unpadded
