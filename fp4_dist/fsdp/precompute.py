"""The cast before FSDP2's all-gathers: every NVFP4 weight's local rows to packed bytes and tile scales, with one
amax all-reduce for the whole model.

Each rank holds whole 16-row tile bands of a weight ("nvfp4" mode), so every tile amax is complete on the rank
that holds the tile and only the n tensor amaxes cross ranks::

    partial_amax     local tensor + tile amaxes of every weight            one launch per (dtype, numerics) group
    ONE MAX all-reduce of the n tensor amaxes; all finite? (raise naming the weight if not: read at once, or,
                     in the training forward, a pinned byte read after the forward is queued)
    owner_scales     local tile scale bytes (the all-gather's second input), encode multipliers, amax
    partial_cast     local packed bytes (the all-gather's first input)

The stages, the exchange and the check are `fp4_dist.cast.core.CastCore`'s, as for every other cast of
this package, so the gathered bytes are those of `fp4_dist.quantize(full master)`. What a rank sends is
`wire`'s. Bound once per set of master tensors; a call is a few launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import kernels
from ..cast.core import CastCore, DeferredCheck, make_cast_plan
from . import wire
from .master import NVFP4Master, WeightState, local_master


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
            if local.state.mode == "nvfp4":
                self.weights.append(_Weight(local.state, local.fp32, row0))
                self.group = shard_group(p)
        self._sources = [w.master for w in self.weights]
        self._bind()

    def _bind(self) -> None:
        ws = self.weights
        if not ws:
            return
        dev = ws[0].master.device
        for w in ws:
            w.state.packed, w.state.amax = wire.shard_buffers(w.master.shape[0], w.shape[1], dev)
        self.plan = make_cast_plan([w.shape for w in ws], [w.state.model_dtype for w in ws],
                                   [w.state.numerics for w in ws], [w.state.amax_group for w in ws])  # fmt: skip
        # Each rank holds whole tile bands, so only the tensor amaxes cross ranks.
        self.core = CastCore(self.plan, [w.master.reshape(-1) for w in ws], [w.row0 * w.shape[1] for w in ws],
                             [w.state.packed.view(-1) for w in ws], self._bind_scales,
                             names=[f"{w.state.fqn} (fp32 master)" for w in ws],
                             exchanged=self.plan.tensor_amax_entries(), device=dev)  # fmt: skip

    def _bind_scales(self, g, block, enc):
        """owner_scales of group g: every tile of a rank's bands is its own; the scale bytes land in one compact
        buffer whose per-weight views are the all-gather's scale inputs."""
        gw = [self.weights[i] for i in g.indices]
        tiles = [wire.local_tiles(w.shape, w.row0, w.master.shape[0]) for w in gw]
        compact = torch.zeros(sum(b - a for a, b in tiles), dtype=torch.uint8, device=block.device)
        views = wire.scale_views(compact, [w.shape for w in gw], tiles, [w.master.shape[0] for w in gw])
        for w, view in zip(gw, views):
            w.state.scales = view
        return kernels.bind_owner_scales(block, g.shapes, tiles, tiles, compact, enc, [w.state.amax for w in gw],
                                         numerics=g.numerics)  # fmt: skip

    def current_for(self, params) -> bool:
        """Whether this binding still points at the model's master tensors."""
        locals_ = [local_master(p) for _, p in params]
        now = [t.fp32 for t in locals_ if t.state.mode == "nvfp4"]
        return len(now) == len(self._sources) and all(a is b for a, b in zip(now, self._sources))

    def stale(self) -> bool:
        """Whether any weight's master changed since its bytes were cast."""
        return any(not w.state.cast_is_current(w.master) for w in self.weights)

    @torch.no_grad()
    def __call__(self, *, defer_check: bool = False) -> Optional[DeferredCheck]:
        """Cast every weight's local rows; raises ValueError naming the weight, before any byte is written, if a
        master value is not finite on any rank.

        `defer_check`: no host read; the verdict comes back as a `DeferredCheck` (a pinned byte behind an event)
        and the bytes are written regardless: the caller resolves it before anything it computed from them
        leaves its hands, and calls `forget` if it fails."""
        if not self.weights:
            return None
        core = self.core
        core.local_amaxes()
        verdict = core.exchange(self.group, local=self.group is None, defer_check=defer_check)
        core.scales()
        core.cast()
        for w in self.weights:
            w.state.cast_from = w.state.source_id(w.master)
        return core.defer(verdict) if defer_check else None

    def forget(self) -> None:
        """Mark every weight's bytes stale (their cast read a non-finite master): the next gather casts again."""
        for w in self.weights:
            w.state.cast_from = None
