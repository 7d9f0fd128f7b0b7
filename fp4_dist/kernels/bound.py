"""Stages bound once to tensors that stay the same from step to step: each call is the launch alone.

``run = bind_partial_amax(shards, starts, shapes, out)`` checks every argument (as the stage function does)
and builds the launch plan now; ``run()`` then launches one kernel (CUDA) or runs the reference loop (CPU),
with no argument checks and no per-weight Python work on CUDA. A bound stage holds the tensors it was given:
write new values *into* them between calls; if a tensor is replaced by another one, bind again.

This is what lets an optimizer with 1,000 weights spend well under a millisecond of host time per step
(`fp4_dist.optim.owned_scales`, `fp4_dist.optim.cast.BoundCast`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..format import check_numerics, check_weight_shape, tile_grid
from . import (
    _check_amax_args,
    _check_cast_args,
    _check_scale_args,
    _cuda_ops,
    _on_cuda,
    amax_reference,
    cast_reference,
    dequantize_reference,
    reference,
    scale_reference,
)
from .validate import check_owner_ranges, check_sources

Shape = tuple[int, int]
Run = Callable[[], None]

__all__ = [
    "bind_partial_amax",
    "bind_fused_scale",
    "bind_partial_cast",
    "bind_owner_scales",
    "bind_expand_scales",
    "bind_nibble_transpose",
    "bind_scale_transpose",
    "bind_dequantize",
]


def bind_partial_amax(shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int], shapes: Sequence[Shape],
                      out: torch.Tensor, *, round_to: torch.dtype = torch.bfloat16) -> Run:  # fmt: skip
    """`partial_amax(shards, starts, shapes, round_to=round_to, out=out)`, bound."""
    shapes = _check_amax_args(shards, starts, shapes, round_to)
    shards, starts = list(shards), [int(s) for s in starts]
    if _on_cuda(shards) or out.is_cuda:
        return _cuda_ops().bind_partial_amax(shards, starts, shapes, out, round_to=round_to)
    return lambda: amax_reference(shards, starts, shapes, round_to, out)


def bind_fused_scale(amaxes: torch.Tensor, shapes: Sequence[Shape], scale_invs, amax_outs, enc: torch.Tensor, *,
                     numerics: str = "te") -> Run:  # fmt: skip
    """`fused_scale(amaxes, shapes, scale_invs, amax_outs, numerics=numerics)` writing its multipliers to `enc`."""
    check_numerics(numerics)
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    _check_scale_args(amaxes, shapes)
    scale_invs, amax_outs = list(scale_invs), list(amax_outs)
    if amaxes.is_cuda:
        return _cuda_ops().bind_fused_scale(amaxes, shapes, scale_invs, amax_outs, enc, numerics=numerics)
    return lambda: scale_reference(amaxes, shapes, scale_invs, amax_outs, numerics, enc)


def bind_partial_cast(shards, starts, shapes, enc: torch.Tensor, fragments, *,
                      round_to: torch.dtype = torch.bfloat16) -> Run:  # fmt: skip
    """`partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to)`, bound."""
    shapes = _check_cast_args(shards, starts, shapes, fragments, round_to)
    shards, starts, fragments = list(shards), [int(s) for s in starts], list(fragments)
    if _on_cuda(shards):
        return _cuda_ops().bind_partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to)
    return lambda: cast_reference(shards, starts, shapes, enc, fragments, round_to)


def bind_owner_scales(amaxes: torch.Tensor, shapes, enc_ranges, own_ranges, compact: torch.Tensor,
                      enc: torch.Tensor, amax_outs, *, numerics: str = "te") -> Run:  # fmt: skip
    """`owner_scales(...)` (see `fp4_dist.kernels.owner_scales`), bound."""
    check_numerics(numerics)
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    enc_ranges = [(int(a), int(b)) for a, b in enc_ranges]
    own_ranges = [(int(a), int(b)) for a, b in own_ranges]
    check_owner_ranges(shapes, enc_ranges, own_ranges, compact, enc, amax_outs, amaxes)
    amax_outs = list(amax_outs)
    if amaxes.is_cuda:
        return _cuda_ops().bind_owner_scales(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs,
                                             numerics=numerics)  # fmt: skip
    return lambda: _owner_reference(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics)


def _owner_reference(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics) -> None:
    n, off, base = len(shapes), 0, 0
    for i, ((m, k), (lo, hi), (a, b)) in enumerate(zip(shapes, enc_ranges, own_ranges)):
        amax = amaxes[i : i + 1]
        scales = reference.tile_scales(amaxes[n + off + lo : n + off + hi], amax, numerics)
        enc[off + lo : off + hi] = reference.encode_multipliers(scales, amax)
        if b > a:
            compact[base : base + b - a] = scales[a - lo : b - lo]
            base += b - a
        amax_outs[i].copy_(amax)
        tm, tk = tile_grid(m, k)
        off += tm * tk


def bind_expand_scales(gathered: torch.Tensor, shapes, sources, scale_invs) -> Run:
    """`expand_scales(gathered, shapes, sources, scale_invs)`, bound."""
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    sources = [tuple((int(s), int(o)) for s, o in segs) for segs in sources]
    scale_invs = list(scale_invs)
    check_sources(shapes, sources, gathered, scale_invs)
    if gathered.is_cuda:
        return _cuda_ops().bind_expand_scales(gathered, shapes, sources, scale_invs)
    index = [_source_index(segs, m, k) for segs, (m, k) in zip(sources, shapes)]

    def run() -> None:
        for idx, (m, k), si in zip(index, shapes, scale_invs):
            si.copy_(reference.expand_rowwise_scales(gathered[idx].view(*tile_grid(m, k)), m, k))

    return run


def _source_index(segs, m: int, k: int) -> torch.Tensor:
    """Byte of each flat tile of one weight in the gathered buffer."""
    tm, tk = tile_grid(m, k)
    ends = [s for s, _ in segs[1:]] + [tm * tk]
    return torch.cat([torch.arange(s + o, e + o) for (s, o), e in zip(segs, ends)])


def bind_nibble_transpose(rowwise_datas, columnwise_datas) -> Run:
    """`nibble_transpose(rowwise_datas, columnwise_datas)`, bound."""
    rowwise_datas, columnwise_datas = list(rowwise_datas), list(columnwise_datas)
    if _on_cuda(rowwise_datas):
        return _cuda_ops().bind_nibble_transpose(rowwise_datas, columnwise_datas)
    if len(rowwise_datas) != len(columnwise_datas):
        raise ValueError(f"got {len(rowwise_datas)} rowwise and {len(columnwise_datas)} columnwise tensors")

    def run() -> None:
        for src, dst in zip(rowwise_datas, columnwise_datas):
            dst.copy_(reference.transpose_nibbles(src))

    return run


def bind_scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes) -> Run:
    """`scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes)`, bound."""
    srcs, dsts = list(rowwise_scale_invs), list(columnwise_scale_invs)
    shapes = [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]
    if _on_cuda(srcs):
        return _cuda_ops().bind_scale_transpose(srcs, dsts, shapes)
    if not (len(srcs) == len(dsts) == len(shapes)):
        raise ValueError("scale_transpose needs one rowwise, one columnwise tensor and one shape per weight")

    def run() -> None:
        for src, dst, (m, k) in zip(srcs, dsts, shapes):
            dst.copy_(reference.transpose_scales(src, m, k))

    return run


def bind_dequantize(rowwise_datas, scale_invs, amaxes, outs) -> Run:
    """`dequantize(rowwise_datas, scale_invs, amaxes, outs)`, bound."""
    lists = [list(rowwise_datas), list(scale_invs), list(amaxes), list(outs)]
    if len({len(x) for x in lists}) != 1:
        raise ValueError("dequantize needs one rowwise_data, scale_inv, amax and out per weight")
    if _on_cuda(lists[0]):
        return _cuda_ops().bind_dequantize(*lists)
    return lambda: dequantize_reference(*lists)
