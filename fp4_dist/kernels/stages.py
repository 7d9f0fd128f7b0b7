"""The NVFP4 stages over lists of weights: one signature for every device, a call form and a bound form each.

CUDA tensors go to the CuPy kernels (one launch per stage for any number of weights); other devices run the
plain-PyTorch reference (`reference.py`, the statement of the numeric contract) weight by weight. The stages,
in the order a ZeRO step runs them (spec section 4, `docs/nvfp4_spec.md`)::

    partial_amax  ->  (MAX all-reduce of the amax buffer)  ->  fused_scale  ->  partial_cast
    (byte all-gather)  ->  nibble_transpose + scale_transpose

or, exchanging only the amaxes of tiles cut by rank boundaries (`fp4_dist.cast.sharded`)::

    partial_amax  ->  (MAX all-reduce of tensor + cut-tile amaxes)  ->  owner_scales  ->  partial_cast
    (byte all-gather + all-gather of the owners' compact scale bytes)  ->  expand_scales  ->  transposes

and, after every change of the bytes, `dequantize` fills each weight's model-dtype compute copy.

Two forms per stage:

* ``partial_amax(...)``: checks the arguments (`checks.py`) and runs. On CUDA the launch plan (`cuda_plans`) is
  cached by the signature of the tensors (address, dtype, shape, strides): a repeated call with the same
  tensors skips the checks and the plan build, and pays the signature and the launch.
* ``bind_partial_amax(...)``: checks and builds once for tensors that stay the same (an optimizer's buffers)
  and returns a `Bound`; calling it launches, with no per-weight Python work. Write new values *into* the
  bound tensors between calls; if one is replaced by another tensor, bind again. Bound stages hold their
  tensors and are never cached here.

Every stage bumps the version counters of the tensors it writes, as a torch op would: autograd then refuses a
stale saved tensor, and compute copies (`fp4_dist.tensor.copy`) see that bytes changed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..format import DEFAULT_NUMERICS, byte_window, check_numerics, num_tiles, tile_grid, tile_offsets
from . import _launch, checks, cuda_plans, reference

Shape = tuple[int, int]


@dataclass(frozen=True)
class AmaxLayout:
    """Where each weight's amaxes sit in the packed fp32 amax buffer of a list of weights: the n tensor amaxes
    first, then every weight's tiles row-major (`format.tile_offsets`), so one collective reduces all of it."""

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
    offsets, tiles = tile_offsets(shapes)
    return AmaxLayout(n=len(shapes), tile_offsets=offsets, total=len(shapes) + tiles)


def signature(tensors) -> tuple:
    """Per tensor what a plan and the argument checks depend on: address (which also fixes the device: CUDA and
    host memory share one virtual address space), dtype, shape, strides; None stays None. The key of every
    cache of bound work in this package."""
    return tuple([None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors])


# ------------------------------------------------------------------------------------------------ plumbing
class _Plans:
    """The launch plans of the call forms, least recently used first out. Sized for FSDP2's per-parameter calls
    (two plans per weight and gather, forward and backward buffers): a plan is a few hundred bytes, and a miss
    costs a pinned-memory table and an upload."""

    def __init__(self, size: int = 4096):
        self._plans: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key, build: Callable):
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

    def __len__(self) -> int:
        return len(self._plans)


PLANS = _Plans()


def _cuda(tensors) -> bool:
    return any(t is not None and t.is_cuda for t in tensors)


def _wrote(tensors) -> None:
    written = [t for t in tensors if t is not None]
    if written:
        torch.autograd.graph.increment_version(written)


def _shape_key(shapes) -> tuple:
    t = tuple(shapes)
    try:
        hash(t)
        return t
    except TypeError:
        return tuple(tuple(s) for s in shapes)


def _launch_plan(plan, launch: Callable, written, *, plan_only: bool = False) -> None:
    """Call form on CUDA: launch `plan` (on the current stream) and bump the versions of what it wrote.

    `plan_only`: the launch reads nothing but the plan (``launch(plan, via)``), so it is bound once and kept on
    the plan: a direct driver launch per call instead of CuPy's generic one (`_launch.BoundLaunch`)."""
    if plan.units:
        plan.on_current_stream()
        if plan_only:
            if plan.bound is None:
                plan.bound = _launch.bind(lambda via: launch(plan, via))
            plan.bound()
        else:
            launch(plan)
        _wrote(written)


class Bound:
    """One stage bound to its tensors: calling it runs the stage (on CUDA: one launch, every address fixed).

    Holds the tensors it reads and writes, so their memory outlives it; each call bumps the version counters of
    the ones it writes (one call for all of them). If a caller replaces one of those tensors, bind again.
    """

    __slots__ = ("plan", "_run", "_keep", "_written")

    def __init__(self, plan, run: Callable[[], None], keep: tuple, written: tuple = ()):
        self.plan, self._run, self._keep = plan, run, keep
        self._written = [t for t in written if t is not None]

    def __call__(self) -> None:
        if self.plan is not None:
            if not self.plan.units:
                return
            self.plan.on_current_stream()
        self._run()
        if self._written:
            torch.autograd.graph.increment_version(self._written)


def _plan_device(plan) -> torch.device:
    return torch.device("cuda", plan.device)


def _bound_plan(plan, launch: Callable, keep: tuple, written: tuple) -> Bound:
    """`launch(plan, via)` calls one launcher of `_launch` with ``via=via``: bound once, it is a direct driver
    launch with its arguments packed (`_launch.BoundLaunch`)."""
    if not plan.units:
        return Bound(plan, lambda: None, keep, written)
    return Bound(plan, _launch.bind(lambda via: launch(plan, via)), keep, written)


# ------------------------------------------------------------------------------------------- partial_amax
def partial_amax(shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int], shapes: Sequence[Shape], *,
                 round_to: torch.dtype = torch.bfloat16, out: Optional[torch.Tensor] = None,
                 device=None) -> torch.Tensor:  # fmt: skip
    """Tensor and tile max|x| over each rank's owned elements, packed as `amax_layout(shapes)`.

    Args:
        shards: flat contiguous fp32/bf16 shard of each weight, or None/empty where this rank owns nothing.
        starts: first element (row-major) of each shard in its weight.
        shapes: logical [M, K] of each weight.
        round_to: model dtype the values are rounded to before anything else (bf16, fp16 or fp32).
        out: optional fp32 buffer of `amax_layout(shapes).total` entries to fill.
        device: where to allocate `out` when no shard and no `out` says it.
    Returns:
        fp32 [n + tiles]: every entry written; 0 where nothing is owned; NaN counts as +inf.
    """
    if _cuda(shards) or (out is not None and out.is_cuda):
        shape_key = _shape_key(shapes)
        key = ("partial_amax", signature(shards), tuple(starts), shape_key, None if out is None else out.device)

        def build():
            shapes_, dev = checks.amax_args(shards, starts, shapes, round_to, out)
            return cuda_plans.amax_plan(dev.index, shards, starts, shapes_)

        plan = PLANS.get(key, build)
        if out is None:
            out = torch.empty(plan.n + plan.tiles, dtype=torch.float32, device=torch.device("cuda", plan.device))
        else:
            checks.check_fp32_vector(out, plan.n + plan.tiles, out.device, "partial_amax out")
        _launch_plan(plan, lambda p: _launch.launch_partial_amax(p, round_to, out), (out,))
        return out
    shapes, dev = checks.amax_args(shards, starts, shapes, round_to, out)
    if out is None:
        dev = dev if any(s is not None for s in shards) or device is None else torch.device(device)
        out = torch.empty(len(shapes) + tile_offsets(shapes)[1], dtype=torch.float32, device=dev)
    _cpu_amax(shards, starts, shapes, round_to, out)
    return out


def bind_partial_amax(shards, starts, shapes, out: torch.Tensor, *, round_to: torch.dtype = torch.bfloat16) -> Bound:
    """`partial_amax(shards, starts, shapes, round_to=round_to, out=out)`, bound."""
    shapes, dev = checks.amax_args(shards, starts, shapes, round_to, out)
    shards, starts = list(shards), [int(s) for s in starts]
    keep = (tuple(shards), out)
    if dev.type == "cuda":
        plan = cuda_plans.amax_plan(dev.index, shards, starts, shapes)
        return _bound_plan(plan, lambda p, via: _launch.launch_partial_amax(p, round_to, out, via=via), keep, (out,))
    return Bound(None, lambda: _cpu_amax(shards, starts, shapes, round_to, out), keep, (out,))


def _cpu_amax(shards, starts, shapes, round_to, out: torch.Tensor) -> None:
    layout = amax_layout(shapes)
    for i, (shard, start, (m, k)) in enumerate(zip(shards, starts, shapes)):
        tiles, amax = reference.shard_tile_amax(shard, int(start), m, k, round_to, device=out.device)
        out[i] = amax[0]
        layout.tiles(out, i, (m, k)).copy_(tiles)


# -------------------------------------------------------------------------------------------- fused_scale
def fused_scale(amaxes: torch.Tensor, shapes: Sequence[Shape], scale_invs: Sequence[torch.Tensor],
                amax_outs: Sequence[torch.Tensor], *, numerics: str = DEFAULT_NUMERICS) -> torch.Tensor:  # fmt: skip
    """From reduced amaxes: every rowwise_scale_inv (padding zeroed), every amax, and the encode multipliers.

    Returns:
        fp32 [tiles]: e_t of every tile, packed like the tile part of the amax buffer.
    """
    if amaxes.is_cuda:
        key = ("fused_scale", _shape_key(shapes), signature(scale_invs), signature(amax_outs), amaxes.device)

        def build():
            shapes_ = checks.scale_args(amaxes, shapes, scale_invs, amax_outs, numerics, None)
            return cuda_plans.scale_plan(amaxes.device.index, shapes_, scale_invs, amax_outs)

        plan = PLANS.get(key, build)
        check_numerics(numerics)
        checks.check_fp32_vector(amaxes, plan.n + plan.tiles, amaxes.device, "fused_scale amaxes")
        enc = torch.empty(plan.tiles, dtype=torch.float32, device=amaxes.device)
        _launch_plan(plan, lambda p: _launch.launch_fused_scale(p, numerics, amaxes, enc), (*scale_invs, *amax_outs))
        return enc
    enc = torch.empty(max(0, amaxes.numel() - len(shapes)), dtype=torch.float32, device=amaxes.device)
    bind_fused_scale(amaxes, shapes, scale_invs, amax_outs, enc, numerics=numerics)()
    return enc


def bind_fused_scale(amaxes: torch.Tensor, shapes, scale_invs, amax_outs, enc: torch.Tensor, *,
                     numerics: str = DEFAULT_NUMERICS) -> Bound:  # fmt: skip
    """`fused_scale(amaxes, shapes, scale_invs, amax_outs, numerics=numerics)` writing its multipliers to `enc`."""
    shapes = checks.scale_args(amaxes, shapes, scale_invs, amax_outs, numerics, enc)
    scale_invs, amax_outs = list(scale_invs), list(amax_outs)
    keep, written = (amaxes, tuple(scale_invs), tuple(amax_outs), enc), (*scale_invs, *amax_outs, enc)
    if amaxes.is_cuda:
        plan = cuda_plans.scale_plan(amaxes.device.index, shapes, scale_invs, amax_outs)
        return _bound_plan(plan, lambda p, via: _launch.launch_fused_scale(p, numerics, amaxes, enc, via=via),
                           keep, written)
    return Bound(None, lambda: _cpu_scale(amaxes, shapes, scale_invs, amax_outs, numerics, enc), keep, written)


def _cpu_scale(amaxes, shapes, scale_invs, amax_outs, numerics, enc) -> None:
    layout = amax_layout(shapes)
    for i, (m, k) in enumerate(shapes):
        amax = amaxes[i : i + 1]
        scales = reference.tile_scales(layout.tiles(amaxes, i, (m, k)), amax, numerics)
        scale_invs[i].copy_(reference.expand_rowwise_scales(scales, m, k))
        amax_outs[i].copy_(amax)
        off = layout.tile_offsets[i]
        enc[off : off + scales.numel()] = reference.encode_multipliers(scales, amax).reshape(-1)


# ------------------------------------------------------------------------------------------- partial_cast
def partial_cast(shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int], shapes: Sequence[Shape],
                 enc: torch.Tensor, fragments: Sequence[Optional[torch.Tensor]], *,
                 round_to: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """Write each shard's owned E2M1 nibbles into its byte fragment (read-modify-write of shared bytes).

    Args:
        enc: fp32 encode multipliers from `fused_scale`.
        fragments: uint8 bytes `format.byte_window(start, numel)` of each weight's flat rowwise_data (None where
            the shard is None/empty). Shard starts must be even (spec section 4).
    """
    if _cuda(shards):
        if not any(s is not None and s.numel() for s in shards):
            return
        key = ("partial_cast", round_to, signature(shards), tuple(starts), _shape_key(shapes), signature(fragments))

        def build():
            shapes_ = checks.cast_args(shards, starts, shapes, enc, fragments, round_to)
            return cuda_plans.cast_plan(enc.device.index, shards, starts, shapes_, fragments)

        plan = PLANS.get(key, build)
        checks.check_fp32_vector(enc, plan.tiles, _plan_device(plan), "partial_cast enc")
        _launch_plan(plan, lambda p: _launch.launch_partial_cast(p, round_to, enc), fragments)
        return
    bind_partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to)()


def bind_partial_cast(shards, starts, shapes, enc: torch.Tensor, fragments, *,
                      round_to: torch.dtype = torch.bfloat16) -> Bound:  # fmt: skip
    """`partial_cast(shards, starts, shapes, enc, fragments, round_to=round_to)`, bound."""
    shapes = checks.cast_args(shards, starts, shapes, enc, fragments, round_to)
    shards, starts, fragments = list(shards), [int(s) for s in starts], list(fragments)
    keep = (tuple(shards), enc, tuple(fragments))
    if _cuda(shards):
        plan = cuda_plans.cast_plan(enc.device.index, shards, starts, shapes, fragments)
        return _bound_plan(plan, lambda p, via: _launch.launch_partial_cast(p, round_to, enc, via=via),
                           keep, tuple(fragments))
    return Bound(None, lambda: _cpu_cast(shards, starts, shapes, enc, fragments, round_to), keep, tuple(fragments))


def _cpu_cast(shards, starts, shapes, enc, fragments, round_to) -> None:
    offsets = tile_offsets(shapes)[0]
    for shard, start, (m, k), frag, off in zip(shards, starts, shapes, fragments, offsets):
        tile_enc = enc[off : off + num_tiles(m, k)].view(*tile_grid(m, k))
        reference.cast_shard(shard, start, m, k, tile_enc, frag, round_to)


# ------------------------------------------------------------------------- owner_scales / expand_scales
def owner_scales(amaxes: torch.Tensor, shapes: Sequence[Shape], enc_ranges: Sequence[tuple[int, int]],
                 own_ranges: Sequence[tuple[int, int]], compact: torch.Tensor, enc: torch.Tensor,
                 amax_outs: Sequence[torch.Tensor], *, numerics: str = DEFAULT_NUMERICS) -> None:  # fmt: skip
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
    Called every step with the same tensors, so only a bound form is cached by its caller (no plan cache here).
    """
    bind_owner_scales(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics=numerics)()


def bind_owner_scales(amaxes: torch.Tensor, shapes, enc_ranges, own_ranges, compact: torch.Tensor,
                      enc: torch.Tensor, amax_outs, *, numerics: str = DEFAULT_NUMERICS) -> Bound:  # fmt: skip
    """`owner_scales(...)`, bound."""
    shapes, enc_ranges, own_ranges = checks.owner_args(amaxes, shapes, enc_ranges, own_ranges, compact, enc,
                                                       amax_outs, numerics)  # fmt: skip
    amax_outs = list(amax_outs)
    keep, written = (amaxes, compact, enc, tuple(amax_outs)), (compact, enc, *amax_outs)
    if amaxes.is_cuda:
        plan = cuda_plans.owner_plan(amaxes.device.index, shapes, enc_ranges, own_ranges, amax_outs)
        return _bound_plan(plan, lambda p, via: _launch.launch_owner_scales(p, numerics, amaxes, enc, compact, via=via),
                           keep, written)
    return Bound(None, lambda: _cpu_owner(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics),
                 keep, written)  # fmt: skip


def _cpu_owner(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, numerics) -> None:
    n, base = len(shapes), 0
    offsets = tile_offsets(shapes)[0]
    for i, ((lo, hi), (a, b), off) in enumerate(zip(enc_ranges, own_ranges, offsets)):
        amax = amaxes[i : i + 1]
        scales = reference.tile_scales(amaxes[n + off + lo : n + off + hi], amax, numerics)
        enc[off + lo : off + hi] = reference.encode_multipliers(scales, amax)
        if b > a:
            compact[base : base + b - a] = scales[a - lo : b - lo]
            base += b - a
        amax_outs[i].copy_(amax)


def expand_scales(gathered: torch.Tensor, shapes: Sequence[Shape], sources: Sequence[Sequence[tuple[int, int]]],
                  scale_invs: Sequence[torch.Tensor]) -> None:  # fmt: skip
    """Each weight's row-expanded `rowwise_scale_inv` (padding zeroed) from all-gathered compact scale bytes.

    Args:
        gathered: flat uint8, every rank's compact bytes (`owner_scales`) after the all-gather.
        sources: per weight, segments (tile_start, offset) with tile_start increasing from 0: flat tile t of the
            weight, in the last segment with tile_start <= t, is gathered[t + offset].
    """
    if gathered.is_cuda:
        key = ("expand_scales", signature([gathered]), _shape_key(shapes),
               tuple(tuple(tuple(s) for s in segs) for segs in sources), signature(scale_invs))  # fmt: skip

        def build():
            shapes_, sources_ = checks.expand_args(gathered, shapes, sources, scale_invs)
            return cuda_plans.expand_plan(gathered.device.index, shapes_, sources_, scale_invs)

        _launch_plan(PLANS.get(key, build), lambda p: _launch.launch_expand_scales(p, gathered), scale_invs)
        return
    bind_expand_scales(gathered, shapes, sources, scale_invs)()


def bind_expand_scales(gathered: torch.Tensor, shapes, sources, scale_invs) -> Bound:
    """`expand_scales(gathered, shapes, sources, scale_invs)`, bound."""
    shapes, sources = checks.expand_args(gathered, shapes, sources, scale_invs)
    scale_invs = list(scale_invs)
    keep = (gathered, tuple(scale_invs))
    if gathered.is_cuda:
        plan = cuda_plans.expand_plan(gathered.device.index, shapes, sources, scale_invs)
        return _bound_plan(plan, lambda p, via: _launch.launch_expand_scales(p, gathered, via=via),
                           keep, tuple(scale_invs))
    index = [_source_index(segs, m, k) for segs, (m, k) in zip(sources, shapes)]

    def run() -> None:
        for idx, (m, k), si in zip(index, shapes, scale_invs):
            si.copy_(reference.expand_rowwise_scales(gathered[idx].view(*tile_grid(m, k)), m, k))

    return Bound(None, run, keep, tuple(scale_invs))


def _source_index(segs, m: int, k: int) -> torch.Tensor:
    """Byte of each flat tile of one weight in the gathered buffer."""
    ends = [s for s, _ in segs[1:]] + [num_tiles(m, k)]
    return torch.cat([torch.arange(s + o, e + o) for (s, o), e in zip(segs, ends)])


# -------------------------------------------------------------------------------- post-all-gather transposes
def nibble_transpose(rowwise_datas: Sequence[torch.Tensor], columnwise_datas: Sequence[torch.Tensor]) -> None:
    """columnwise_datas[i] [K, M/2] <- nibble transpose of rowwise_datas[i] [M, K/2] (M even)."""
    if _cuda(rowwise_datas):
        key = ("nibble_transpose", signature(rowwise_datas), signature(columnwise_datas))

        def build():
            checks.nibble_args(rowwise_datas, columnwise_datas)
            return cuda_plans.nibble_plan(rowwise_datas[0].device.index, rowwise_datas, columnwise_datas)

        _launch_plan(PLANS.get(key, build), lambda p: _launch.launch_nibble_transpose(p), columnwise_datas)
        return
    bind_nibble_transpose(rowwise_datas, columnwise_datas)()


def bind_nibble_transpose(rowwise_datas, columnwise_datas) -> Bound:
    """`nibble_transpose(rowwise_datas, columnwise_datas)`, bound."""
    checks.nibble_args(rowwise_datas, columnwise_datas)
    srcs, dsts = list(rowwise_datas), list(columnwise_datas)
    if _cuda(srcs):
        plan = cuda_plans.nibble_plan(srcs[0].device.index, srcs, dsts)
        return _bound_plan(plan, lambda p, via: _launch.launch_nibble_transpose(p, via=via),
                           (tuple(srcs), tuple(dsts)), tuple(dsts))

    def run() -> None:
        for src, dst in zip(srcs, dsts):
            dst.copy_(reference.transpose_nibbles(src))

    return Bound(None, run, (tuple(srcs), tuple(dsts)), tuple(dsts))


def scale_transpose(rowwise_scale_invs: Sequence[torch.Tensor], columnwise_scale_invs: Sequence[torch.Tensor],
                    shapes: Sequence[Shape]) -> None:  # fmt: skip
    """columnwise_scale_invs[i][k, mt] <- s_t[mt, k // 16] on the valid region, zero padding."""
    if _cuda(rowwise_scale_invs):
        key = ("scale_transpose", signature(rowwise_scale_invs), signature(columnwise_scale_invs), _shape_key(shapes))

        def build():
            shapes_ = checks.scalet_args(rowwise_scale_invs, columnwise_scale_invs, shapes)
            return cuda_plans.scalet_plan(rowwise_scale_invs[0].device.index, rowwise_scale_invs, columnwise_scale_invs,
                                    shapes_)  # fmt: skip

        _launch_plan(PLANS.get(key, build), lambda p: _launch.launch_scale_transpose(p), columnwise_scale_invs)
        return
    bind_scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes)()


def bind_scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes) -> Bound:
    """`scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes)`, bound."""
    shapes = checks.scalet_args(rowwise_scale_invs, columnwise_scale_invs, shapes)
    srcs, dsts = list(rowwise_scale_invs), list(columnwise_scale_invs)
    if _cuda(srcs):
        plan = cuda_plans.scalet_plan(srcs[0].device.index, srcs, dsts, shapes)
        return _bound_plan(plan, lambda p, via: _launch.launch_scale_transpose(p, via=via),
                           (tuple(srcs), tuple(dsts)), tuple(dsts))

    def run() -> None:
        for src, dst, (m, k) in zip(srcs, dsts, shapes):
            dst.copy_(reference.transpose_scales(src, m, k))

    return Bound(None, run, (tuple(srcs), tuple(dsts)), tuple(dsts))


# ------------------------------------------------------------------------------------------------ dequantize
def dequantize(rowwise_datas: Sequence[torch.Tensor], scale_invs: Sequence[torch.Tensor],
               amaxes: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:  # fmt: skip
    """outs[i] [M, K] <- the values of NVFP4 weight i (spec section 3), rounded to outs[i].dtype.

    Args:
        rowwise_datas: uint8 [M, K/2]; scale_invs: uint8 rowwise_scale_inv (row r uses its own row's bytes) or
        the compact tile grid [ceil(M/16), ceil(K/16)] as all-gathered (forms may differ between weights);
        amaxes: fp32 [1]; outs: contiguous bf16, fp16 or fp32 [M, K] (dtypes may differ between weights).
    Bit-identical to `reference.dequantize` on the same device, one launch for all weights on CUDA.
    """
    if _cuda(rowwise_datas):
        key = ("dequantize", signature(rowwise_datas), signature(scale_invs), signature(amaxes), signature(outs))

        def build():
            checks.dequant_args(rowwise_datas, scale_invs, amaxes, outs)
            return cuda_plans.dequant_plan(rowwise_datas[0].device.index, rowwise_datas, scale_invs, amaxes, outs)

        _launch_plan(PLANS.get(key, build), _launch.launch_dequantize, outs, plan_only=True)
        return
    bind_dequantize(rowwise_datas, scale_invs, amaxes, outs)()


def bind_dequantize(rowwise_datas, scale_invs, amaxes, outs) -> Bound:
    """`dequantize(rowwise_datas, scale_invs, amaxes, outs)`, bound."""
    checks.dequant_args(rowwise_datas, scale_invs, amaxes, outs)
    lists = [list(rowwise_datas), list(scale_invs), list(amaxes), list(outs)]
    keep = tuple(tuple(x) for x in lists)
    if _cuda(lists[0]):
        plan = cuda_plans.dequant_plan(lists[0][0].device.index, *lists)
        return _bound_plan(plan, lambda p, via: _launch.launch_dequantize(p, via=via), keep, tuple(lists[3]))

    def run() -> None:
        for data, si, amax, out in zip(*lists):
            out.copy_(reference.dequantize(data, si, amax, out.dtype))

    return Bound(None, run, keep, tuple(lists[3]))


# ------------------------------------------------------------------------------------- whole-tensor quantize
def quantize_rowwise(x: torch.Tensor, shape: Shape, *, round_to: torch.dtype, numerics: str,
                     rowwise_data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor,
                     name: str = "input", shared_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """Quantize a whole weight into existing rowwise fields: the stages on one shard that covers the weight, so
    "distributed == whole" reduces to the shard bookkeeping being right.

    Args:
        x: flat contiguous fp32/bf16 values of the [M, K] weight (row-major).
        shared_amax: fp32 [1], the amax of a group of weights this one shares (`fp4_dist.shared_amax`): the
            tensor amax is the larger of it and the weight's own.
    Raises ValueError naming `name`, with nothing written, when x holds inf or NaN (one scalar read).
    """
    amaxes = partial_amax([x], [0], [shape], round_to=round_to)
    if shared_amax is not None:
        amaxes[:1] = torch.maximum(amaxes[:1], shared_amax.reshape(1).to(amaxes.device, torch.float32))
    if not torch.isfinite(amaxes[0]).item():  # the amax maps NaN to inf, so one scalar read covers both
        raise checks.non_finite_error(name)
    enc = fused_scale(amaxes, [shape], [scale_inv], [amax], numerics=numerics)
    lo, hi = byte_window(0, x.numel())
    partial_cast([x], [0], [shape], enc, [rowwise_data.view(-1)[lo:hi]], round_to=round_to)
