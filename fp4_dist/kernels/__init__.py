"""Multi-tensor NVFP4 stages with one signature for every device.

CUDA tensors go to the CuPy kernels (one launch per stage for any number of tensors); everything else goes to
`reference`, the plain-PyTorch statement of the numeric contract. The stages, in the order a ZeRO step runs
them (spec section 4)::

    partial_amax  ->  (MAX all-reduce of the amax buffer)  ->  fused_scale  ->  partial_cast
    (byte all-gather)  ->  nibble_transpose + scale_transpose

or, exchanging only the amaxes of tiles cut by rank boundaries (`fp4_dist.optim.owned_scales`)::

    partial_amax  ->  (MAX all-reduce of tensor + cut-tile amaxes)  ->  owner_scales  ->  partial_cast
    (byte all-gather + all-gather of the owners' compact scale bytes)  ->  expand_scales  ->  transposes

and, after every change of the bytes, `dequantize` fills each weight's model-dtype compute copy (one launch for
all weights; `fp4_dist.compute_copy`).

The amax buffer of a list of weights is one fp32 vector (`AmaxLayout`): the n tensor amaxes first, then every
weight's tiles row-major, so one collective reduces all of it.

Each stage validates its arguments, then (CUDA) looks its launch plan up by the signature of its tensors; on
a hit the checks are skipped (the signature covers all they look at). For tensors that stay the same from
step to step, `fp4_dist.kernels.bound` binds a stage once: then a call is the launch alone.
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
    "owner_scales",
    "expand_scales",
    "dequantize",
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
    if _on_cuda(shards) or (out is not None and out.is_cuda):
        check = lambda: _check_amax_args(shards, starts, shapes, round_to)  # noqa: E731 (only on a plan miss)
        return _cuda_ops().partial_amax(shards, starts, shapes, round_to=round_to, out=out, check=check)
    shapes = _check_amax_args(shards, starts, shapes, round_to)
    dev = out.device if out is not None else _first_device(shards, device)
    buf = out if out is not None else torch.empty(amax_layout(shapes).total, dtype=torch.float32, device=dev)
    amax_reference(shards, starts, shapes, round_to, buf)
    return buf


def _check_amax_args(shards, starts, shapes, round_to) -> list[Shape]:
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    check_shards(shards, starts, shapes, round_to=round_to)
    return shapes


def amax_reference(shards, starts, shapes, round_to, buf: torch.Tensor) -> None:
    """CPU/reference body of `partial_amax` (arguments already checked) into `buf`."""
    layout = amax_layout(shapes)
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        tiles, amax = reference.shard_tile_amax(shard, start, m, k, round_to, device=buf.device)
        buf[i] = amax[0]
        layout.tiles(buf, i, (m, k)).copy_(tiles)


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
    if amaxes.is_cuda:
        check = lambda: _check_scale_args(amaxes, shapes)  # noqa: E731 (only on a plan miss)
        return _cuda_ops().fused_scale(amaxes, shapes, scale_invs, amax_outs, numerics=numerics, check=check)
    _check_scale_args(amaxes, shapes)
    enc = torch.empty(amaxes.numel() - len(shapes), dtype=torch.float32, device=amaxes.device)
    scale_reference(amaxes, shapes, scale_invs, amax_outs, numerics, enc)
    return enc


def _check_scale_args(amaxes, shapes) -> None:
    layout = amax_layout(shapes)
    if amaxes.numel() != layout.total:
        raise ValueError(f"amax buffer has {amaxes.numel()} entries, the layout of these weights needs {layout.total}")


def scale_reference(amaxes, shapes, scale_invs, amax_outs, numerics, enc: torch.Tensor) -> None:
    """CPU/reference body of `fused_scale` (arguments already checked), encode multipliers into `enc`."""
    layout = amax_layout(shapes)
    for i, (m, k) in enumerate(shapes):
        amax = amaxes[i : i + 1]
        scales = reference.tile_scales(layout.tiles(amaxes, i, (m, k)), amax, numerics)
        scale_invs[i].copy_(reference.expand_rowwise_scales(scales, m, k))
        amax_outs[i].copy_(amax)
        off = layout.tile_offsets[i]
        enc[off : off + scales.numel()] = reference.encode_multipliers(scales, amax).reshape(-1)


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
    if _on_cuda(shards):
        check = lambda: _check_cast_args(shards, starts, shapes, fragments, round_to)  # noqa: E731 (plan miss)
        return _cuda_ops().partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to, check=check)
    shapes = _check_cast_args(shards, starts, shapes, fragments, round_to)
    cast_reference(shards, starts, shapes, enc, fragments, round_to)


def _check_cast_args(shards, starts, shapes, fragments, round_to) -> list[Shape]:
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    check_shards(shards, starts, shapes, round_to=round_to, even_start=True)
    check_fragments(shards, starts, fragments)
    return shapes


def cast_reference(shards, starts, shapes, enc, fragments, round_to) -> None:
    """CPU/reference body of `partial_cast` (arguments already checked)."""
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


def dequantize(
    rowwise_datas: Sequence[torch.Tensor],
    scale_invs: Sequence[torch.Tensor],
    amaxes: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
) -> None:
    """outs[i] [M, K] <- the values of NVFP4 weight i (spec section 3), rounded to outs[i].dtype.

    Args:
        rowwise_datas: uint8 [M, K/2]; scale_invs: uint8 rowwise_scale_inv (row r uses its own row's bytes);
        amaxes: fp32 [1]; outs: contiguous bf16, fp16 or fp32 [M, K] (dtypes may differ between weights).
    Bit-identical to `reference.dequantize` on the same device, one launch for all weights on CUDA.
    """
    if _on_cuda(rowwise_datas):
        return _cuda_ops().dequantize(rowwise_datas, scale_invs, amaxes, outs)
    dequantize_reference(rowwise_datas, scale_invs, amaxes, outs)


def dequantize_reference(rowwise_datas, scale_invs, amaxes, outs) -> None:
    """CPU/reference body of `dequantize`."""
    if not (len(rowwise_datas) == len(scale_invs) == len(amaxes) == len(outs)):
        raise ValueError("dequantize needs one rowwise_data, scale_inv, amax and out per weight")
    for data, si, amax, out in zip(rowwise_datas, scale_invs, amaxes, outs):
        out.copy_(reference.dequantize(data, si, amax, out.dtype))


def owner_scales(
    amaxes: torch.Tensor,
    shapes: Sequence[Shape],
    enc_ranges: Sequence[tuple[int, int]],
    own_ranges: Sequence[tuple[int, int]],
    compact: torch.Tensor,
    enc: torch.Tensor,
    amax_outs: Sequence[torch.Tensor],
    *,
    numerics: str = "te",
) -> None:
    """One rank's share of the scales when only cut tiles were exchanged: encode multipliers of the tiles its
    shards touch, the scale bytes of the tiles it owns (packed), and every weight's amax.

    Args:
        amaxes: fp32 [n + tiles] (`amax_layout`): tensor amaxes reduced over ranks; tile amaxes complete on every
            tile of `enc_ranges` (a tile cut by a rank boundary must have been MAX-reduced).
        enc_ranges: per weight (lo, hi): flat tiles (tr * tiles_k + tc) whose e_t go to enc[tile_offset_i + t].
        own_ranges: per weight (a, b) inside (lo, hi), or empty: tiles whose E4M3 byte goes to `compact`,
            packed in weight order: tile t of weight i at compact[sum over j < i of (b_j - a_j) + t - a_i].
        compact: uint8 [>= sum of (b - a)]; enc: fp32 [tiles]; amax_outs: per weight fp32 [1] <- A.
    Same formulas (and bytes) as `fused_scale`; entries of `enc` outside `enc_ranges` are left as they were.
    """
    bound.bind_owner_scales(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics=numerics)()


def expand_scales(
    gathered: torch.Tensor,
    shapes: Sequence[Shape],
    sources: Sequence[Sequence[tuple[int, int]]],
    scale_invs: Sequence[torch.Tensor],
) -> None:
    """Each weight's row-expanded `rowwise_scale_inv` (padding zeroed) from all-gathered compact scale bytes.

    Args:
        gathered: flat uint8, every rank's compact bytes (`owner_scales`) after the all-gather.
        sources: per weight, segments (tile_start, offset) with tile_start increasing from 0: flat tile t of the
            weight, in the last segment with tile_start <= t, is gathered[t + offset].
    """
    bound.bind_expand_scales(gathered, shapes, sources, scale_invs)()


def _first_device(shards, device):
    for s in shards:
        if s is not None:
            return s.device
    return torch.device(device) if device is not None else torch.device("cpu")


from . import bound  # noqa: E402  (bound.py builds on the stage bodies above)
