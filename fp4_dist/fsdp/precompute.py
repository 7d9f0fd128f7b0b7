"""The cast before FSDP2's all-gathers: every NVFP4 weight's local rows to packed bytes and tile scales, with one
amax all-reduce for the whole model.

Each rank holds whole 16-row tile bands of a weight ("nvfp4" mode), so every tile amax is complete on the rank
that holds the tile and only the n tensor amaxes cross ranks::

    partial_amax     local tensor + tile amaxes of every weight            one launch per (dtype, numerics) group
    ONE MAX all-reduce of the n tensor amaxes, one scalar read: all finite?   (raise naming the weight if not)
    owner_scales     local tile scale bytes (the all-gather's second input), encode multipliers, amax
    partial_cast     local packed bytes (the all-gather's first input)

Same stages and formulas as every other cast of this package, so the gathered bytes are those of
`fp4_dist.quantize(full master)`. Bound once per set of master tensors; a call is a few launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import kernels
from ..format import byte_window, rowwise_data_shape, tile_grid
from ..kernels import checks
from ..optim.cast_groups import bind_amax_and_cast, make_cast_plan
from .master import NVFP4Master, WeightState, local_master, local_tiles


@dataclass(frozen=True)
class _Weight:
    """One "nvfp4" weight as the cast sees it: its state, its local master rows and where they start."""

    state: WeightState
    master: torch.Tensor  # the wrapped fp32 [rows, K] of this rank
    row0: int

    @property
    def shape(self):
        return self.state.shape


def _local(p) -> tuple[NVFP4Master, int]:
    """The local NVFP4Master of parameter `p` and the global row of its first row."""
    row0 = 0
    if isinstance(p, DTensor):
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row0 = int(offset[0])
    return local_master(p), row0


def shard_group(p) -> Optional[dist.ProcessGroup]:
    """The process group a weight is sharded over (the last mesh dimension: FSDP, or the shard dim of HSDP)."""
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    return mesh.get_group(mesh.ndim - 1)


class ShardCast:
    """The cast of a model's "nvfp4"-mode NVFP4Master weights into their all-gather inputs, bound once."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]):
        self.weights: list[_Weight] = []
        self.group = None
        for _, p in params:
            local, row0 = _local(p)
            if local._state.mode == "nvfp4":
                self.weights.append(_Weight(local._state, local._data, row0))
                self.group = shard_group(p)
        self._sources = [w.master for w in self.weights]
        self._bind()

    def _bind(self) -> None:
        ws = self.weights
        if not ws:
            return
        dev = ws[0].master.device
        for w in ws:
            rows, k = w.master.shape
            assert rows % 16 == 0 and w.row0 % 16 == 0, f"{w.state.fqn}: a local shard that is not whole tile bands"
            w.state.packed = torch.zeros(rowwise_data_shape(rows, k), dtype=torch.uint8, device=dev)
            w.state.amax = torch.zeros(1, dtype=torch.float32, device=dev)
        self.plan = make_cast_plan([w.shape for w in ws], [w.state.model_dtype for w in ws],
                                   [w.state.numerics for w in ws])  # fmt: skip
        self.amaxes = torch.zeros(self.plan.amax_numel, dtype=torch.float32, device=dev)
        self._index = torch.tensor([g.offset + j for g in self.plan.groups for j in range(g.layout.n)],
                                   dtype=torch.int64, device=dev)  # fmt: skip
        self.message = torch.zeros(self._index.numel(), dtype=torch.float32, device=dev)
        shards = [w.master.reshape(-1) for w in ws]
        starts = [w.row0 * w.shape[1] for w in ws]
        frags = [w.state.packed.view(-1) for w in ws]
        for f, s, w in zip(frags, starts, ws):
            lo, hi = byte_window(s, w.master.numel())
            assert f.numel() == hi - lo, "packed buffer does not match the shard's byte window"
        self._steps = []
        for g in self.plan.groups:
            enc = torch.zeros(g.layout.total - g.layout.n, dtype=torch.float32, device=dev)
            amax, cast = bind_amax_and_cast(g, ws, shards, starts, frags, self.amaxes, enc)
            gw = [ws[i] for i in g.indices]
            tiles = [local_tiles(w.state, w.row0, w.master.shape[0]) for w in gw]
            # owner_scales packs the group's scale bytes one weight after the other: each weight's all-gather
            # input is its [rows/16, tiles_k] view of that buffer.
            compact = torch.zeros(sum(b - a for a, b in tiles), dtype=torch.uint8, device=dev)
            off = 0
            for w, (a, b) in zip(gw, tiles):
                w.state.scales = compact[off:off + b - a].view(w.master.shape[0] // 16, tile_grid(*w.shape)[1])
                off += b - a
            owner = kernels.bind_owner_scales(g.block(self.amaxes), g.shapes, tiles, tiles, compact, enc,
                                              [w.state.amax for w in gw], numerics=g.numerics)  # fmt: skip
            self._steps.append((amax, owner, cast))

    def current_for(self, params) -> bool:
        """Whether this binding still points at the model's master tensors."""
        locals_ = [local_master(p) for _, p in params]
        now = [t._data for t in locals_ if t._state.mode == "nvfp4"]
        return len(now) == len(self._sources) and all(a is b for a, b in zip(now, self._sources))

    def stale(self) -> bool:
        """Whether any weight's master changed since its bytes were cast."""
        return any(not w.state.cast_is_current(w.master) for w in self.weights)

    @torch.no_grad()
    def __call__(self) -> None:
        """Cast every weight's local rows; raises ValueError naming the weight, before any byte is written, if a
        master value is not finite on any rank."""
        if not self.weights:
            return
        for amax, _, _ in self._steps:
            amax()
        torch.index_select(self.amaxes, 0, self._index, out=self.message)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(self.message, op=dist.ReduceOp.MAX, group=self.group)
        finite = bool(torch.isfinite(self.message).all().item())  # the one device-to-host read
        self.amaxes.index_copy_(0, self._index, self.message)
        if not finite:
            self._raise_not_finite()
        for _, owner, cast in self._steps:
            owner()
            cast()
        for w in self.weights:
            w.state.cast_from = w.state.source_id(w.master)

    def _raise_not_finite(self) -> None:
        for g in self.plan.groups:
            for i, a in zip(g.indices, g.tensor_amaxes(self.amaxes).tolist()):
                if a != a or a in (float("inf"), float("-inf")):
                    raise checks.non_finite_error(f"{self.weights[i].state.fqn} (fp32 master)", " on some rank")
        raise checks.non_finite_error("an NVFP4 master weight")
