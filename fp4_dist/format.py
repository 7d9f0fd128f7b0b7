"""The NVFP4 2D weight format in numbers: constants, the dtypes around it, and shape arithmetic (ints only).

Layouts of a weight with logical shape [M, K] (spec section 3)::

    rowwise_data          uint8 [M, K/2]                              even column -> low nibble
    rowwise_scale_inv     uint8 [roundup(M,128), roundup(ceil(K/16),4)] tile scale repeated on its 16 rows
    columnwise_data       uint8 [K, M/2]                              nibble transpose of rowwise (M even)
    columnwise_scale_inv  uint8 [roundup(K,128), roundup(ceil(M/16),4)]
    amax                  fp32  [1]

Padding of both scale arrays is always zero.
"""

from __future__ import annotations

import torch

TILE = 16
"""Side of the square quantization tile (16x16 elements share one E4M3 scale)."""

FP8_BLOCK = 128
"""Side of the square block of an FP8 block copy (128x128 E4M3 elements share one fp32 scale: Hopper's block-scaled
FP8 GEMMs read weights in this form)."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_NUMERATOR = 2688.0
"""E4M3_MAX * E2M1_MAX, folded into one exact fp32 constant as TransformerEngine does."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each 3-bit E2M1 code; bit 3 (0x8) of a nibble is the sign."""

NUMERICS = ("te", "te-2.14")
"""`te`: TransformerEngine main, d_t = a_t * (S * fp32(1/6)); `te-2.14`: d_t = (a_t / 6) * S."""

DEFAULT_NUMERICS = "te"
"""The block-scale formula every entry point uses unless told otherwise (the one place that says so)."""

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What an NVFP4 weight computes in: values are rounded to it before quantization, and dequantize writes it."""

MASTER_DTYPES = (torch.float32, torch.bfloat16)
"""What a master shard (the cast's source) may be."""

SCALE_ROW_ALIGN = 128
SCALE_COL_ALIGN = 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def tile_grid(m: int, k: int) -> tuple[int, int]:
    """(tiles along M, tiles along K); ragged edge tiles count as whole tiles."""
    return ceil_div(m, TILE), ceil_div(k, TILE)


def is_tile_grid(scale_shape, m: int, k: int) -> bool:
    """Whether tile scales of this shape are the compact tile grid [ceil(M/16), ceil(K/16)] (as all-gathered)
    rather than row-expanded [roundup(M, 128), roundup(ceil(K/16), 4)]: the two shapes never coincide."""
    return tuple(scale_shape) == tile_grid(m, k)


def num_tiles(m: int, k: int) -> int:
    tm, tk = tile_grid(m, k)
    return tm * tk


def tile_offsets(shapes) -> tuple[tuple[int, ...], int]:
    """(offset of each weight's tile (0, 0) when the tiles of `shapes` are packed row-major one weight after the
    other, total tiles): the layout of every per-tile array of a list of weights (amaxes, encode multipliers)."""
    offsets, acc = [], 0
    for m, k in shapes:
        offsets.append(acc)
        acc += num_tiles(m, k)
    return tuple(offsets), acc


# ----------------------------------------------------------------------------------------------- packing
# Two E2M1 values share a byte (even element in the low nibble), so element ranges map to byte ranges and
# ranges owned by different ranks must meet at even element offsets.


def byte_window(start: int, numel: int) -> tuple[int, int]:
    """[lo, hi): the bytes of a weight's flat `rowwise_data` that hold elements [start, start + numel) (the
    fragment a partial cast of that shard writes)."""
    return start >> 1, (start + numel + 1) >> 1


def check_even_boundary(name: str, start: int, end: int, *, end_may_be_odd: bool = False) -> None:
    """Raise ValueError unless the shard [start, end) of a weight starts (and ends) on a whole byte.

    `end_may_be_odd`: the stage kernels write nibbles exactly, so a shard may end mid-byte; it is the caller's
    byte exchange (all-gather) that needs both ends even.
    """
    odd = [b for b in ((start,) if end_may_be_odd else (start, end)) if b % 2]
    if odd and end > start:
        raise ValueError(
            f"{name}: shard [{start}, {end}) has an odd boundary at element {odd[0]}, which splits a byte (two FP4 "
            "values share one); shard boundaries must be even element offsets (fp4_dist.buffers.build_layout keeps "
            "them even)"
        )


def packed_bytes(numel: int) -> int:
    """Bytes holding `numel` E2M1 values (an even count: weights have K % 16 == 0, shards even boundaries)."""
    return numel // 2


def has_columnwise(m: int) -> bool:
    """Whether a weight with M rows can have a columnwise copy: it packs pairs of rows into a byte."""
    return m % 2 == 0


def whole_bands(row0: int, rows: int) -> bool:
    """Whether rows [row0, row0 + rows) are whole 16-row tile bands (every tile of them complete)."""
    return row0 % TILE == 0 and rows % TILE == 0


def band_tiles(row0: int, rows: int, k: int) -> tuple[int, int]:
    """Flat tiles [a, b) (row-major tile grid of a weight with K = `k`) of the whole bands [row0, row0 + rows)."""
    tk = ceil_div(k, TILE)
    return (row0 // TILE) * tk, ((row0 + rows) // TILE) * tk


def rowwise_data_shape(m: int, k: int) -> tuple[int, int]:
    return m, packed_bytes(k)


def rowwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return round_up(m, SCALE_ROW_ALIGN), round_up(ceil_div(k, TILE), SCALE_COL_ALIGN)


def columnwise_data_shape(m: int, k: int) -> tuple[int, int]:
    return k, packed_bytes(m)


def columnwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return round_up(k, SCALE_ROW_ALIGN), round_up(ceil_div(m, TILE), SCALE_COL_ALIGN)


def check_numerics(numerics: str) -> str:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    return numerics


def check_weight_shape(shape, name: str = "weight") -> tuple[int, int]:
    """Return (M, K) of an NVFP4-quantizable 2D shape, or raise a ValueError naming the rule."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(
            f"{name}: NVFP4 weights are 2D [M, K], got a {len(shape)}D shape {list(shape)}; "
            "reshape to 2D or keep this tensor in high precision"
        )
    m, k = shape
    if m < 1 or k < 1:
        raise ValueError(f"{name}: shape {list(shape)} is empty; NVFP4 needs M >= 1 and K >= 16")
    if k % TILE:
        raise ValueError(
            f"{name}: K = {k} is not a multiple of {TILE} (shape {list(shape)}); NVFP4 16x16 tiles need "
            "K % 16 == 0: pad the layer's input features or keep this weight in high precision"
        )
    return m, k
