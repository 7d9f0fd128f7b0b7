"""The one shard cast every public cast is built on: group the weights, bind the stages, exchange amaxes, check.

A ZeRO-style cast of fp32 master shards into NVFP4 bytes runs the same stages whoever calls it
(spec section 4)::

    partial_amax     local tensor + tile amaxes of every weight           one launch per group
    exchange         ONE MAX all-reduce of the entries other ranks complete (which ones is the caller's choice),
                     then one scalar read: all finite?
    scales           the caller's scale stage (fused_scale: every scale; owner_scales: the tiles this rank owns)
    partial_cast     the owned nibbles into the weights' bytes (or the caller's byte fragments)

The three public casts differ only in what crosses ranks and where scales go, so they are thin adapters over
`CastCore`: TransformerEngine's signature (`fp4_dist.cast.master_weights`: every tile amax, fused_scale; its calls
first check that the ranks agree, `fp4_dist.cast.agreement`), `Zero1Optimizer` (`fp4_dist.cast.sharded`: tensor
amaxes and the tiles cut by rank boundaries, owner_scales) and FSDP2 (`fp4_dist.fsdp.precompute`: tensor amaxes
only, owner_scales over whole 16-row bands).

Weights are grouped by (model dtype, numerics) because a stage launch takes one of each. All groups share one
amax buffer, and so one all-reduce::

    [group 0: n0 tensor amaxes | its tiles][group 1: ...] ...
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import kernels
from ..format import byte_window
from ..kernels import checks
from ..shared_amax import AmaxGroup, group_of, member_indices
from .collectives import CommStats, all_reduce_max_, rank_and_size


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

    def tile_entries(self, j: int, tiles: Sequence[int]) -> List[int]:
        """Positions in the amax buffer of tiles `tiles` (flat, row-major) of this group's j-th weight."""
        first = self.offset + self.layout.n + self.layout.tile_offsets[j]
        return [first + t for t in tiles]


@dataclass(frozen=True)
class CastPlan:
    """Static metadata of one list of weights: the groups and where their amaxes sit."""

    shapes: Tuple[Tuple[int, int], ...]
    groups: Tuple[CastGroup, ...]
    amax_numel: int
    """Entries of all groups' amax layouts."""
    shared: Tuple[Tuple[int, ...], ...] = ()
    """Per amax group (`fp4_dist.shared_amax`), the positions of its members' tensor amaxes in the buffer."""

    def tensor_amax_entries(self) -> List[int]:
        """Positions in the amax buffer of every weight's tensor amax, group by group."""
        return [g.offset + j for g in self.groups for j in range(g.layout.n)]


def make_cast_plan(shapes: Sequence[Tuple[int, int]], dtypes: Sequence[torch.dtype], numerics: Sequence[str],
                   amax_groups: Optional[Sequence[Optional[AmaxGroup]]] = None) -> CastPlan:  # fmt: skip
    """Group weights by (dtype, numerics) and place each group's amax block (pure). `amax_groups`: per weight its
    `AmaxGroup` or None (raises ValueError when only part of a group is given)."""
    keys: dict = {}
    for i, key in enumerate(zip(dtypes, numerics)):
        keys.setdefault(key, []).append(i)
    groups, offset = [], 0
    for (dtype, num), idx in keys.items():
        g_shapes = tuple(tuple(shapes[i]) for i in idx)
        layout = kernels.amax_layout(g_shapes)
        groups.append(CastGroup(tuple(idx), g_shapes, dtype, num, offset, layout))
        offset += layout.total
    entry = {i: g.offset + j for g in groups for j, i in enumerate(g.indices)}
    shared = tuple(tuple(entry[i] for i in members) for members in member_indices(amax_groups or []))
    return CastPlan(tuple(tuple(s) for s in shapes), tuple(groups), offset, shared)


def plan_for(weights) -> CastPlan:
    """The `CastPlan` of a list of NVFP4 weights (their amax groups included)."""
    return make_cast_plan([tuple(int(s) for s in w.shape) for w in weights], [w.dtype for w in weights],
                          [w.numerics for w in weights], [group_of(w) for w in weights])  # fmt: skip


def shard_bytes(data: torch.Tensor, shard: Optional[torch.Tensor], start: int) -> Optional[torch.Tensor]:
    """The bytes of a weight's flat rowwise `data` that a cast of `shard` (elements from `start`) writes."""
    if shard is None:
        return None
    lo, hi = byte_window(start, shard.numel())
    return data.view(-1)[lo:hi]


ScaleBinder = Callable[[CastGroup, torch.Tensor, torch.Tensor], Callable[[], None]]
"""(group, its block of the amax buffer, its encode multipliers) -> the bound scale stage of that group."""


CAST_FROM_BAD_MASTERS = ("The weights were cast from these masters in that step: fix the cause and resume from a "
                         "checkpoint")


class CastCore:
    """The stages of one shard cast, bound once to one set of tensors (see the module docstring).

    Args:
        plan: the weights' `CastPlan`.
        shards, starts: per weight this rank's flat master piece (None: owns nothing) and its first element.
        fragments: per weight the bytes the cast writes: flat uint8, exactly the shard's `format.byte_window`
            (`shard_bytes` of the weight's rowwise data, or a caller's own buffer); None where it owns nothing.
        bind_scales: the caller's scale stage, bound per group (`ScaleBinder`).
        names: per weight its name in errors.
        exchanged: positions in the amax buffer that cross ranks (the others are complete locally); None: the
            whole buffer.
        device: where the amax buffer lives.
    """

    def __init__(self, plan: CastPlan, shards: Sequence[Optional[torch.Tensor]], starts: Sequence[int],
                 fragments: Sequence[Optional[torch.Tensor]], bind_scales: ScaleBinder, *, names: Sequence[str],
                 exchanged: Optional[Sequence[int]] = None, device) -> None:  # fmt: skip
        self.plan, self.names = plan, list(names)
        self.amaxes = torch.zeros(plan.amax_numel, dtype=torch.float32, device=device)
        self._whole = torch.tensor(plan.tensor_amax_entries(), dtype=torch.int64, device=device)
        self._shared = None
        if plan.shared:
            flat = [e for members in plan.shared for e in members]
            seg = [k for k, members in enumerate(plan.shared) for _ in members]
            self._shared = (torch.tensor(flat, dtype=torch.int64, device=device),
                            torch.tensor(seg, dtype=torch.int64, device=device),
                            torch.zeros(len(plan.shared), dtype=torch.float32, device=device))  # fmt: skip
        if exchanged is None:
            self._index, self.message = None, self.amaxes
        else:
            self._index = torch.tensor(list(exchanged), dtype=torch.int64, device=device)
            self.message = torch.zeros(self._index.numel(), dtype=torch.float32, device=device)
        self._runs = []
        for g in plan.groups:
            enc = torch.zeros(g.layout.total - g.layout.n, dtype=torch.float32, device=device)
            g_shards, g_starts = [shards[i] for i in g.indices], [starts[i] for i in g.indices]
            frags = [fragments[i] for i in g.indices]
            amax = kernels.bind_partial_amax(g_shards, g_starts, g.shapes, g.block(self.amaxes), round_to=g.round_to)
            scale = bind_scales(g, g.block(self.amaxes), enc)
            cast = kernels.bind_partial_cast(g_shards, g_starts, g.shapes, enc, frags, round_to=g.round_to)
            self._runs.append((amax, scale, cast))
        self._flag = self._event = None  # `defer`'s pinned verdict and the event behind its copy, made on first use
        self._deferred: Optional[DeferredCheck] = None

    @property
    def launches(self) -> int:
        """Stage kernel launches of one `run` (torch's index ops and the collective aside)."""
        return 3 * len(self._runs)

    def message_bytes(self) -> int:
        """Bytes of the amax all-reduce."""
        return self.message.numel() * self.message.element_size()

    # ------------------------------------------------------------------------------------------- a cast
    def local_amaxes(self) -> None:
        """partial_amax of every weight into the local amax buffer (one launch per group). A deferred verdict of
        the previous cast nobody resolved is resolved first, while the buffer still names its weight (its cast is
        long done: no wait)."""
        if self._deferred is not None:
            self._deferred.resolve()
        for amax, _, _ in self._runs:
            amax()

    def exchange(self, group=None, stats: Optional[CommStats] = None, amax_group=None, *,
                 local: bool = False, defer_check: bool = False) -> Optional[torch.Tensor]:  # fmt: skip
        """The MAX all-reduce of the exchanged entries over `group` (none with `local`), of the tensor amaxes
        over `amax_group` too (tensor parallelism: slices of one weight), then the one scalar read: raises on
        every rank, before any byte is written, if a value is not finite.

        `defer_check`: return the verdict as a device bool (True: all good) instead of reading it, for a caller
        that reads it with its own next read (`Zero1Optimizer` checks gradients before the step, so a
        non-finite master here can only come from its inner optimizer); `raise_for` then gives the error."""
        if self._index is not None:
            torch.index_select(self.amaxes, 0, self._index, out=self.message)
        if not local:
            all_reduce_max_(self.message, group, stats)
        if self._index is not None:
            self.amaxes.index_copy_(0, self._index, self.message)
        reduce_whole_weights(self.amaxes, self._whole, amax_group, stats)
        self._share_amaxes()
        if self._index is not None:
            verdicts = [torch.isfinite(self.message).all()]
        else:  # a tile amax holds nothing its tensor amax does not: check the tensor amaxes, in place
            verdicts = [torch.isfinite(g.tensor_amaxes(self.amaxes)).all() for g in self.plan.groups]
        if not verdicts:
            return None
        ok = verdicts[0]
        for v in verdicts[1:]:
            ok = ok & v
        if defer_check:
            return ok
        if not bool(ok.item()):  # the only device-to-host read of a successful cast
            self._raise()
        return None

    def defer(self, ok: Optional[torch.Tensor]) -> Optional["DeferredCheck"]:
        """The verdict `exchange(defer_check=True)` returned, on its way to the host: on CUDA a copy into pinned
        memory behind an event (no wait now), read by `DeferredCheck.resolve`. The flag is this core's, reused:
        `local_amaxes` resolves the verdict of the previous cast first."""
        if ok is None:
            return None
        if ok.is_cuda:
            if self._flag is None:
                self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
                self._event = torch.cuda.Event()
            self._flag.copy_(ok, non_blocking=True)
            self._event.record()
            self._deferred = DeferredCheck(self, self._flag, self._event)
        else:
            self._deferred = DeferredCheck(self, ok, None)
        return self._deferred

    def _share_amaxes(self) -> None:
        """Each amax group's members get the group's MAX (every rank holds every tensor amax by now, so every rank
        computes the same; NaN stays NaN for the check)."""
        if self._shared is None:
            return
        idx, seg, top = self._shared
        vals = self.amaxes.index_select(0, idx)
        top.scatter_reduce_(0, seg, vals, reduce="amax", include_self=False)
        self.amaxes.index_copy_(0, idx, top.index_select(0, seg))

    def scales(self) -> None:
        for _, scale, _ in self._runs:
            scale()

    def cast(self) -> None:
        """partial_cast of this rank's shards into their bytes."""
        for _, _, cast in self._runs:
            cast()

    def raise_for(self, where: str, outcome: str = CAST_FROM_BAD_MASTERS) -> None:
        """Raise the error of the last `exchange` (named as there) after a deferred verdict came back false: the
        bytes were written then, and `outcome` says what became of them."""
        self._raise(where, outcome)

    def _raise(self, where: str = " on some rank", outcome: str = checks.NOTHING_WRITTEN) -> None:
        """The error path may read more: it is about to raise anyway."""
        for g in self.plan.groups:
            for i, a in zip(g.indices, g.tensor_amaxes(self.amaxes).tolist()):
                if a != a or a in (float("inf"), float("-inf")):
                    raise checks.non_finite_error(self.names[i], where, outcome)
        raise checks.non_finite_error("a master shard", " on another rank", outcome)


class DeferredCheck:
    """A cast's finite-amax verdict that the cast did not wait for (`CastCore.defer`). The cast wrote the weights
    whatever it says; `resolve()` reads it (waiting, on CUDA, only for the device to pass the cast's exchange) and
    raises the cast's error, naming the weight, if a master was not finite. Resolve before anything reads the
    weights; resolving again is free (and raises again)."""

    __slots__ = ("core", "flag", "event", "ok")

    def __init__(self, core: CastCore, flag: torch.Tensor, event) -> None:
        self.core, self.flag, self.event, self.ok = core, flag, event, None

    def passed(self) -> bool:
        """The verdict (True: every master was finite), read once; waits on CUDA for the device to pass the cast's
        exchange, not for anything queued after it."""
        if self.ok is None:
            if self.event is not None:
                self.event.synchronize()
            self.ok = bool(self.flag)
            if self.core._deferred is self:
                self.core._deferred = None
        return self.ok

    def resolve(self, where: str = " on some rank", outcome: str = CAST_FROM_BAD_MASTERS) -> None:
        """Raise the cast's error, naming the weight, if the verdict is false (`outcome`: what became of the
        weights, in the caller's words)."""
        if not self.passed():
            self.core.raise_for(where, outcome)


def reduce_whole_weights(buf: torch.Tensor, index: torch.Tensor, amax_group, stats) -> None:
    """MAX of the entries at `index` over `amax_group`; nothing when it is None or has one rank."""
    if amax_group is None or rank_and_size(amax_group)[1] == 1:
        return
    whole = buf.index_select(0, index)
    all_reduce_max_(whole, amax_group, stats)
    buf.index_copy_(0, index, whole)


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
