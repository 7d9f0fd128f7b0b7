"""Work tables of the CUDA stage kernels: what one launch reads, built once per set of tensors.

A *plan* is an int64 descriptor table (one row per weight, field order of the structs in cuda/common.cuh,
mirrored by the *_FIELDS tuples below; a CPU test compares the two), the prefix sum of each weight's work
units, and optionally a side table; all uploaded once from pinned memory with a non-blocking copy (no host
sync). A plan holds addresses, not tensors: it is valid for any tensors at those addresses with the same
dtypes, shapes and strides, which is what `fp4_dist.kernels.stages` caches plans by.

Builders take arguments that `fp4_dist.kernels.checks` has accepted and only lay them out.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..format import (
    TILE,
    ceil_div,
    columnwise_scale_shape,
    is_tile_grid,
    rowwise_scale_shape,
    tile_grid,
    tile_offsets,
)

SHARD_FIELDS = (
    "src", "dst", "start", "end", "m", "k", "tiles_k", "tile_off", "band_lo", "n_chunks", "owned_units",
    "zero_lo", "zero_hi", "zero_units", "flags", "pad_",
)  # fmt: skip
SCALE_FIELDS = ("scale_inv", "amax_out", "m", "tiles_m", "tiles_k", "cols_pad", "tile_off", "n_chunks", "flags", "pad_")
TRANSPOSE_FIELDS = ("src", "dst", "m", "k", "n_mt", "flags")
SCALET_FIELDS = ("src", "dst", "k", "tiles_m", "tiles_k", "src_cols", "dst_cols", "dst_rows", "flags", "pad_")
OWNER_FIELDS = ("amax_out", "tile_off", "enc_lo", "enc_hi", "own_lo", "own_hi", "own_base", "pad_")
EXPAND_FIELDS = (
    "scale_inv", "m", "tiles_m", "tiles_k", "cols_pad", "n_chunks", "seg_begin", "seg_count", "flags", "pad_",
)  # fmt: skip
DEQUANT_FIELDS = ("src", "scale", "amax", "dst", "m", "k", "scale_band", "n_chunks", "flags", "scale_row")

# Flag bits and unit sizes of common.cuh.
FLAG_BF16_SRC, FLAG_VEC_SRC, FLAG_VEC_DST, FLAG_VEC16_DST, FLAG_VEC16_SRC = 1, 2, 4, 8, 16
FLAG_OUT = {torch.bfloat16: 0, torch.float16: 32, torch.float32: 64}  # dequantize output dtype (kFlagOutFp16/32)
CHUNK_COLS, ZERO_CHUNK, SCALE_CHUNK, SCALET_WORDS, OWNER_CHUNK = 256, 1024, 1024, 256, 1024
# Nibble transpose unit shapes (rows x columns of the weight; transpose.cu instantiates each) and the default:
# 128x256 writes 64-byte columnwise segments (H200: 81/84% of copy at 2^28/2^30 against 77/79% for 64x512).
NIBBLE_TILES = {"64x512": (64, 512), "128x256": (128, 256)}
NIBBLE_TILE = "128x256"

Shape = tuple[int, int]


# current_raw_stream(index) -> the cudaStream_t of torch's current stream on device `index`. Every launch asks, so
# it is torch's private accessor where present (the one inductor uses): a tenth of the host time of building a
# torch.cuda.Stream.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a CUDA graph (False where CUDA never started: a CPU run)."""
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


class Plan:
    """A descriptor table and unit prefix sum on one device, ready to be read by one stage kernel."""

    def __init__(self, device: int, rows: list[list[int]], fields: int, unit_counts: list[int], *, tiles: int,
                 scratch_words: int = 0, extra: Sequence[int] = ()):  # fmt: skip
        n = len(rows)
        self.tiles = tiles  # tiles of all weights: the length of enc, and of the amax buffer less n
        host = torch.empty(n * fields + n + 1 + len(extra), dtype=torch.int64, pin_memory=True)
        arr = host.numpy()
        arr[: n * fields] = np.asarray(rows, dtype=np.int64).reshape(-1)
        arr[n * fields] = 0
        arr[n * fields + 1 : n * fields + n + 1] = np.cumsum(np.asarray(unit_counts, dtype=np.int64))
        arr[n * fields + n + 1 :] = np.asarray(extra, dtype=np.int64)
        stream = torch.cuda.current_stream(device)
        self.device, self.n, self.units = device, n, int(arr[n * fields + n])
        self.variant = None  # kernel variant the table was laid out for, where a stage has several
        self._host = host  # kept alive: the copy below reads it asynchronously (and a captured copy at each replay)
        self._dev = host.to(torch.device("cuda", device), non_blocking=True)
        # Kept zero between launches by the kernel itself (amax.cu); zeroed once here.
        self.scratch = torch.zeros(max(scratch_words, 1), dtype=torch.int32, device=self._dev.device)
        self.table = self._dev.data_ptr()
        self.unit_begin = self.table + 8 * n * fields
        self.extra = self.unit_begin + 8 * (n + 1)  # side table (expand_scales: tile segments)
        # Built inside a CUDA graph capture, the upload and the zeroing above are nodes of the graph: nothing has
        # run yet, so a use outside the graph uploads again first (`on_current_stream`).
        self._in_graph = capturing()
        self._ready = None if self._in_graph else torch.cuda.Event()
        if self._ready is not None:
            self._ready.record(stream)
        else:
            GRAPHED.append(self)
        self._streams = {stream.cuda_stream}
        self.bound = None  # the launch bound once, for a stage that reads nothing but the plan (stages.py)

    def on_current_stream(self) -> "Plan":
        """Order the upload before this stream's work, the first time the plan is used on another stream.

        Under CUDA graph capture nothing waits: an event recorded outside the capture cannot be waited on inside
        it, and none is needed, because torch.cuda.graph (which Megatron's graphs use) synchronizes the device
        before it begins a capture, so the upload of a plan built before the capture has completed. A plan a
        captured graph reads is kept for the life of the process (`GRAPHED`): the graph replays its addresses."""
        if current_raw_stream(self.device) not in self._streams:
            stream = torch.cuda.current_stream(self.device)
            if capturing():
                GRAPHED.append(self)
            elif self._in_graph:  # first use outside the graph it was built in: the table holds nothing yet
                self._dev.copy_(self._host, non_blocking=True)
                self.scratch.zero_()
                self._in_graph, self._ready = False, torch.cuda.Event()
                self._ready.record(stream)
            else:
                stream.wait_event(self._ready)
                self._dev.record_stream(stream)
                self.scratch.record_stream(stream)
            self._streams.add(stream.cuda_stream)
        return self


GRAPHED: list = []  # plans read by captured CUDA graphs: never freed, as a replay reads them at any time


# --------------------------------------------------------------------------------------------------------------
# partial_amax / partial_cast: shard descriptors


def _shard_row(shard, start: int, m: int, k: int, tile_off: int, dst: int, with_zeros: bool) -> tuple[list, int]:
    """ShardDesc row and unit count of one weight's shard (None/empty: nothing owned)."""
    tm, tk = tile_grid(m, k)
    n_chunks = ceil_div(k, CHUNK_COLS)
    if shard is None or shard.numel() == 0:
        zero_units = ceil_div(tm * tk, ZERO_CHUNK) if with_zeros else 0
        return [0, 0, 0, 0, m, k, tk, tile_off, 0, n_chunks, 0, 0, 0, zero_units, 0, 0], zero_units
    end = start + shard.numel()
    band_lo, band_hi = (start // k) // TILE, ((end - 1) // k) // TILE
    owned = (band_hi - band_lo + 1) * n_chunks
    zero_lo, zero_hi = band_lo * tk, (band_hi + 1) * tk
    zero_units = ceil_div(tm * tk - (zero_hi - zero_lo), ZERO_CHUNK) if with_zeros else 0
    bf16 = shard.dtype == torch.bfloat16
    src = shard.data_ptr()
    flags = FLAG_BF16_SRC if bf16 else 0
    if (src - start * shard.element_size()) % 16 == 0:  # element e % 8 == 0 sits on a 16-byte boundary
        flags |= FLAG_VEC_SRC
    if dst and (dst - (start >> 1)) % 4 == 0:  # the weight's byte 0 is 4-byte aligned
        flags |= FLAG_VEC_DST
    row = [src, dst, start, end, m, k, tk, tile_off, band_lo, n_chunks, owned, zero_lo, zero_hi, zero_units, flags, 0]
    return row, owned + zero_units


def amax_plan(index: int, shards, starts, shapes) -> Plan:
    offsets, tiles = tile_offsets(shapes)
    n = len(shapes)
    rows, units = [], []
    for shard, start, (m, k), off in zip(shards, starts, shapes, offsets):
        row, u = _shard_row(shard, int(start), m, k, n + off, 0, with_zeros=True)
        rows.append(row)
        units.append(u)
    return Plan(index, rows, len(SHARD_FIELDS), units, tiles=tiles, scratch_words=2 * n)


def cast_plan(index: int, shards, starts, shapes, fragments) -> Plan:
    offsets, tiles = tile_offsets(shapes)
    rows, units = [], []
    for shard, start, (m, k), frag, off in zip(shards, starts, shapes, fragments, offsets):
        owned = shard is not None and shard.numel()
        row, u = _shard_row(shard, int(start), m, k, off, frag.data_ptr() if owned else 0, with_zeros=False)
        rows.append(row)
        units.append(u)
    return Plan(index, rows, len(SHARD_FIELDS), units, tiles=tiles)


# --------------------------------------------------------------------------------------------------------------
# fused_scale, owner_scales, expand_scales


def _scale_rows(si: torch.Tensor, m: int, k: int) -> tuple[int, int, int]:
    """(units, n_chunks, flags) of one weight's row-expanded scale array: a unit is a 16-row band x 1024 columns."""
    rows_pad, cols_pad = rowwise_scale_shape(m, k)
    n_chunks = ceil_div(cols_pad, SCALE_CHUNK)
    return (rows_pad // TILE) * n_chunks, n_chunks, FLAG_VEC_DST if si.data_ptr() % 4 == 0 else 0


def scale_plan(index: int, shapes, scale_invs, amax_outs) -> Plan:
    offsets, tiles = tile_offsets(shapes)
    rows, units = [], []
    for (m, k), si, ao, off in zip(shapes, scale_invs, amax_outs, offsets):
        u, n_chunks, flags = _scale_rows(si, m, k)
        tm, tk = tile_grid(m, k)
        rows.append([si.data_ptr(), ao.data_ptr(), m, tm, tk, rowwise_scale_shape(m, k)[1], off, n_chunks, flags, 0])
        units.append(u)
    return Plan(index, rows, len(SCALE_FIELDS), units, tiles=tiles)


def owner_plan(index: int, shapes, enc_ranges, own_ranges, amax_outs) -> Plan:
    """OwnerDesc rows: encode multipliers of tiles [enc_lo, enc_hi), compact scale bytes of [own_lo, own_hi)
    at own_base (bases are consecutive in weight order), amax_out of every weight (so >= 1 unit each)."""
    offsets, tiles = tile_offsets(shapes)
    rows, units, base = [], [], 0
    for (lo, hi), (a, b), ao, off in zip(enc_ranges, own_ranges, amax_outs, offsets):
        rows.append([ao.data_ptr(), off, lo, hi, a, b, base, 0])
        units.append(max(1, ceil_div(hi - lo, OWNER_CHUNK)))
        base += b - a
    return Plan(index, rows, len(OWNER_FIELDS), units, tiles=tiles)


def expand_plan(index: int, shapes, sources, scale_invs) -> Plan:
    """ExpandDesc rows plus the side table of (tile_start, source offset) segments of every weight."""
    rows, units, segs = [], [], []
    for (m, k), src, si in zip(shapes, sources, scale_invs):
        u, n_chunks, flags = _scale_rows(si, m, k)
        tm, tk = tile_grid(m, k)
        rows.append([si.data_ptr(), m, tm, tk, rowwise_scale_shape(m, k)[1], n_chunks, len(segs) // 2, len(src),
                     flags, 0])  # fmt: skip
        units.append(u)
        for tile_start, offset in src:
            segs += [tile_start, offset]
    return Plan(index, rows, len(EXPAND_FIELDS), units, tiles=tile_offsets(shapes)[1], extra=segs)


# --------------------------------------------------------------------------------------------------------------
# Post-all-gather transposes


def nibble_plan(index: int, srcs, dsts, tile: str = NIBBLE_TILE) -> Plan:
    """TransposeDesc rows for units of `tile` (a key of NIBBLE_TILES); the plan remembers it as `variant`."""
    tile_m, tile_k = NIBBLE_TILES[tile]
    rows, units = [], []
    for src, dst in zip(srcs, dsts):
        m, k = src.shape[0], 2 * src.shape[1]
        s, d, row_bytes = src.data_ptr(), dst.data_ptr(), m // 2
        flags = FLAG_VEC_SRC if s % 4 == 0 else 0
        flags |= FLAG_VEC16_SRC if s % 16 == 0 and (k // 2) % 16 == 0 else 0
        flags |= FLAG_VEC_DST if d % 4 == 0 and row_bytes % 4 == 0 else 0
        flags |= FLAG_VEC16_DST if d % 16 == 0 and row_bytes % 16 == 0 else 0
        n_mt = ceil_div(m, tile_m)
        rows.append([s, d, m, k, n_mt, flags])
        units.append(n_mt * ceil_div(k, tile_k))
    plan = Plan(index, rows, len(TRANSPOSE_FIELDS), units, tiles=0)
    plan.variant = tile
    return plan


def scalet_plan(index: int, srcs, dsts, shapes) -> Plan:
    rows, units = [], []
    for src, dst, (m, k) in zip(srcs, dsts, shapes):
        tm, tk = tile_grid(m, k)
        dst_rows, dst_cols = columnwise_scale_shape(m, k)
        flags = FLAG_VEC_DST if dst.data_ptr() % 4 == 0 else 0
        rows.append([src.data_ptr(), dst.data_ptr(), k, tm, tk, src.shape[1], dst_cols, dst_rows, flags, 0])
        units.append((dst_rows // TILE) * ceil_div(dst_cols // 4, SCALET_WORDS))
    return Plan(index, rows, len(SCALET_FIELDS), units, tiles=0)


# --------------------------------------------------------------------------------------------------------------
# Compute copies


def dequant_plan(index: int, datas, scale_invs, amaxes, outs) -> Plan:
    """DequantDesc rows: [M, K] outputs (bf16 / fp16 / fp32) from rowwise data, scales (row-expanded or the
    compact tile grid) and amax; a unit is one 16-row band x 256 columns (one warp)."""
    rows, units = [], []
    for data, si, amax, out in zip(datas, scale_invs, amaxes, outs):
        m, k = data.shape[0], 2 * data.shape[1]
        src, dst = data.data_ptr(), out.data_ptr()
        flags = FLAG_OUT[out.dtype]
        flags |= FLAG_VEC_SRC if src % 4 == 0 else 0
        flags |= FLAG_VEC_DST if dst % 16 == 0 else 0
        n_chunks = ceil_div(k, CHUNK_COLS)
        # Scale bytes of a band's first row and the step to the next row: the row-expanded form has a row per
        # element row; the compact tile grid (ceil(M/16) rows) one per band, read by all 16 rows.
        compact = is_tile_grid(si.shape, m, k)
        band, step = (si.shape[1], 0) if compact else (TILE * si.shape[1], si.shape[1])
        rows.append([src, si.data_ptr(), amax.data_ptr(), dst, m, k, band, n_chunks, flags, step])
        units.append(ceil_div(m, TILE) * n_chunks)
    return Plan(index, rows, len(DEQUANT_FIELDS), units, tiles=0)
