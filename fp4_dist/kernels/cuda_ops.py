"""CUDA versions of the multi-tensor stages of `fp4_dist.kernels` (same signatures): one launch per stage.

Each stage turns its list of tensors into a *plan*: an int64 descriptor table (one row per weight, field order
of the structs in cuda/common.cuh, mirrored by the *_FIELDS tuples below) plus the prefix sum of each weight's
work units, uploaded once from pinned memory with a non-blocking copy (no host sync). Plans are cached under a
key made of everything the table depends on (pointers, sizes, dtypes, starts, shapes), so a training loop that
passes the same buffers every step pays only for the key and the launch. A plan's table never outlives its
key's meaning: it holds addresses, not tensors, and any change of address or size is a new key.

Arguments were checked by `fp4_dist.kernels` (shapes, shard ranges, dtypes) before the call arrives here;
this module adds the checks only the CUDA path needs (one device, output sizes, odd starts) when it builds a
plan, and re-checks the per-call tensors (out, enc) on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from ..format import TILE, ceil_div, columnwise_data_shape, columnwise_scale_shape, rowwise_scale_shape, tile_grid
from . import _launch

SHARD_FIELDS = (
    "src", "dst", "start", "end", "m", "k", "tiles_k", "tile_off", "band_lo", "n_chunks", "owned_units",
    "zero_lo", "zero_hi", "zero_units", "flags", "pad_",
)  # fmt: skip
SCALE_FIELDS = ("scale_inv", "amax_out", "m", "tiles_m", "tiles_k", "cols_pad", "tile_off", "n_chunks", "flags", "pad_")
TRANSPOSE_FIELDS = ("src", "dst", "m", "k", "n_mt", "flags")
SCALET_FIELDS = ("src", "dst", "k", "tiles_m", "tiles_k", "src_cols", "dst_cols", "dst_rows", "flags", "pad_")

# Flag bits and unit sizes of common.cuh.
FLAG_BF16_SRC, FLAG_VEC_SRC, FLAG_VEC_DST, FLAG_VEC16_DST, FLAG_VEC16_SRC = 1, 2, 4, 8, 16
CHUNK_COLS, ZERO_CHUNK, SCALE_CHUNK, SCALET_WORDS = 256, 1024, 1024, 256
NIBBLE_TILE_M, NIBBLE_TILE_K = 64, 512

Shape = tuple[int, int]


class Plan:
    """A descriptor table and unit prefix sum on one device, ready to be read by one stage kernel."""

    def __init__(self, device: int, rows: list[list[int]], fields: int, unit_counts: list[int], *, tiles: int,
                 scratch_words: int = 0):  # fmt: skip
        n = len(rows)
        self.tiles = tiles  # tiles of all weights: the length of enc, and of the amax buffer less n
        host = torch.empty(n * fields + n + 1, dtype=torch.int64, pin_memory=True)
        arr = host.numpy()
        arr[: n * fields] = np.asarray(rows, dtype=np.int64).reshape(-1)
        arr[n * fields] = 0
        arr[n * fields + 1 :] = np.cumsum(np.asarray(unit_counts, dtype=np.int64))
        stream = torch.cuda.current_stream(device)
        self.device, self.n, self.units = device, n, int(arr[-1])
        self._host = host  # kept alive: the copy below reads it asynchronously
        self._dev = host.to(torch.device("cuda", device), non_blocking=True)
        # Kept zero between launches by the kernel itself (amax.cu); zeroed once here.
        self.scratch = torch.zeros(max(scratch_words, 1), dtype=torch.int32, device=self._dev.device)
        self.table = self._dev.data_ptr()
        self.unit_begin = self.table + 8 * n * fields
        self._ready = torch.cuda.Event()
        self._ready.record(stream)
        self._streams = {stream.cuda_stream}

    def on_current_stream(self) -> "Plan":
        """Order the upload before this stream's work, the first time the plan is used on another stream."""
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in self._streams:
            stream.wait_event(self._ready)
            self._dev.record_stream(stream)
            self.scratch.record_stream(stream)
            self._streams.add(stream.cuda_stream)
        return self


class PlanCache:
    """Small LRU of plans per stage (a training step reuses a handful of buffer sets)."""

    def __init__(self, size: int = 16):
        self._plans: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key, build) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            if len(self._plans) > self._size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def clear(self) -> None:
        self._plans.clear()


_AMAX, _SCALE, _CAST, _NIBBLE, _SCALET = (PlanCache() for _ in range(5))


def clear_plans() -> None:
    for cache in (_AMAX, _SCALE, _CAST, _NIBBLE, _SCALET):
        cache.clear()


# --------------------------------------------------------------------------------------------------------------
# Helpers


def _device_index(tensors, what: str) -> int:
    """Device of the first non-empty tensor (else of any CUDA tensor); non-empty ones must all be CUDA."""
    fallback = None
    for t in tensors:
        if t is None:
            continue
        if t.numel():
            if not t.is_cuda:
                raise ValueError(f"{what}: CUDA path got a {t.device} tensor; put every tensor on one CUDA device")
            return t.device.index
        if fallback is None and t.is_cuda:
            fallback = t.device.index
    if fallback is None:
        raise ValueError(f"{what}: no CUDA tensor to take the device from")
    return fallback


def _same_device(t: torch.Tensor, index: int, label: str) -> None:
    if not t.is_cuda or t.device.index != index:
        raise ValueError(f"{label} is on {t.device}, the other tensors on cuda:{index}; put them on one device")


def _tensor_key(tensors, with_dtype: bool = False) -> tuple:
    """Address and byte size of each tensor (0 for None); with the shapes and starts that is all a plan's table
    depends on. Plain list comprehensions over two cheap attributes: this runs on every call, for every weight."""
    ptrs = tuple([0 if t is None else t.data_ptr() for t in tensors])
    sizes = tuple([0 if t is None else t.nbytes for t in tensors])
    if not with_dtype:
        return ptrs, sizes
    return ptrs, sizes, tuple([None if t is None else t.dtype for t in tensors])


def _shape_tuple(shapes) -> tuple:
    """`shapes` as a hashable tuple of (M, K) tuples, without rebuilding it when it already is one."""
    t = tuple(shapes)
    try:
        hash(t)
        return t
    except TypeError:
        return tuple(tuple(s) for s in shapes)


def _check_out(t: torch.Tensor, index: int, numel: int, label: str) -> None:
    _same_device(t, index, label)
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(
            f"{label}: need a contiguous fp32 tensor of {numel} entries, got {t.dtype} {list(t.shape)} "
            f"(contiguous={t.is_contiguous()})"
        )


def _tile_offsets(shapes: Sequence[Shape]) -> tuple[list[int], int]:
    offsets, acc = [], 0
    for m, k in shapes:
        offsets.append(acc)
        acc += ceil_div(m, TILE) * ceil_div(k, TILE)
    return offsets, acc


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
    if dst and (dst - (start >> 1)) % 4 == 0:
        flags |= FLAG_VEC_DST
    row = [src, dst, start, end, m, k, tk, tile_off, band_lo, n_chunks, owned, zero_lo, zero_hi, zero_units, flags, 0]
    return row, owned + zero_units


def _build_amax_plan(index, shards, starts, shapes) -> Plan:
    offsets, _ = _tile_offsets(shapes)
    n = len(shapes)
    rows, units = [], []
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        if shard is not None and shard.numel():
            _same_device(shard, index, f"shard {i}")
        row, u = _shard_row(shard, int(start), m, k, n + offsets[i], 0, with_zeros=True)
        rows.append(row)
        units.append(u)
    return Plan(index, rows, len(SHARD_FIELDS), units, tiles=_tile_offsets(shapes)[1], scratch_words=2 * n)


def partial_amax(shards, starts, shapes, *, round_to=torch.bfloat16, out: Optional[torch.Tensor] = None):
    """CUDA `fp4_dist.kernels.partial_amax`: one launch writes every tensor and tile amax of all weights."""
    index = _device_index([*shards, out], "partial_amax")
    shapes = _shape_tuple(shapes)
    key = (index, _tensor_key(shards, with_dtype=True), tuple(starts), tuple(shapes))
    plan = _AMAX.get(key, lambda: _build_amax_plan(index, shards, starts, shapes))
    if out is None:
        out = torch.empty(plan.n + plan.tiles, dtype=torch.float32, device=torch.device("cuda", index))
    else:
        _check_out(out, index, plan.n + plan.tiles, "partial_amax out")
    plan.on_current_stream()
    _launch.launch_partial_amax(
        index, round_to, plan.table, plan.unit_begin, plan.n, plan.units, out.data_ptr(), plan.scratch.data_ptr()
    )
    return out


def _build_cast_plan(index, shards, starts, shapes, fragments) -> Plan:
    offsets, _ = _tile_offsets(shapes)
    rows, units = [], []
    for i, (shard, start, (m, k), frag) in enumerate(zip(shards, starts, shapes, fragments)):
        start, dst = int(start), 0
        if shard is not None and shard.numel():
            _same_device(shard, index, f"shard {i}")
            if start % 2:
                raise ValueError(
                    f"shard {i}: start {start} is odd, so its first byte would be shared with another rank's "
                    "shard; shard boundaries must be even element offsets"
                )
            want = ((start + shard.numel() + 1) >> 1) - (start >> 1)
            if frag is None or frag.dtype != torch.uint8 or frag.numel() != want or not frag.is_contiguous():
                raise ValueError(f"fragment {i}: need a contiguous uint8 tensor of {want} bytes for shard {i}")
            _same_device(frag, index, f"fragment {i}")
            dst = frag.data_ptr()
        row, u = _shard_row(shard, start, m, k, offsets[i], dst, with_zeros=False)
        rows.append(row)
        units.append(u)
    return Plan(index, rows, len(SHARD_FIELDS), units, tiles=_tile_offsets(shapes)[1])


def partial_cast(shards, starts, shapes, enc, fragments, *, round_to=torch.bfloat16) -> None:
    """CUDA `fp4_dist.kernels.partial_cast`: one launch writes the owned nibbles of all weights."""
    if not any(s is not None and s.numel() for s in shards):
        return
    index = _device_index(shards, "partial_cast")
    shapes = _shape_tuple(shapes)
    key = (index, _tensor_key(shards, with_dtype=True), tuple(starts), tuple(shapes), _tensor_key(fragments))
    plan = _CAST.get(key, lambda: _build_cast_plan(index, shards, starts, shapes, fragments))
    _check_out(enc, index, plan.tiles, "partial_cast enc")
    if plan.units == 0:
        return
    plan.on_current_stream()
    _launch.launch_partial_cast(index, round_to, plan.table, plan.unit_begin, plan.n, plan.units, enc.data_ptr())


# --------------------------------------------------------------------------------------------------------------
# fused_scale


def _build_scale_plan(index, shapes, scale_invs, amax_outs) -> Plan:
    offsets, _ = _tile_offsets(shapes)
    rows, units = [], []
    for i, ((m, k), si, ao) in enumerate(zip(shapes, scale_invs, amax_outs)):
        _same_device(si, index, f"scale_inv {i}")
        _same_device(ao, index, f"amax_out {i}")
        want = rowwise_scale_shape(m, k)
        if si.dtype != torch.uint8 or tuple(si.shape) != want or not si.is_contiguous():
            raise ValueError(f"scale_inv {i}: need contiguous uint8 {list(want)}, got {si.dtype} {list(si.shape)}")
        if ao.dtype != torch.float32 or ao.numel() < 1:
            raise ValueError(f"amax_out {i}: need an fp32 tensor of 1 entry, got {ao.dtype} {list(ao.shape)}")
        tm, tk = tile_grid(m, k)
        rows_pad, cols_pad = want
        n_chunks = ceil_div(cols_pad, SCALE_CHUNK)
        flags = FLAG_VEC_DST if si.data_ptr() % 4 == 0 else 0
        rows.append([si.data_ptr(), ao.data_ptr(), m, tm, tk, cols_pad, offsets[i], n_chunks, flags, 0])
        units.append((rows_pad // TILE) * n_chunks)
    return Plan(index, rows, len(SCALE_FIELDS), units, tiles=_tile_offsets(shapes)[1])


def fused_scale(amaxes, shapes, scale_invs, amax_outs, *, numerics="te") -> torch.Tensor:
    """CUDA `fp4_dist.kernels.fused_scale`: one launch for every weight's scales, amax and encode multipliers."""
    index = _device_index([amaxes], "fused_scale")
    shapes = _shape_tuple(shapes)
    if len(scale_invs) != len(shapes) or len(amax_outs) != len(shapes):
        raise ValueError(f"got {len(shapes)} shapes, {len(scale_invs)} scale_invs and {len(amax_outs)} amax_outs")
    key = (index, tuple(shapes), _tensor_key(scale_invs), _tensor_key(amax_outs))
    plan = _SCALE.get(key, lambda: _build_scale_plan(index, shapes, scale_invs, amax_outs))
    _check_out(amaxes, index, plan.n + plan.tiles, "fused_scale amaxes")
    enc = torch.empty(plan.tiles, dtype=torch.float32, device=amaxes.device)
    plan.on_current_stream()
    _launch.launch_fused_scale(
        index, numerics, plan.table, plan.unit_begin, plan.n, plan.units, amaxes.data_ptr(), enc.data_ptr()
    )
    return enc


# --------------------------------------------------------------------------------------------------------------
# Post-all-gather transposes


def _check_u8(t: torch.Tensor, shape, index: int, label: str) -> None:
    _same_device(t, index, label)
    if t.dtype != torch.uint8 or tuple(t.shape) != tuple(shape) or not t.is_contiguous():
        raise ValueError(
            f"{label}: need a contiguous uint8 tensor {list(shape)}, got {t.dtype} {list(t.shape)} "
            f"(contiguous={t.is_contiguous()})"
        )


def _build_nibble_plan(index, srcs, dsts) -> Plan:
    rows, units = [], []
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        if src.dim() != 2:
            raise ValueError(f"rowwise_data {i}: need a 2D [M, K/2] uint8 tensor, got {list(src.shape)}")
        m, k = src.shape[0], 2 * src.shape[1]
        if m % 2 or k % TILE:
            raise ValueError(f"rowwise_data {i}: [M, K/2] = {list(src.shape)} needs even M and K % 16 == 0")
        _check_u8(src, (m, k // 2), index, f"rowwise_data {i}")
        _check_u8(dst, columnwise_data_shape(m, k), index, f"columnwise_data {i}")
        s, d, row_bytes = src.data_ptr(), dst.data_ptr(), m // 2
        flags = FLAG_VEC_SRC if s % 4 == 0 else 0
        flags |= FLAG_VEC16_SRC if s % 16 == 0 and (k // 2) % 16 == 0 else 0
        flags |= FLAG_VEC_DST if d % 4 == 0 and row_bytes % 4 == 0 else 0
        flags |= FLAG_VEC16_DST if d % 16 == 0 and row_bytes % 16 == 0 else 0
        n_mt = ceil_div(m, NIBBLE_TILE_M)
        rows.append([s, d, m, k, n_mt, flags])
        units.append(n_mt * ceil_div(k, NIBBLE_TILE_K))
    return Plan(index, rows, len(TRANSPOSE_FIELDS), units, tiles=0)


def nibble_transpose(rowwise_datas, columnwise_datas) -> None:
    """CUDA `fp4_dist.kernels.nibble_transpose`: [M, K/2] -> [K, M/2] for every weight in one launch."""
    if len(rowwise_datas) != len(columnwise_datas):
        raise ValueError(f"got {len(rowwise_datas)} rowwise and {len(columnwise_datas)} columnwise tensors")
    if not rowwise_datas:
        return
    index = _device_index(rowwise_datas, "nibble_transpose")
    key = (index, _tensor_key(rowwise_datas), _tensor_key(columnwise_datas), tuple([t.size(0) for t in rowwise_datas]))
    plan = _NIBBLE.get(key, lambda: _build_nibble_plan(index, rowwise_datas, columnwise_datas))
    plan.on_current_stream()
    _launch.launch_nibble_transpose(index, plan.table, plan.unit_begin, plan.n, plan.units)


def _build_scalet_plan(index, srcs, dsts, shapes) -> Plan:
    rows, units = [], []
    for i, (src, dst, (m, k)) in enumerate(zip(srcs, dsts, shapes)):
        _check_u8(src, rowwise_scale_shape(m, k), index, f"rowwise_scale_inv {i}")
        _check_u8(dst, columnwise_scale_shape(m, k), index, f"columnwise_scale_inv {i}")
        tm, tk = tile_grid(m, k)
        dst_rows, dst_cols = columnwise_scale_shape(m, k)
        flags = FLAG_VEC_DST if dst.data_ptr() % 4 == 0 else 0
        rows.append([src.data_ptr(), dst.data_ptr(), k, tm, tk, src.shape[1], dst_cols, dst_rows, flags, 0])
        units.append((dst_rows // TILE) * ceil_div(dst_cols // 4, SCALET_WORDS))
    return Plan(index, rows, len(SCALET_FIELDS), units, tiles=0)


def scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes) -> None:
    """CUDA `fp4_dist.kernels.scale_transpose`: columnwise scales (zero padding) of every weight, one launch."""
    if not (len(rowwise_scale_invs) == len(columnwise_scale_invs) == len(shapes)):
        raise ValueError("scale_transpose needs one rowwise, one columnwise tensor and one shape per weight")
    if not shapes:
        return
    index = _device_index(rowwise_scale_invs, "scale_transpose")
    shapes = _shape_tuple(shapes)
    key = (index, _tensor_key(rowwise_scale_invs), _tensor_key(columnwise_scale_invs), tuple(shapes))
    plan = _SCALET.get(key, lambda: _build_scalet_plan(index, rowwise_scale_invs, columnwise_scale_invs, shapes))
    plan.on_current_stream()
    _launch.launch_scale_transpose(index, plan.table, plan.unit_begin, plan.n, plan.units)


# --------------------------------------------------------------------------------------------------------------
# Test hooks: the device rounding functions applied elementwise.


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 CUDA `y`, computed by common.cuh's e2m1_code."""
    y = y.contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    _launch.launch_pointwise(y.device.index, "e2m1_codes", (y.data_ptr(), out.data_ptr()), y.numel())
    return out


def e4m3_codes(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 bits, fp32 decoded value) of fp32 CUDA `d` >= 0, by common.cuh's e4m3 functions."""
    d = d.contiguous()
    out = torch.empty(d.shape, dtype=torch.uint8, device=d.device)
    dec = torch.empty(d.shape, dtype=torch.float32, device=d.device)
    _launch.launch_pointwise(d.device.index, "e4m3_codes", (d.data_ptr(), out.data_ptr(), dec.data_ptr()), d.numel())
    return out, dec
