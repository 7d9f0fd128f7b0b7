"""Argument checks shared by every device path of the stages: a caller mistake raises before any launch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

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
