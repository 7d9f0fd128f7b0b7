"""Contiguous element / packed-byte layout of weights across a data-parallel group, and its buffers."""

from .layout import BufferLayout, Bucket, ShardPiece, Span, WeightSlot, build_layout, cut_tiles
from .shard_buffer import ShardBuffer

__all__ = ["BufferLayout", "Bucket", "ShardPiece", "Span", "WeightSlot", "build_layout", "cut_tiles", "ShardBuffer"]
