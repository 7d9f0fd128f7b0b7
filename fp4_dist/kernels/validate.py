"""Argument checks shared by every device path of the stages: a caller mistake raises before any launch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..format import num_tiles, rowwise_scale_shape

SHARD_DTYPES = (torch.float32, torch.bfloat16)
ROUND_TO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_shards(
    shards: Sequence[Optional[torch.Tensor]],
    starts: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    *,
    round_to: torch.dtype,
    even_start: bool = False,
) -> None:
    """Each shard is None/empty or a contiguous 1D fp32/bf16 tensor inside its weight; one device for all."""
    if not (len(shards) == len(starts) == len(shapes)):
        raise ValueError(
            f"got {len(shards)} shards, {len(starts)} starts and {len(shapes)} shapes; pass one of each per weight"
        )
    if round_to not in ROUND_TO_DTYPES:
        raise TypeError(f"round_to must be one of {ROUND_TO_DTYPES}, got {round_to}")
    devices = set()
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        if shard is None:
            continue
        if not isinstance(shard, torch.Tensor):
            raise TypeError(f"shard {i}: expected a torch.Tensor or None, got {type(shard).__name__}")
        if shard.dtype not in SHARD_DTYPES:
            raise TypeError(f"shard {i}: dtype {shard.dtype} is not supported; pass fp32 or bf16 master values")
        if shard.dim() != 1 or not shard.is_contiguous():
            raise ValueError(
                f"shard {i}: must be a flat contiguous 1D tensor (got shape {list(shard.shape)}, "
                f"contiguous={shard.is_contiguous()}); pass shard.reshape(-1).contiguous()"
            )
        start = int(start)
        end = start + shard.numel()
        if start < 0 or end > m * k:
            raise ValueError(
                f"shard {i}: elements [{start}, {end}) fall outside the {m}x{k} weight ([0, {m * k}))"
            )
        if even_start and shard.numel() and start % 2:
            raise ValueError(
                f"shard {i}: start {start} splits a byte (two FP4 values share one byte); shard boundaries "
                "must be even element offsets"
            )
        if shard.numel():
            devices.add(shard.device)
    if len(devices) > 1:
        raise ValueError(f"shards live on several devices {sorted(map(str, devices))}; put them on one device")


def check_fragments(
    shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int], fragments: Sequence[Optional[torch.Tensor]]
) -> None:
    """Fragment i is uint8 bytes [start >> 1, (end + 1) >> 1) on the shard's device."""
    if len(fragments) != len(shards):
        raise ValueError(f"got {len(fragments)} fragments for {len(shards)} shards")
    for i, (shard, start, frag) in enumerate(zip(shards, starts, fragments)):
        if shard is None or shard.numel() == 0:
            continue
        if frag is None or frag.dtype != torch.uint8 or frag.dim() != 1:
            raise TypeError(f"fragment {i}: expected a flat uint8 tensor of packed bytes, got {_describe(frag)}")
        want = ((int(start) + shard.numel() + 1) >> 1) - (int(start) >> 1)
        if frag.numel() != want:
            raise ValueError(
                f"fragment {i}: has {frag.numel()} bytes, shard [{start}, {int(start) + shard.numel()}) needs "
                f"{want} (bytes [start >> 1, (end + 1) >> 1) of rowwise_data)"
            )
        if frag.device != shard.device:
            raise ValueError(f"fragment {i} is on {frag.device} but its shard is on {shard.device}")
        if not frag.is_contiguous():
            raise ValueError(f"fragment {i}: must be contiguous")


def _describe(t) -> str:
    if t is None:
        return "None"
    return f"{t.dtype} tensor of shape {list(t.shape)}"


def check_owner_ranges(shapes, enc_ranges, own_ranges, compact: torch.Tensor, enc: torch.Tensor,
                       amax_outs, amaxes: torch.Tensor) -> int:
    """owner_scales arguments; returns the number of compact bytes written."""
    n = len(shapes)
    if not (len(enc_ranges) == len(own_ranges) == len(amax_outs) == n):
        raise ValueError(f"got {n} shapes, {len(enc_ranges)} enc_ranges, {len(own_ranges)} own_ranges and "
                         f"{len(amax_outs)} amax_outs; pass one of each per weight")
    total_tiles, owned = 0, 0
    for i, ((m, k), (lo, hi), (a, b)) in enumerate(zip(shapes, enc_ranges, own_ranges)):
        tiles = num_tiles(m, k)
        total_tiles += tiles
        if not 0 <= lo <= hi <= tiles:
            raise ValueError(f"weight {i}: enc range [{lo}, {hi}) is not inside its {tiles} tiles")
        if a != b and not lo <= a <= b <= hi:
            raise ValueError(f"weight {i}: own range [{a}, {b}) is not inside its enc range [{lo}, {hi})")
        owned += max(0, b - a)
    for t, numel, dtype, label in ((amaxes, n + total_tiles, torch.float32, "amaxes"),
                                   (enc, total_tiles, torch.float32, "enc")):  # fmt: skip
        if t.dtype != dtype or t.dim() != 1 or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"owner_scales {label}: need a contiguous flat {dtype} tensor of {numel} entries, got "
                             f"{t.dtype} {list(t.shape)}")
    if compact.dtype != torch.uint8 or compact.dim() != 1 or compact.numel() < owned or not compact.is_contiguous():
        raise ValueError(f"owner_scales compact: need a contiguous flat uint8 tensor of >= {owned} bytes, got "
                         f"{compact.dtype} {list(compact.shape)}")
    for i, ao in enumerate(amax_outs):
        if ao.dtype != torch.float32 or ao.numel() < 1 or ao.device != amaxes.device:
            raise ValueError(f"amax_out {i}: need an fp32 tensor of 1 entry on {amaxes.device}, got "
                             f"{ao.dtype} {list(ao.shape)} on {ao.device}")
    if enc.device != amaxes.device or compact.device != amaxes.device:
        raise ValueError(f"owner_scales: amaxes, enc and compact must share one device, got {amaxes.device}, "
                         f"{enc.device}, {compact.device}")
    return owned


def check_sources(shapes, sources, gathered: torch.Tensor, scale_invs) -> None:
    """expand_scales arguments: segments start at tile 0, increase, and read inside `gathered`."""
    if not (len(sources) == len(scale_invs) == len(shapes)):
        raise ValueError(f"got {len(shapes)} shapes, {len(sources)} sources and {len(scale_invs)} scale_invs")
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or not gathered.is_contiguous():
        raise ValueError(f"gathered scales: need a contiguous flat uint8 tensor, got {gathered.dtype} "
                         f"{list(gathered.shape)}")
    for i, ((m, k), segs, si) in enumerate(zip(shapes, sources, scale_invs)):
        tiles = num_tiles(m, k)
        starts = [int(s) for s, _ in segs]
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= tiles:
            raise ValueError(f"weight {i}: segment starts {starts} must increase strictly from 0 below {tiles} tiles")
        for (s, off), e in zip(segs, [*starts[1:], tiles]):
            if s + off < 0 or e + off > gathered.numel():
                raise ValueError(f"weight {i}: tiles [{s}, {e}) read bytes [{s + off}, {e + off}) outside the "
                                 f"{gathered.numel()} gathered bytes")
        want = rowwise_scale_shape(m, k)
        if si.dtype != torch.uint8 or tuple(si.shape) != want or si.device != gathered.device:
            raise ValueError(f"scale_inv {i}: need uint8 {list(want)} on {gathered.device}, got {si.dtype} "
                             f"{list(si.shape)} on {si.device}")
