"""FSDP2's wire format for NVFP4 weights: what a rank puts into the all-gather and how the gathered bytes are read.

An "nvfp4"-mode weight is sharded in whole 16-row tile bands, so each rank sends its own bands complete::

    all-gather inputs   packed E2M1 bytes  uint8 [rows, K/2]            (`shard_buffers`, written by the cast)
                        tile scale bytes   uint8 [rows/16, ceil(K/16)]  (`scale_views` of the cast's compact buffer)
    metadata            the whole weight's amax, fp32 [1] (identical on every rank)
    gathered            [M, K/2] bytes and the [ceil(M/16), ceil(K/16)] tile grid, in rank order

At world size 1 FSDP2 passes one input through, so the scales travel as metadata there (`pack`, `unpack`).
A "bf16"-mode weight sends its rows in the model dtype, padded to FSDP2's even shard size, and is quantized
after the gather. `gathered_bytes` is the per-weight size of all this, for reports.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..format import TILE, band_tiles, ceil_div, packed_bytes, rowwise_data_shape, tile_grid, whole_bands


def gathered_bytes(shape: tuple[int, int], mode: str) -> int:
    """All-gathered bytes of one weight: packed data + tile scale grid ("nvfp4"), or bf16 values ("bf16")."""
    m, k = shape
    if mode == "nvfp4":
        return packed_bytes(m * k) + (m // TILE) * ceil_div(k, TILE)
    return 2 * m * k


def local_tiles(shape: tuple[int, int], row0: int, rows: int) -> tuple[int, int]:
    """Flat tiles [a, b) this rank holds of a weight: its whole bands [row0, row0 + rows)."""
    if not whole_bands(row0, rows):
        raise ValueError(f"rows [{row0}, {row0 + rows}) of a {list(shape)} weight are not whole {TILE}-row tile "
                         "bands, but the weight was set up to gather NVFP4 tile bands: it is sharded over more ranks "
                         "than fully_shard_nvfp4 was told (pass the mesh FSDP2 shards over, or create the process "
                         "group before calling it); weights whose shards are not whole bands are gathered in bf16")
    return band_tiles(row0, rows, shape[1])


def shard_buffers(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes [rows, K/2], amax [1]) of one rank's bands, zeroed: what the cast writes."""
    return (torch.zeros(rowwise_data_shape(rows, k), dtype=torch.uint8, device=device),
            torch.zeros(1, dtype=torch.float32, device=device))  # fmt: skip


def scale_views(compact: torch.Tensor, shapes: Sequence[tuple[int, int]], tiles: Sequence[tuple[int, int]],
                rows: Sequence[int]) -> list[torch.Tensor]:  # fmt: skip
    """Each weight's all-gather scale input, a [rows/16, ceil(K/16)] view of `compact`: owner_scales writes the
    scale bytes of a group's weights one after the other, in `tiles` order."""
    views, off = [], 0
    for (m, k), (a, b), r in zip(shapes, tiles, rows):
        views.append(compact[off:off + b - a].view(r // TILE, tile_grid(m, k)[1]))
        off += b - a
    return views


def pack(packed: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, world: int):
    """(all-gather inputs, metadata) of an "nvfp4" weight's shard for FSDP2's ``fsdp_pre_all_gather``."""
    if world == 1:
        return (packed,), (amax, scales)
    return (packed, scales), (amax,)


def unpack(outputs, metadata, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rowwise data [M, K/2], tile scale grid [ceil(M/16), ceil(K/16)], amax) of a gathered "nvfp4" weight, as
    views of FSDP2's gathered buffers (`pack`'s inverse); `grid`: the weight's `format.tile_grid`."""
    data, scales = (outputs[0], metadata[1]) if len(outputs) == 1 else outputs
    tm, tk = grid
    if scales.shape != grid:  # FSDP2 gives the [rows/16, tiles_k] inputs back stacked, so this is rare
        scales = scales.reshape(-1)[: tm * tk].view(tm, tk)
    return data, scales, metadata[0]


def pack_rows(values: torch.Tensor, m: int, world: int) -> tuple:
    """All-gather inputs of a "bf16" weight's rows: FSDP2 needs every rank's shard padded to ceil(M / world)."""
    rows = ceil_div(m, world)
    if values.shape[0] != rows:
        values = torch.cat([values, values.new_zeros((rows - values.shape[0], *values.shape[1:]))])
    return (values,)
