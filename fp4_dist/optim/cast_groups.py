"""What both ZeRO casts share: weights grouped for the stages, their names in errors, the non-finite check, the
per-group stage binding, the columnwise build, and the one cache of bound work (by tensor signature).

Both casts (`cast.BoundCast`, TE's full amax exchange; `sharded_cast.ShardedCast`, the cut-tile exchange) run
each stage once per *group*: the weights that share a model dtype and numerics, since a stage launch takes one
of each. All groups share one amax buffer, and so one all-reduce::

    [group 0: n0 tensor amaxes | its tiles][group 1: ...] ...      (`kernels.amax_layout` per group)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from .. import kernels
from ..format import byte_window
from ..kernels import checks


@dataclass(frozen=True)
class CastGroup:
    """Weights cast with one set of stage launches (same model dtype and numerics)."""

    indices: Tuple[int, ...]
    shapes: Tuple[Tuple[int, int], ...]
    round_to: torch.dtype
    numerics: str
    offset: int
    """First entry of this group's `kernels.amax_layout` block in the amax buffer."""
    layout: kernels.AmaxLayout

    def block(self, buf: torch.Tensor) -> torch.Tensor:
        """This group's part of the amax buffer."""
        return buf[self.offset:self.offset + self.layout.total]

    def tensor_amaxes(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.offset:self.offset + self.layout.n]


@dataclass(frozen=True)
class CastPlan:
    """Static metadata of one list of weights: the groups and where their amaxes sit."""

    shapes: Tuple[Tuple[int, int], ...]
    groups: Tuple[CastGroup, ...]
    amax_numel: int
    """Entries of all groups' amax layouts."""


def make_cast_plan(shapes: Sequence[Tuple[int, int]], dtypes: Sequence[torch.dtype],
                   numerics: Sequence[str]) -> CastPlan:  # fmt: skip
    """Group weights by (dtype, numerics) and place each group's amax block (pure)."""
    keys: dict = {}
    for i, key in enumerate(zip(dtypes, numerics)):
        keys.setdefault(key, []).append(i)
    groups, offset = [], 0
    for (dtype, num), idx in keys.items():
        g_shapes = tuple(tuple(shapes[i]) for i in idx)
        layout = kernels.amax_layout(g_shapes)
        groups.append(CastGroup(tuple(idx), g_shapes, dtype, num, offset, layout))
        offset += layout.total
    return CastPlan(tuple(tuple(s) for s in shapes), tuple(groups), offset)


def plan_for(weights) -> CastPlan:
    """The `CastPlan` of a list of NVFP4 weights."""
    return make_cast_plan([tuple(int(s) for s in w.shape) for w in weights], [w.dtype for w in weights],
                          [w.numerics for w in weights])  # fmt: skip


def weight_name(i: int, w) -> str:
    """How errors name entry i of a list of weights."""
    return f"model_weights[{i}] ({'x'.join(map(str, w.shape))})"


def raise_if_not_finite(plan: CastPlan, amaxes: torch.Tensor, weights) -> None:
    """Raise the non-finite error naming the first weight whose reduced tensor amax (in `amaxes`, the amax
    buffer) is inf or NaN; a generic one if none is (a rank's tile amax was)."""
    for g in plan.groups:
        for i, a in zip(g.indices, g.tensor_amaxes(amaxes).tolist()):
            if a != a or a in (float("inf"), float("-inf")):
                raise checks.non_finite_error(f"{weight_name(i, weights[i])} master", " on some rank")
    raise checks.non_finite_error("a master shard", " on another rank")


def fragment(w, shard: Optional[torch.Tensor], start: int, fsdp_fragment: Optional[torch.Tensor] = None):
    """The bytes a cast of `shard` writes: the FSDP fragment if given, else its window of `w.rowwise_data`."""
    if shard is None:
        return None
    if fsdp_fragment is not None:
        return fsdp_fragment
    lo, hi = byte_window(start, shard.numel())
    return w.rowwise_data.view(-1)[lo:hi]


def bind_amax_and_cast(g: CastGroup, weights, shards, starts, fragments, amaxes: torch.Tensor,
                       enc: torch.Tensor) -> tuple[Callable, Callable]:  # fmt: skip
    """(partial_amax into g's block of `amaxes`, partial_cast reading `enc`) of group `g`, bound. `shards`,
    `starts`, `fragments` are indexed like `weights` (the whole list); the scale stage in between is the caller's.
    """
    g_shards, g_starts = [shards[i] for i in g.indices], [starts[i] for i in g.indices]
    frags = [fragment(weights[i], shards[i], starts[i], fragments[i]) for i in g.indices]
    return (kernels.bind_partial_amax(g_shards, g_starts, g.shapes, g.block(amaxes), round_to=g.round_to),
            kernels.bind_partial_cast(g_shards, g_starts, g.shapes, enc, frags, round_to=g.round_to))


def bind_columnwise(weights) -> list:
    """Bound nibble + scale transposes building the columnwise copies of the weights with an even M (allocated
    here if absent); empty when there are none. Weights with an odd M stay rowwise-only."""
    todo = [w for w in weights if w.shape[0] % 2 == 0]
    if not todo:
        return []
    for w in todo:
        w.alloc_columnwise()
    return [kernels.bind_nibble_transpose([w.rowwise_data for w in todo], [w.columnwise_data for w in todo]),
            kernels.bind_scale_transpose([w.rowwise_scale_inv for w in todo], [w.columnwise_scale_inv for w in todo],
                                         [tuple(w.shape) for w in todo])]  # fmt: skip


def drop_columnwise(weights) -> None:
    """Set the columnwise copies to None (never left stale after the rowwise bytes change)."""
    for w in weights:
        if w.columnwise_data is not None or w.columnwise_scale_inv is not None:
            w.columnwise_data = w.columnwise_scale_inv = None


class Bindings:
    """Bound work of recent calls, by a key built from `kernels.signature` (least recently used first out):
    a training loop passes the same tensors every step, and a hit skips the per-weight checks and bindings.
    Entries hold their tensors, so the cache is small; `clear()` lets them go."""

    def __init__(self, size: int = 16):
        self._items: OrderedDict = OrderedDict()
        self._size = size

    def get(self, key):
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key, item) -> None:
        self._items[key] = item
        if len(self._items) > self._size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


BINDINGS = Bindings()
