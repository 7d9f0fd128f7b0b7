"""Contiguous element / packed-byte layout of weights across a data-parallel group, and its buffers.

    layout.py        BufferLayout (`build_layout`): buckets, each rank's shard, element and packed-byte offsets that
                     always agree; `cut_tiles`; `packed_layout_of` (the same derived for Megatron's element layout)
    shard_buffer.py  ShardBuffer: one layout's tensors on one rank (grads, master shard, packed bytes) and their views
    tile_owners.py   which rank computes each 16x16 tile's scale and which tile amaxes cross ranks (`tile_exchange`)
"""

from .layout import BufferLayout, Bucket, ShardPiece, Span, WeightSlot, build_layout, cut_tiles
from .shard_buffer import ShardBuffer

__all__ = ["BufferLayout", "Bucket", "ShardPiece", "Span", "WeightSlot", "build_layout", "cut_tiles", "ShardBuffer"]
