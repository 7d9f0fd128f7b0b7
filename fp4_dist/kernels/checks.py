"""Argument checks of every stage, for every device: a caller mistake raises here, before any launch or write.

One function per stage returns what the stage needs normalised (shapes as int tuples, the device). The CUDA
path runs them when it builds a plan (`fp4_dist.kernels.stages`), the reference path on every call.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..format import (
    MASTER_DTYPES,
    MODEL_DTYPES,
    TILE,
    byte_window,
    check_even_boundary,
    check_numerics,
    check_weight_shape,
    columnwise_data_shape,
    columnwise_scale_shape,
    has_columnwise,
    is_tile_grid,
    num_tiles,
    rowwise_data_shape,
    rowwise_scale_shape,
    tile_grid,
    tile_offsets,
)

Shape = tuple[int, int]



NOTHING_WRITTEN = "No weight, scale or amax was written"


def non_finite_error(name: str, where: str = "", outcome: str = NOTHING_WRITTEN) -> ValueError:
    """The error of a weight whose values hold inf or NaN (NVFP4 has no code for them); `where` says where the
    values were seen (e.g. " on some rank"), `outcome` what became of the weights."""
    return ValueError(f"{name}: values are not finite (non-finite: inf or NaN{where}); NVFP4 cannot encode them. "
                      f"{outcome}")


# --------------------------------------------------------------------------------------------------- parts
def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"


def one_device(tensors, what: str) -> torch.device:
    """The device of the non-empty tensors (all must share it), else of any tensor; cpu when there is none."""
    devices, fallback = set(), None
    for t in tensors:
        if t is None:
            continue
        if t.numel():
            devices.add(t.device)
        elif fallback is None:
            fallback = t.device
    if len(devices) > 1:
        raise ValueError(f"{what}: tensors live on several devices {sorted(map(str, devices))}; put them on one device")
    if devices:
        return devices.pop()
    return fallback if fallback is not None else torch.device("cpu")


def _on(t: torch.Tensor, device: torch.device, label: str) -> None:
    if t.device != device:
        raise ValueError(f"{label} is on {t.device}, the other tensors on {device}; put them on one device")


def check_fp32_vector(t, numel: int, device: torch.device, label: str) -> None:
    """A contiguous fp32 tensor of exactly `numel` entries on `device` (amax buffers, encode multipliers)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"{label}: need a contiguous fp32 tensor of {numel} entries, got {_describe(t)}")
    _on(t, device, label)


def check_u8(t, shape, device: torch.device, label: str) -> None:
    """A contiguous uint8 tensor of `shape` on `device` (packed data and scale arrays)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != tuple(shape) \
            or not t.is_contiguous():
        raise ValueError(f"{label}: need a contiguous uint8 tensor {list(shape)}, got {_describe(t)}")
    _on(t, device, label)


def check_amax_out(t, device: torch.device, label: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() < 1:
        raise ValueError(f"{label}: need an fp32 tensor of 1 entry, got {_describe(t)}")
    _on(t, device, label)


def _shapes(shapes) -> list[Shape]:
    return [check_weight_shape(s, f"weight {i}") for i, s in enumerate(shapes)]


def _same_length(**lists) -> None:
    if len({len(v) for v in lists.values()}) > 1:
        got = ", ".join(f"{len(v)} {k}" for k, v in lists.items())
        raise ValueError(f"got {got}; pass one of each per weight")


def check_shards(shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int], shapes: Sequence[Shape], *,
                 round_to: torch.dtype, even_start: bool = False) -> torch.device:  # fmt: skip
    """Each shard is None/empty or a contiguous 1D fp32/bf16 tensor inside its weight; one device for all."""
    _same_length(shards=shards, starts=starts, shapes=shapes)
    if round_to not in MODEL_DTYPES:
        raise TypeError(f"round_to must be one of {MODEL_DTYPES}, got {round_to}")
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        if shard is None:
            continue
        if not isinstance(shard, torch.Tensor):
            raise TypeError(f"shard {i}: expected a torch.Tensor or None, got {type(shard).__name__}")
        if shard.dtype not in MASTER_DTYPES:
            raise TypeError(f"shard {i}: dtype {shard.dtype} is not supported; pass fp32 or bf16 master values")
        if shard.dim() != 1 or not shard.is_contiguous():
            raise ValueError(f"shard {i}: must be a flat contiguous 1D tensor (got shape {list(shard.shape)}, "
                             f"contiguous={shard.is_contiguous()}); pass shard.reshape(-1).contiguous()")
        start = int(start)
        end = start + shard.numel()
        if start < 0 or end > m * k:
            raise ValueError(f"shard {i}: elements [{start}, {end}) fall outside the {m}x{k} weight ([0, {m * k}))")
        if even_start:
            check_even_boundary(f"shard {i}", start, end, end_may_be_odd=True)
    return one_device(shards, "shards")


# --------------------------------------------------------------------------------------------------- stages
def amax_args(shards, starts, shapes, round_to, out: Optional[torch.Tensor]) -> tuple[list[Shape], torch.device]:
    """partial_amax: (shapes, device)."""
    shapes = _shapes(shapes)
    device = check_shards(shards, starts, shapes, round_to=round_to)
    if out is not None:
        if not any(s is not None and s.numel() for s in shards):
            device = out.device
        check_fp32_vector(out, len(shapes) + tile_offsets(shapes)[1], device, "partial_amax out")
    return shapes, device


def scale_args(amaxes, shapes, scale_invs, amax_outs, numerics: str, enc: Optional[torch.Tensor]) -> list[Shape]:
    """fused_scale: shapes."""
    check_numerics(numerics)
    shapes = _shapes(shapes)
    _same_length(shapes=shapes, scale_invs=scale_invs, amax_outs=amax_outs)
    tiles = tile_offsets(shapes)[1]
    device = amaxes.device
    check_fp32_vector(amaxes, len(shapes) + tiles, device, "fused_scale amaxes")
    if enc is not None:
        check_fp32_vector(enc, tiles, device, "fused_scale enc")
    for i, ((m, k), si, ao) in enumerate(zip(shapes, scale_invs, amax_outs)):
        check_u8(si, rowwise_scale_shape(m, k), device, f"scale_inv {i}")
        check_amax_out(ao, device, f"amax_out {i}")
    return shapes


def cast_args(shards, starts, shapes, enc, fragments, round_to) -> list[Shape]:
    """partial_cast: shapes. Shards start on a whole byte; fragment i is bytes `byte_window(start, numel)`."""
    shapes = _shapes(shapes)
    device = check_shards(shards, starts, shapes, round_to=round_to, even_start=True)
    _same_length(shards=shards, fragments=fragments)
    owned = False
    for i, (shard, start, frag) in enumerate(zip(shards, starts, fragments)):
        if shard is None or shard.numel() == 0:
            continue
        owned = True
        lo, hi = byte_window(int(start), shard.numel())
        if not isinstance(frag, torch.Tensor) or frag.dtype != torch.uint8 or frag.dim() != 1:
            raise TypeError(f"fragment {i}: expected a flat uint8 tensor of packed bytes, got {_describe(frag)}")
        if frag.numel() != hi - lo or not frag.is_contiguous():
            raise ValueError(f"fragment {i}: need {hi - lo} contiguous bytes for shard [{start}, "
                             f"{int(start) + shard.numel()}) (bytes [start >> 1, (end + 1) >> 1) of rowwise_data), "
                             f"got {_describe(frag)}")
        _on(frag, device, f"fragment {i}")
    if owned:
        check_fp32_vector(enc, tile_offsets(shapes)[1], device, "partial_cast enc")
    return shapes


def owner_args(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics):
    """owner_scales: (shapes, enc_ranges, own_ranges) as ints."""
    check_numerics(numerics)
    shapes = _shapes(shapes)
    enc_ranges = [(int(a), int(b)) for a, b in enc_ranges]
    own_ranges = [(int(a), int(b)) for a, b in own_ranges]
    _same_length(shapes=shapes, enc_ranges=enc_ranges, own_ranges=own_ranges, amax_outs=amax_outs)
    owned, tiles = 0, tile_offsets(shapes)[1]
    for i, ((m, k), (lo, hi), (a, b)) in enumerate(zip(shapes, enc_ranges, own_ranges)):
        if not 0 <= lo <= hi <= num_tiles(m, k):
            raise ValueError(f"weight {i}: enc range [{lo}, {hi}) is not inside its {num_tiles(m, k)} tiles")
        if a != b and not lo <= a <= b <= hi:
            raise ValueError(f"weight {i}: own range [{a}, {b}) is not inside its enc range [{lo}, {hi})")
        owned += max(0, b - a)
    device = amaxes.device
    check_fp32_vector(amaxes, len(shapes) + tiles, device, "owner_scales amaxes")
    check_fp32_vector(enc, tiles, device, "owner_scales enc")
    if not isinstance(compact, torch.Tensor) or compact.dtype != torch.uint8 or compact.dim() != 1 \
            or compact.numel() < owned or not compact.is_contiguous():
        raise ValueError(f"owner_scales compact: need a contiguous flat uint8 tensor of >= {owned} bytes, got "
                         f"{_describe(compact)}")
    _on(compact, device, "owner_scales compact")
    for i, ao in enumerate(amax_outs):
        check_amax_out(ao, device, f"amax_out {i}")
    return shapes, enc_ranges, own_ranges


def expand_args(gathered, shapes, sources, scale_invs):
    """expand_scales: (shapes, sources as int tuples); segments start at tile 0, increase, read inside `gathered`."""
    shapes = _shapes(shapes)
    sources = [tuple((int(s), int(o)) for s, o in segs) for segs in sources]
    _same_length(shapes=shapes, sources=sources, scale_invs=scale_invs)
    if not isinstance(gathered, torch.Tensor) or gathered.dtype != torch.uint8 or gathered.dim() != 1 \
            or not gathered.is_contiguous():
        raise ValueError(f"gathered scales: need a contiguous flat uint8 tensor, got {_describe(gathered)}")
    for i, ((m, k), segs, si) in enumerate(zip(shapes, sources, scale_invs)):
        tiles = num_tiles(m, k)
        starts = [s for s, _ in segs]
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= tiles:
            raise ValueError(f"weight {i}: segment starts {starts} must increase strictly from 0 below {tiles} tiles")
        for (s, off), e in zip(segs, [*starts[1:], tiles]):
            if s + off < 0 or e + off > gathered.numel():
                raise ValueError(f"weight {i}: tiles [{s}, {e}) read bytes [{s + off}, {e + off}) outside the "
                                 f"{gathered.numel()} gathered bytes")
        check_u8(si, rowwise_scale_shape(m, k), gathered.device, f"scale_inv {i}")
    return shapes, sources


def _rowwise_shape(data, i: int, *, even_m: bool = False) -> Shape:
    """(M, K) of a packed [M, K/2] rowwise_data."""
    if not isinstance(data, torch.Tensor) or data.dim() != 2 or (2 * data.shape[1]) % TILE or data.shape[1] == 0:
        raise ValueError(f"rowwise_data {i}: need a 2D [M, K/2] uint8 tensor with K % 16 == 0, got {_describe(data)}")
    m, k = data.shape[0], 2 * data.shape[1]
    if even_m and not has_columnwise(m):
        raise ValueError(f"rowwise_data {i}: M = {m} is odd; the columnwise copy packs pairs of rows into a byte, "
                         "so it needs an even M")
    return m, k


def nibble_args(rowwise_datas, columnwise_datas) -> None:
    _same_length(rowwise_datas=rowwise_datas, columnwise_datas=columnwise_datas)
    device = one_device(rowwise_datas, "nibble_transpose")
    for i, (src, dst) in enumerate(zip(rowwise_datas, columnwise_datas)):
        m, k = _rowwise_shape(src, i, even_m=True)
        check_u8(src, rowwise_data_shape(m, k), device, f"rowwise_data {i}")
        check_u8(dst, columnwise_data_shape(m, k), device, f"columnwise_data {i}")


def scalet_args(rowwise_scale_invs, columnwise_scale_invs, shapes) -> list[Shape]:
    shapes = _shapes(shapes)
    _same_length(rowwise=rowwise_scale_invs, columnwise=columnwise_scale_invs, shapes=shapes)
    device = one_device(rowwise_scale_invs, "scale_transpose")
    for i, (src, dst, (m, k)) in enumerate(zip(rowwise_scale_invs, columnwise_scale_invs, shapes)):
        check_u8(src, rowwise_scale_shape(m, k), device, f"rowwise_scale_inv {i}")
        check_u8(dst, columnwise_scale_shape(m, k), device, f"columnwise_scale_inv {i}")
    return shapes


def dequant_args(rowwise_datas, scale_invs, amaxes, outs) -> None:
    _same_length(rowwise_datas=rowwise_datas, scale_invs=scale_invs, amaxes=amaxes, outs=outs)
    device = one_device(rowwise_datas, "dequantize")
    for i, (data, si, amax, out) in enumerate(zip(rowwise_datas, scale_invs, amaxes, outs)):
        m, k = _rowwise_shape(data, i)
        check_u8(data, rowwise_data_shape(m, k), device, f"rowwise_data {i}")
        # The row-expanded rowwise_scale_inv or the compact tile grid (never the same shape: ceil(M/16) rows
        # against roundup(M, 128)).
        grid = tile_grid(m, k)
        compact = isinstance(si, torch.Tensor) and is_tile_grid(si.shape, m, k)
        check_u8(si, grid if compact else rowwise_scale_shape(m, k), device,
                 f"rowwise_scale_inv {i} (or its tile grid {list(grid)})")
        check_amax_out(amax, device, f"amax {i}")
        if not isinstance(out, torch.Tensor) or out.dtype not in MODEL_DTYPES or tuple(out.shape) != (m, k) \
                or not out.is_contiguous():
            raise ValueError(f"dequantize out {i}: need a contiguous bf16/fp16/fp32 tensor [{m}, {k}], got "
                             f"{_describe(out)}")
        _on(out, device, f"dequantize out {i}")


def quantize_source(x, name: str) -> tuple[torch.Tensor, Shape]:
    """(flat contiguous fp32/bf16 values, (M, K)) of a 2D fp32/bf16/fp16 tensor to quantize whole."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if hasattr(x, "rowwise_data"):
        raise TypeError(f"{name} is already an NVFP4Tensor; dequantize() it first if you mean to re-quantize")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise TypeError(f"{name}: NVFP4 quantizes fp32/bf16/fp16 values, got dtype {x.dtype}")
    shape = check_weight_shape(x.shape, name)
    if x.dtype not in MASTER_DTYPES:
        x = x.float()  # fp16 -> fp32 is exact; the stages read fp32 or bf16
    return x.detach().reshape(-1).contiguous(), shape
