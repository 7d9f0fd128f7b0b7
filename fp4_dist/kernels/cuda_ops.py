"""CUDA versions of the multi-tensor stages of `fp4_dist.kernels` (same signatures): one launch per stage.

Two ways to run a stage:

* the stage functions (`partial_amax`, ...): each call looks its plan (`cuda_plans`) up in a small LRU cache
  under the *signature* of its tensors (address, dtype, shape, strides of each, plus starts and shapes). A
  signature covers everything the argument checks look at, so `fp4_dist.kernels` passes its checks as
  ``check`` and they run only when the plan is built; a hit costs the signature and the launch.
* `bind_*`: validate and build once for tensors that stay the same (an optimizer's buffers), and get a
  `Bound` launch; calling it does no per-weight Python work at all.

Arguments were checked by `fp4_dist.kernels` (shapes, shard ranges, dtypes) before a plan is built here;
the builders add the checks only the CUDA path needs (one device, output sizes, odd starts), and the per-call
tensors (out, enc) are re-checked on every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch

from . import _launch
from . import cuda_plans as P
from .cuda_plans import (  # noqa: F401  (re-exported: tests compare them with common.cuh)
    DEQUANT_FIELDS,
    EXPAND_FIELDS,
    OWNER_FIELDS,
    SCALE_FIELDS,
    SCALET_FIELDS,
    SHARD_FIELDS,
    TRANSPOSE_FIELDS,
    Plan,
)

Shape = tuple[int, int]


class PlanCache:
    """Small LRU of plans per stage (a training step reuses a handful of buffer sets)."""

    def __init__(self, size: int = 16):
        self._plans: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key, build: Callable[[], Plan], check: Optional[Callable[[], None]] = None) -> Plan:
        """The plan of `key`; on a miss run `check` (the caller's argument checks) first, then `build`."""
        plan = self._plans.get(key)
        if plan is None:
            if check is not None:
                check()
            plan = self._plans[key] = build()
            if len(self._plans) > self._size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def clear(self) -> None:
        self._plans.clear()


_AMAX, _SCALE, _CAST, _NIBBLE, _SCALET, _DEQUANT = (PlanCache() for _ in range(6))


def clear_plans() -> None:
    for cache in (_AMAX, _SCALE, _CAST, _NIBBLE, _SCALET, _DEQUANT):
        cache.clear()


def _sig(tensors) -> tuple:
    """Per tensor what the argument checks look at: address (which also fixes the device: CUDA and host memory
    share one virtual address space), dtype, shape, strides; None stays None. Runs on every call, per weight."""
    return tuple([None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors])


def _shape_tuple(shapes) -> tuple:
    """`shapes` as a hashable tuple of (M, K) tuples, without rebuilding it when it already is one."""
    t = tuple(shapes)
    try:
        hash(t)
        return t
    except TypeError:
        return tuple(tuple(s) for s in shapes)


def _wrote(tensors) -> None:
    """Bump the version counters of tensors a kernel wrote through raw pointers, as a torch op writing them
    would: autograd then refuses a stale saved tensor, and NVFP4 compute copies see that bytes changed."""
    written = [t for t in tensors if t is not None]
    if written:
        torch.autograd.graph.increment_version(written)


class Bound:
    """One stage launch with every address fixed when it was bound: calling it only launches.

    Holds the tensors the launch reads and writes, so their memory outlives it; ``written`` are the ones it
    writes, whose version counters each call bumps (one call for all of them). If a caller replaces one of
    those tensors (rather than writing into it), bind again.
    """

    __slots__ = ("plan", "_launch", "_keep", "_written")

    def __init__(self, plan: Optional[Plan], launch: Callable[[], None], keep: tuple, written: tuple = ()):
        self.plan, self._launch, self._keep = plan, launch, keep
        self._written = [t for t in written if t is not None]

    def __call__(self) -> None:
        if self.plan is not None and self.plan.units:
            self.plan.on_current_stream()
            self._launch()
            if self._written:
                torch.autograd.graph.increment_version(self._written)


def _no_launch() -> None:
    pass


# --------------------------------------------------------------------------------------------------------------
# partial_amax / fused_scale / partial_cast


def partial_amax(shards, starts, shapes, *, round_to=torch.bfloat16, out: Optional[torch.Tensor] = None,
                 check: Optional[Callable[[], None]] = None):  # fmt: skip
    """CUDA `fp4_dist.kernels.partial_amax`: one launch writes every tensor and tile amax of all weights."""
    shapes = _shape_tuple(shapes)
    key = (round_to, _sig(shards), tuple(starts), shapes, None if out is None else out.device)

    def build():
        return P.amax_plan(P.device_index([*shards, out], "partial_amax"), shards, starts, shapes)

    plan = _AMAX.get(key, build, check)
    if out is None:
        out = torch.empty(plan.n + plan.tiles, dtype=torch.float32, device=torch.device("cuda", plan.device))
    else:
        P.check_out(out, plan.device, plan.n + plan.tiles, "partial_amax out")
    plan.on_current_stream()
    _launch.launch_partial_amax(plan.device, round_to, plan.table, plan.unit_begin, plan.n, plan.units,
                                out.data_ptr(), plan.scratch.data_ptr())  # fmt: skip
    _wrote((out,))
    return out


def bind_partial_amax(shards, starts, shapes, out: torch.Tensor, *, round_to=torch.bfloat16) -> Bound:
    plan = P.amax_plan(P.device_index([*shards, out], "partial_amax"), shards, starts, _shape_tuple(shapes))
    P.check_out(out, plan.device, plan.n + plan.tiles, "partial_amax out")
    args = (plan.device, round_to, plan.table, plan.unit_begin, plan.n, plan.units, out.data_ptr(),
            plan.scratch.data_ptr())  # fmt: skip
    return Bound(plan, lambda: _launch.launch_partial_amax(*args), (tuple(shards), out), (out,))


def fused_scale(amaxes, shapes, scale_invs, amax_outs, *, numerics="te", check=None) -> torch.Tensor:
    """CUDA `fp4_dist.kernels.fused_scale`: one launch for every weight's scales, amax and encode multipliers."""
    shapes = _shape_tuple(shapes)
    if len(scale_invs) != len(shapes) or len(amax_outs) != len(shapes):
        raise ValueError(f"got {len(shapes)} shapes, {len(scale_invs)} scale_invs and {len(amax_outs)} amax_outs")
    key = (shapes, _sig(scale_invs), _sig(amax_outs), amaxes.device)

    def build():
        return P.scale_plan(P.device_index([amaxes], "fused_scale"), shapes, scale_invs, amax_outs)

    plan = _SCALE.get(key, build, check)
    P.check_out(amaxes, plan.device, plan.n + plan.tiles, "fused_scale amaxes")
    enc = torch.empty(plan.tiles, dtype=torch.float32, device=amaxes.device)
    plan.on_current_stream()
    _launch.launch_fused_scale(plan.device, numerics, plan.table, plan.unit_begin, plan.n, plan.units,
                               amaxes.data_ptr(), enc.data_ptr())  # fmt: skip
    _wrote((*scale_invs, *amax_outs))
    return enc


def bind_fused_scale(amaxes, shapes, scale_invs, amax_outs, enc: torch.Tensor, *, numerics="te") -> Bound:
    plan = P.scale_plan(P.device_index([amaxes], "fused_scale"), _shape_tuple(shapes), scale_invs, amax_outs)
    P.check_out(amaxes, plan.device, plan.n + plan.tiles, "fused_scale amaxes")
    P.check_out(enc, plan.device, plan.tiles, "fused_scale enc")
    args = (plan.device, numerics, plan.table, plan.unit_begin, plan.n, plan.units, amaxes.data_ptr(), enc.data_ptr())
    return Bound(plan, lambda: _launch.launch_fused_scale(*args), (amaxes, tuple(scale_invs), tuple(amax_outs), enc),
                 (*scale_invs, *amax_outs, enc))


def partial_cast(shards, starts, shapes, enc, fragments, *, round_to=torch.bfloat16, check=None) -> None:
    """CUDA `fp4_dist.kernels.partial_cast`: one launch writes the owned nibbles of all weights."""
    if not any(s is not None and s.numel() for s in shards):
        return
    shapes = _shape_tuple(shapes)
    key = (round_to, _sig(shards), tuple(starts), shapes, _sig(fragments))

    def build():
        return P.cast_plan(P.device_index(shards, "partial_cast"), shards, starts, shapes, fragments)

    plan = _CAST.get(key, build, check)
    P.check_out(enc, plan.device, plan.tiles, "partial_cast enc")
    if plan.units == 0:
        return
    plan.on_current_stream()
    _launch.launch_partial_cast(plan.device, round_to, plan.table, plan.unit_begin, plan.n, plan.units, enc.data_ptr())
    _wrote(fragments)


def bind_partial_cast(shards, starts, shapes, enc, fragments, *, round_to=torch.bfloat16) -> Bound:
    if not any(s is not None and s.numel() for s in shards):
        return Bound(None, _no_launch, ())
    plan = P.cast_plan(P.device_index(shards, "partial_cast"), shards, starts, _shape_tuple(shapes), fragments)
    P.check_out(enc, plan.device, plan.tiles, "partial_cast enc")
    args = (plan.device, round_to, plan.table, plan.unit_begin, plan.n, plan.units, enc.data_ptr())
    return Bound(plan, lambda: _launch.launch_partial_cast(*args), (tuple(shards), enc, tuple(fragments)),
                 tuple(fragments))


# --------------------------------------------------------------------------------------------------------------
# owner_scales / expand_scales (the compact scale exchange; built once by their callers, so not cached here)


def bind_owner_scales(amaxes, shapes, enc_ranges, own_ranges, compact, enc, amax_outs, *, numerics="te") -> Bound:
    """CUDA `fp4_dist.kernels.owner_scales`, bound."""
    index = P.device_index([amaxes], "owner_scales")
    plan = P.owner_plan(index, _shape_tuple(shapes), enc_ranges, own_ranges, amax_outs)
    P.check_out(amaxes, index, plan.n + plan.tiles, "owner_scales amaxes")
    P.check_out(enc, index, plan.tiles, "owner_scales enc")
    P.same_device(compact, index, "owner_scales compact")
    args = (index, numerics, plan.table, plan.unit_begin, plan.n, plan.units, amaxes.data_ptr(), enc.data_ptr(),
            compact.data_ptr())  # fmt: skip
    return Bound(plan, lambda: _launch.launch_owner_scales(*args), (amaxes, compact, enc, tuple(amax_outs)),
                 (compact, enc, *amax_outs))


def bind_expand_scales(gathered, shapes, sources, scale_invs) -> Bound:
    """CUDA `fp4_dist.kernels.expand_scales`, bound."""
    index = P.device_index([gathered], "expand_scales")
    plan = P.expand_plan(index, _shape_tuple(shapes), sources, scale_invs)
    args = (index, plan.table, plan.unit_begin, plan.n, plan.units, plan.extra, gathered.data_ptr())
    return Bound(plan, lambda: _launch.launch_expand_scales(*args), (gathered, tuple(scale_invs)), tuple(scale_invs))


# --------------------------------------------------------------------------------------------------------------
# Post-all-gather transposes


def nibble_transpose(rowwise_datas, columnwise_datas, *, check=None) -> None:
    """CUDA `fp4_dist.kernels.nibble_transpose`: [M, K/2] -> [K, M/2] for every weight in one launch."""
    if len(rowwise_datas) != len(columnwise_datas):
        raise ValueError(f"got {len(rowwise_datas)} rowwise and {len(columnwise_datas)} columnwise tensors")
    if not rowwise_datas:
        return
    key = (_sig(rowwise_datas), _sig(columnwise_datas))

    def build():
        index = P.device_index(rowwise_datas, "nibble_transpose")
        return P.nibble_plan(index, rowwise_datas, columnwise_datas)

    plan = _NIBBLE.get(key, build, check)
    plan.on_current_stream()
    _launch.launch_nibble_transpose(plan.device, plan.table, plan.unit_begin, plan.n, plan.units, plan.variant)
    _wrote(columnwise_datas)


def bind_nibble_transpose(rowwise_datas, columnwise_datas) -> Bound:
    if not rowwise_datas:
        return Bound(None, _no_launch, ())
    plan = P.nibble_plan(P.device_index(rowwise_datas, "nibble_transpose"), rowwise_datas, columnwise_datas)
    args = (plan.device, plan.table, plan.unit_begin, plan.n, plan.units, plan.variant)
    return Bound(plan, lambda: _launch.launch_nibble_transpose(*args), (tuple(rowwise_datas), tuple(columnwise_datas)),
                 tuple(columnwise_datas))


def scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes, *, check=None) -> None:
    """CUDA `fp4_dist.kernels.scale_transpose`: columnwise scales (zero padding) of every weight, one launch."""
    if not (len(rowwise_scale_invs) == len(columnwise_scale_invs) == len(shapes)):
        raise ValueError("scale_transpose needs one rowwise, one columnwise tensor and one shape per weight")
    if not shapes:
        return
    shapes = _shape_tuple(shapes)
    key = (_sig(rowwise_scale_invs), _sig(columnwise_scale_invs), shapes)

    def build():
        index = P.device_index(rowwise_scale_invs, "scale_transpose")
        return P.scalet_plan(index, rowwise_scale_invs, columnwise_scale_invs, shapes)

    plan = _SCALET.get(key, build, check)
    plan.on_current_stream()
    _launch.launch_scale_transpose(plan.device, plan.table, plan.unit_begin, plan.n, plan.units)
    _wrote(columnwise_scale_invs)


def bind_scale_transpose(rowwise_scale_invs, columnwise_scale_invs, shapes) -> Bound:
    if not shapes:
        return Bound(None, _no_launch, ())
    index = P.device_index(rowwise_scale_invs, "scale_transpose")
    plan = P.scalet_plan(index, rowwise_scale_invs, columnwise_scale_invs, _shape_tuple(shapes))
    args = (plan.device, plan.table, plan.unit_begin, plan.n, plan.units)
    keep = (tuple(rowwise_scale_invs), tuple(columnwise_scale_invs))
    return Bound(plan, lambda: _launch.launch_scale_transpose(*args), keep, tuple(columnwise_scale_invs))


# --------------------------------------------------------------------------------------------------------------
# Compute copies


def dequantize(rowwise_datas, scale_invs, amaxes, outs, *, check=None) -> None:
    """CUDA `fp4_dist.kernels.dequantize`: every weight's [M, K] values in one launch."""
    if not (len(rowwise_datas) == len(scale_invs) == len(amaxes) == len(outs)):
        raise ValueError("dequantize needs one rowwise_data, scale_inv, amax and out per weight")
    if not outs:
        return
    key = (_sig(rowwise_datas), _sig(scale_invs), _sig(amaxes), _sig(outs))

    def build():
        return P.dequant_plan(P.device_index(rowwise_datas, "dequantize"), rowwise_datas, scale_invs, amaxes, outs)

    plan = _DEQUANT.get(key, build, check)
    plan.on_current_stream()
    _launch.launch_dequantize(plan.device, plan.table, plan.unit_begin, plan.n, plan.units)
    _wrote(outs)


def bind_dequantize(rowwise_datas, scale_invs, amaxes, outs) -> Bound:
    if not outs:
        return Bound(None, _no_launch, ())
    plan = P.dequant_plan(P.device_index(rowwise_datas, "dequantize"), rowwise_datas, scale_invs, amaxes, outs)
    args = (plan.device, plan.table, plan.unit_begin, plan.n, plan.units)
    keep = (tuple(rowwise_datas), tuple(scale_invs), tuple(amaxes), tuple(outs))
    return Bound(plan, lambda: _launch.launch_dequantize(*args), keep, tuple(outs))


# --------------------------------------------------------------------------------------------------------------
# Test hooks: the device rounding functions applied elementwise.


def e2m1_codes(y: torch.Tensor, variant: str = "E2M1Select") -> torch.Tensor:
    """uint8 E2M1 codes of fp32 CUDA `y`, computed by common.cuh's E2M1 rounding `variant`."""
    y = y.contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    _launch.launch_pointwise(y.device.index, "e2m1_codes", (y.data_ptr(), out.data_ptr()), y.numel(), variant)
    return out


def e4m3_codes(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 bits, fp32 decoded value) of fp32 CUDA `d` >= 0, by common.cuh's e4m3 functions."""
    d = d.contiguous()
    out = torch.empty(d.shape, dtype=torch.uint8, device=d.device)
    dec = torch.empty(d.shape, dtype=torch.float32, device=d.device)
    _launch.launch_pointwise(d.device.index, "e4m3_codes", (d.data_ptr(), out.data_ptr(), dec.data_ptr()), d.numel())
    return out, dec
