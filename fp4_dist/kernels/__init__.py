"""Multi-tensor NVFP4 stages with one signature for every device.

CUDA tensors go to the CuPy kernels (one launch per stage for any number of tensors); everything else goes to
`reference`, the plain-PyTorch statement of the numeric contract. The stages, in the order a ZeRO step runs
them (spec section 4)::

    partial_amax  ->  (MAX all-reduce of the amax buffer)  ->  fused_scale  ->  partial_cast
    (byte all-gather)  ->  nibble_transpose + scale_transpose

The amax buffer of a list of weights is one fp32 vector (`AmaxLayout`): the n tensor amaxes first, then every
weight's tiles row-major, so one collective reduces all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..format import check_numerics, check_weight_shape, num_tiles, tile_grid
from . import reference
from .validate import check_fragments, check_shards

__all__ = [
    "AmaxLayout",
    "amax_layout",
    "partial_amax",
    "fused_scale",
    "partial_cast",
    "nibble_transpose",
    "scale_transpose",
    "reference",
]

Shape = tuple[int, int]


@dataclass(frozen=True)
class AmaxLayout:
    """Where each weight's amaxes sit in the packed fp32 amax buffer."""

    n: int
    """Number of weights; entries [0, n) are the tensor amaxes."""
    tile_offsets: tuple[int, ...]
    """Offset of weight i's first tile, counted from entry n."""
    total: int
    """Length of the buffer: n + all tiles."""

    def tiles(self, buf: torch.Tensor, i: int, shape: Shape) -> torch.Tensor:
        tm, tk = tile_grid(*shape)
        start = self.n + self.tile_offsets[i]
        return buf[start : start + tm * tk].view(tm, tk)


def amax_layout(shapes: Sequence[Shape]) -> AmaxLayout:
    offsets, acc = [], 0
    for m, k in shapes:
        offsets.append(acc)
        acc += num_tiles(m, k)
    return AmaxLayout(n=len(shapes), tile_offsets=tuple(offsets), total=len(shapes) + acc)


def _on_cuda(tensors) -> bool:
    return any(t is not None and t.is_cuda for t in tensors)


def _cuda_ops():
    from . import cuda_ops  # imported lazily: CuPy is optional on CPU machines

    return cuda_ops


def partial_amax(
    shards: Sequence[Optional[torch.Tensor]],
    starts: Sequence[int],
    shapes: Sequence[Shape],
    *,
    round_to: torch.dtype = torch.bfloat16,
    out: Optional[torch.Tensor] = None,
    device=None,
) -> torch.Tensor:
    """Tensor and tile max|x| over each rank's owned elements, packed as `amax_layout(shapes)`.

    Args:
        shards: flat contiguous fp32/bf16 shard of each weight, or None/empty where this rank owns nothing.
        starts: first element (row-major) of each shard in its weight.
        shapes: logical [M, K] of each weight.
        round_to: model dtype the values are rounded to before anything else (bf16, fp16 or fp32).
        out: optional fp32 buffer of `amax_layout(shapes).total` entries to fill.
    Returns:
        fp32 [n + tiles]: every entry written; 0 where nothing is owned; NaN counts as +inf.
    """
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    check_shards(shards, starts, shapes, round_to=round_to)
    if _on_cuda(shards) or (out is not None and out.is_cuda):
        return _cuda_ops().partial_amax(shards, starts, shapes, round_to=round_to, out=out)
    layout = amax_layout(shapes)
    dev = out.device if out is not None else _first_device(shards, device)
    buf = out if out is not None else torch.empty(layout.total, dtype=torch.float32, device=dev)
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        tiles, amax = reference.shard_tile_amax(shard, start, m, k, round_to, device=dev)
        buf[i] = amax[0]
        layout.tiles(buf, i, (m, k)).copy_(tiles)
    return buf


def fused_scale(
    amaxes: torch.Tensor,
    shapes: Sequence[Shape],
    scale_invs: Sequence[torch.Tensor],
    amax_outs: Sequence[torch.Tensor],
    *,
    numerics: str = "te",
) -> torch.Tensor:
    """From reduced amaxes: every rowwise_scale_inv (padding zeroed), every amax, and the encode multipliers.

    Returns:
        fp32 [tiles]: e_t of every tile, packed like the tile part of the amax buffer.
    """
    check_numerics(numerics)
    layout = amax_layout(shapes)
    if amaxes.numel() != layout.total:
        raise ValueError(f"amax buffer has {amaxes.numel()} entries, the layout of these weights needs {layout.total}")
    if amaxes.is_cuda:
        return _cuda_ops().fused_scale(amaxes, shapes, scale_invs, amax_outs, numerics=numerics)
    enc = torch.empty(layout.total - layout.n, dtype=torch.float32, device=amaxes.device)
    for i, (m, k) in enumerate(shapes):
        amax = amaxes[i : i + 1]
        scales = reference.tile_scales(layout.tiles(amaxes, i, (m, k)), amax, numerics)
        scale_invs[i].copy_(reference.expand_rowwise_scales(scales, m, k))
        amax_outs[i].copy_(amax)
        off = layout.tile_offsets[i]
        enc[off : off + scales.numel()] = reference.encode_multipliers(scales, amax).reshape(-1)
    return enc


def partial_cast(
    shards: Sequence[Optional[torch.Tensor]],
    starts: Sequence[int],
    shapes: Sequence[Shape],
    enc: torch.Tensor,
    fragments: Sequence[Optional[torch.Tensor]],
    *,
    round_to: torch.dtype = torch.bfloat16,
) -> None:
    """Write each shard's owned E2M1 nibbles into its byte fragment (read-modify-write of shared bytes).

    Args:
        enc: fp32 encode multipliers from `fused_scale`.
        fragments: uint8 flat `rowwise_data.view(-1)[start >> 1 : (end + 1) >> 1]` of each weight (None where
            the shard is None/empty). Shard starts must be even (spec section 4).
    """
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    check_shards(shards, starts, shapes, round_to=round_to, even_start=True)
    check_fragments(shards, starts, fragments)
    if _on_cuda(shards):
        return _cuda_ops().partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to)
    layout = amax_layout(shapes)
    for i, (shard, start, (m, k), frag) in enumerate(zip(shards, starts, shapes, fragments)):
        off = layout.tile_offsets[i]
        tile_enc = enc[off : off + num_tiles(m, k)].view(*tile_grid(m, k))
        reference.cast_shard(shard, start, m, k, tile_enc, frag, round_to)


def nibble_transpose(rowwise_datas: Sequence[torch.Tensor], columnwise_datas: Sequence[torch.Tensor]) -> None:
    """columnwise_datas[i] [K, M/2] <- nibble transpose of rowwise_datas[i] [M, K/2] (M even)."""
    if _on_cuda(rowwise_datas):
        return _cuda_ops().nibble_transpose(rowwise_datas, columnwise_datas)
    for src, dst in zip(rowwise_datas, columnwise_datas):
        dst.copy_(reference.transpose_nibbles(src))


def scale_transpose(
    rowwise_scale_invs: Sequence[torch.Tensor],
    columnwise_scale_invs: Sequence[torch.Tensor],
    shapes: Sequence[Shape],
) -> None:
    """columnwise_scale_invs[i][k, mt] <- s_t[mt, k // 16] on the valid region, zero padding."""
    if _on_cuda(rowwise_scale_invs):
        return _cuda_ops().scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes)
    for src, dst, (m, k) in zip(rowwise_scale_invs, columnwise_scale_invs, shapes):
        dst.copy_(reference.transpose_scales(src, m, k))


def _first_device(shards, device):
    for s in shards:
        if s is not None:
            return s.device
    return torch.device(device) if device is not None else torch.device("cpu")
