"""ShardBuffer: the tensors of one `BufferLayout` on one rank, and the views every other piece uses.

::

    grad     fp32 [total]            full-size; backward grads are copied in, reduce-scatter input per bucket
    grad_shard  fp32 [shard_numel]   this rank's reduced grads (all buckets concatenated)
    master   fp32 [shard_numel]      this rank's master shard (same layout as grad_shard)
    param    uint8 [total / 2]       packed NVFP4 rowwise bytes (packed=True), all-gathered in place, or
             dtype [total]           model-dtype values of dense parameters (packed=False)

All views are made once; padding is zero and never written, so a gather never ships stale memory.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..format import packed_bytes
from .layout import BufferLayout, ShardPiece


class ShardBuffer:
    """Buffers of ``layout`` for ``rank``.

    Args:
        layout: the shared layout (identical on every rank).
        rank: this rank's index in the data-parallel group.
        packed: True for NVFP4 weights (param buffer holds 2 elements per byte), False for dense params.
        param_dtype: dtype of the dense param buffer (ignored when packed).
        device: where every buffer lives.
    """

    def __init__(self, layout: BufferLayout, rank: int, *, packed: bool, param_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        if packed:
            odd = [i for i, n in enumerate(layout.numels) if n % 2]
            if odd:
                raise ValueError(f"weights {odd} have an odd number of elements; a packed NVFP4 buffer needs even "
                                 "numel (K % 16 == 0 guarantees it)")
        self.layout = layout
        self.rank = rank
        self.packed = packed
        self.pieces: Tuple[Optional[ShardPiece], ...] = layout.pieces(rank)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=dev)
        self.grad = torch.zeros(layout.total, dtype=torch.float32, device=dev)
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=dev)
        if packed:
            self.param = torch.zeros(packed_bytes(layout.total), dtype=torch.uint8, device=dev)
        else:
            self.param = torch.zeros(layout.total, dtype=param_dtype, device=dev)

    # ------------------------------------------------------------------------------------- per weight
    def master_piece(self, i: int) -> Optional[torch.Tensor]:
        """fp32 view of the elements of weight ``i`` this rank owns (flat), or None."""
        p = self.pieces[i]
        return None if p is None else self.master[p.master_offset:p.master_offset + p.span.numel]

    def grad_shard_piece(self, i: int) -> Optional[torch.Tensor]:
        p = self.pieces[i]
        return None if p is None else self.grad_shard[p.master_offset:p.master_offset + p.span.numel]

    def start_offset(self, i: int) -> Optional[int]:
        """First owned element of weight ``i`` (the ``start_offsets`` entry of the cast), or None."""
        p = self.pieces[i]
        return None if p is None else p.span.start

    def grad_view(self, i: int) -> torch.Tensor:
        """fp32 flat view of weight ``i`` in the full grad buffer."""
        span = self.layout.weights[i].span
        return self.grad[span.start:span.end]

    def param_view(self, i: int) -> torch.Tensor:
        """Weight ``i`` in the param buffer: uint8 bytes [numel / 2] (packed) or flat model-dtype values."""
        span = self.layout.weights[i].span
        span = span.packed() if self.packed else span
        return self.param[span.start:span.end]

    def shard_param_view(self, bucket: int) -> torch.Tensor:
        """This rank's slice of ``bucket`` in the param buffer (what it sends in the all-gather)."""
        shard = self.layout.buckets[bucket].shard(self.rank)
        shard = shard.packed() if self.packed else shard
        return self.param[shard.start:shard.end]

    # -------------------------------------------------------------------------------------- per bucket
    def bucket_grad(self, b: int) -> torch.Tensor:
        span = self.layout.buckets[b].span
        return self.grad[span.start:span.end]

    def bucket_grad_shard(self, b: int) -> torch.Tensor:
        off = self.layout.bucket_master_offset(b)
        return self.grad_shard[off:off + self.layout.buckets[b].shard_numel]

    def bucket_master(self, b: int) -> torch.Tensor:
        off = self.layout.bucket_master_offset(b)
        return self.master[off:off + self.layout.buckets[b].shard_numel]

    def bucket_param(self, b: int) -> torch.Tensor:
        span = self.layout.buckets[b].span
        span = span.packed() if self.packed else span
        return self.param[span.start:span.end]

    # ------------------------------------------------------------------------------------------ checks
    def master_pieces(self) -> List[Optional[torch.Tensor]]:
        return [self.master_piece(i) for i in range(len(self.pieces))]

    def start_offsets(self) -> List[Optional[int]]:
        return [self.start_offset(i) for i in range(len(self.pieces))]

    def check_shards(self, masters: Sequence[Optional[torch.Tensor]], starts: Sequence[Optional[int]],
                     names: Optional[Sequence[str]] = None) -> None:
        """Raise ValueError naming the weight unless (masters, starts) are exactly this rank's layout pieces."""
        if len(masters) != len(self.pieces) or len(starts) != len(self.pieces):
            raise ValueError(f"layout has {len(self.pieces)} weights, got {len(masters)} masters and "
                             f"{len(starts)} start offsets")
        for i, (piece, m, s) in enumerate(zip(self.pieces, masters, starts)):
            name = names[i] if names else f"weight {i}"
            want = (None, None) if piece is None else (piece.span.start, piece.span.numel)
            got = (None if m is None or m.numel() == 0 else s, None if m is None or m.numel() == 0 else m.numel())
            if got != want:
                raise ValueError(f"{name}: rank {self.rank} passed a master shard (start, length) = {got} but the "
                                 f"buffer layout assigns it {want}; take shards from ShardBuffer.master_pieces()")
