"""The compute copy of an NVFP4 weight: its values in the model dtype, made once per change of its bytes.

Every op on an NVFP4Tensor (linear, matmul, t, ...) runs on the weight's dequantized value. A training step
uses each weight twice per microbatch (forward, and backward for the input gradient) but changes it once (the
optimizer step, the cast and the all-gather), so each weight keeps one [M, K] copy in its model dtype::

    cast, all-gather, copy_, quantize_, load_state_dict   bytes change
    post_all_gather_processing / ShardedCast.after_gather  ONE dequantize launch refreshes every copy
    forward and backward of every microbatch               read the copy (no dequantize at all)

Cost: 2 bytes per element of memory (bf16) next to the packed 0.5; `NVFP4Tensor.compute_copy = False` trades
it back for a dequantize launch on every use (`compute_copy_bytes` reports what the copies hold).

A copy is never stale. It remembers the field tensors it was made from and their version counters (every
kernel of this package bumps the counters of what it writes, as a torch op does), its own version and the
weight's (an in-place op on a view of the value bumps the weight's counter), and the next use re-dequantizes
on any difference. A cast marks its weights *pending* until the post-all-gather refresh: the gather writes
through the all-gather buffer, which the weights' own counters do not see (`NVFP4Tensor.set_rowwise_storage`
gives each weight counters of its own), so until the refresh every use gets a fresh dequantization instead
of a copy the gather would silently outdate. A refresh overwrites the copy in place and bumps the version
counters of the weight and of every alias of the copy a layer computes with (`fp4_dist.compute.view`), so a
backward through a graph recorded with the previous values raises, as it does for a plain parameter changed in
place.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from typing import Optional, Sequence

import torch

from .. import kernels
from .._user import user_stacklevel


class Derived(weakref.WeakSet):
    """The copies derived from one weight's bytes (`ComputeCopy.derived`). A deep copy or a pickle of the weight
    starts with none: each copy belongs to a layer, which makes its own from its own weight."""

    def __deepcopy__(self, memo) -> "Derived":
        return Derived()

    def __reduce__(self):
        return Derived, ()


class ComputeCopy:
    """State of one weight's compute copy, shared by all aliases of the weight (nn.Parameter, detach, ...).

    Attributes:
        enabled: keep a copy (True) or dequantize on every use (False).
        value: the [M, K] model-dtype tensor, or None before the first refresh / when disabled.
        pending: set by a cast, cleared by a refresh: the bytes are between a cast and their all-gather.
    """

    __slots__ = ("enabled", "value", "pending", "auto_refresh", "epoch", "views", "aliases", "sources", "stamp",
                 "pending_uses", "casts", "derived")

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.value: Optional[torch.Tensor] = None
        self.pending = False
        self.auto_refresh = False
        """Set with `pending` by a cast whose caller does no post-all-gather processing (TransformerEngine's
        ``manual_post_all_gather_processing=False``): the first use refreshes the copy, once."""
        self.epoch = 0
        """Bumped whenever a rowwise field of the weight, the value or `enabled` is replaced: bound refreshes
        compare epochs (one int per weight) instead of every tensor they hold."""
        self.views = weakref.WeakSet()
        """The layers' cached views of `value` (`fp4_dist.compute.view`): cleared when `value` is dropped or
        replaced, so that its memory goes with it."""
        self.aliases: list = []
        """Weak references to every plain alias of `value` made for a layer (`compute.alias`), including
        those only a recorded graph still holds (torch keeps a tensor's Python object alive while its C++ tensor
        lives): each refresh bumps their version counters. Emptied when `value` is dropped or replaced (the old
        memory is then never overwritten)."""
        self.sources: tuple = ()
        """(rowwise_data, rowwise_scale_inv, amax) that `value` was made from."""
        self.stamp: Optional[tuple] = None
        """Their version counters, `value`'s and the weight's when it was made (None: nothing proves it current)."""
        self.pending_uses = 0
        self.casts = 0
        """Bumped by every cast (`mark_pending`): bytes an all-gather writes bump no version counter of this
        rank's, so a lean copy (`fp4_dist.compute.lean`) proves itself current by this count with the versions."""
        self.derived = Derived()
        """Other copies made from the weight's bytes that are remade in place by every refresh (an all-gather's
        processing), each an object with a ``remake()`` (`fp4_dist.compute.fp8_copy.Fp8Copy`): made there, outside
        any CUDA graph, they are current when a replayed GEMM reads them."""

    def fresh_for(self, w) -> bool:
        """True when `value` holds the values of `w`'s current bytes."""
        v, src = self.value, self.sources
        if v is None or self.pending or not src or v.dtype != w.dtype:  # module.float() changes the weight's dtype
            return False
        return bound(src, w) and self.stamp == _versions(w, v)

    def record(self, w) -> None:
        """`value` was just made from `w`'s fields."""
        self.sources = rowwise_fields(w)
        self.stamp = _versions(w, self.value)
        self.pending = self.auto_refresh = False
        self.pending_uses = 0

    def drop(self) -> None:
        self.forget_views()
        self.value, self.sources, self.stamp = None, (), None
        self.epoch += 1

    def forget_views(self) -> None:
        """`value` is being dropped or replaced: layers let go of their views of it."""
        for view in list(self.views):
            view.clear()
        self.aliases = []

    def live_aliases(self) -> list:
        """The aliases of `value` still alive (see `aliases`), forgetting the dead ones."""
        live = [t for t in (ref() for ref in self.aliases) if t is not None]
        if len(live) != len(self.aliases):
            self.aliases = [weakref.ref(t) for t in live]
        return live

    def note_pending_use(self, w) -> None:
        self.pending_uses += 1
        if self.pending_uses == 3:
            warnings.warn(
                f"NVFP4 weight {list(w.shape)} was used 3 times between a cast and post_all_gather_processing: "
                "each use dequantizes it afresh. After all-gathering the cast bytes, call "
                "fp4_dist.post_all_gather_processing(weights) (TransformerEngine's contract) so that one launch "
                "refreshes the compute copies",
                stacklevel=user_stacklevel(),
            )


def _has_copy(w) -> bool:
    """Whether `w` is an NVFP4 weight (anything else in a list of weights is skipped)."""
    return isinstance(getattr(w, "copy_state", None), ComputeCopy)


def version_key(fields: tuple, value: Optional[torch.Tensor] = None, weight=None) -> tuple:
    """The freshness key: the version counters of a weight's rowwise `fields` (rowwise_data, rowwise_scale_inv,
    amax), then of `value` (a copy made from them) and of `weight` itself, each when given.

    Every kernel of this package bumps the counters of what it writes, as a torch op does, and an in-place op on a
    view of a copy bumps the weight's counter: a key equal to the one taken when a copy was made proves the copy
    current. Raises RuntimeError for an inference tensor (it has no version counter; nothing proves a copy of it
    current)."""
    key = (fields[0]._version, fields[1]._version, fields[2]._version)
    if value is not None:
        key += (value._version,)
    if weight is not None:
        key += (weight._version,)
    return key


def rowwise_fields(w) -> tuple:
    """(rowwise_data, rowwise_scale_inv, amax) of NVFP4 weight `w`: what a copy of it is made from."""
    return (w.rowwise_data, w.rowwise_scale_inv, w.amax)


def bound(fields: tuple, w) -> bool:
    """Whether `fields` (what a copy was made from, a layer's binding, a use's) are `w`'s rowwise fields now."""
    return fields[0] is w.rowwise_data and fields[1] is w.rowwise_scale_inv and fields[2] is w.amax


def stamp(w) -> tuple:
    """Which rowwise fields NVFP4 weight `w` holds and their freshness key (`version_key`): what must not change
    between a layer's forward and its backward, whatever the layer computes with (a lean copy, an FP8 copy)."""
    fields = rowwise_fields(w)
    return tuple(map(id, fields)) + version_key(fields)


def raise_changed(w) -> None:
    """The error of a backward whose weight changed since its forward (`stamp` differs), as autograd words it for a
    parameter changed in place."""
    raise RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: the "
        f"NVFP4 weight {weight_name(w)} changed between the forward and the backward of its layer (an optimizer step "
        "or a load in between?)")


def weight_name(w, index: Optional[int] = None, given: Optional[str] = None, listed_as: Optional[str] = None) -> str:
    """How an error names a weight or parameter: `given`, else the module path a conversion recorded
    (``fp4_dist_name``). `listed_as`: an entry of a list the caller passed, by that list's name, `index` and shape
    (and its path when known); otherwise, with no path, its `index` among parameters with shape and dtype, or its
    shape alone."""
    name = given or getattr(w, "fp4_dist_name", None)
    if listed_as is not None:
        return f"{listed_as}[{index}] ({'x'.join(map(str, w.shape))})" + (f" = {name}" if name else "")
    if name:
        return str(name)
    if index is not None:
        return f"parameter {index} {list(w.shape)} ({w.dtype})"
    return str(list(w.shape))


def _versions(w, value) -> Optional[tuple]:
    try:
        return version_key(rowwise_fields(w), value, w)
    except RuntimeError:  # inference tensors have no version counter: nothing can prove a copy current
        return None


def _allocate(w) -> torch.Tensor:
    cc = w.copy_state
    v = cc.value
    dev = w.rowwise_data.device
    if v is None or v.shape != w.shape or v.dtype != w.dtype or v.device != dev:
        cc.forget_views()
        v = cc.value = torch.empty(tuple(w.shape), dtype=w.dtype, device=dev)
        cc.epoch += 1
    return v


def refresh_compute_copies(weights: Sequence) -> None:
    """Re-dequantize the compute copies of `weights` (NVFP4Tensors; other entries ignored) in one launch.

    Clears the weights' pending state; weights with `compute_copy = False` only get that. Call after the bytes
    of many weights changed at once (an all-gather); a single changed weight refreshes itself on its next use.
    For the same list every step, `BoundRefresh` skips the per-call plan lookup.
    """
    todo, ccs = [], []
    for w in weights:
        if not _has_copy(w):
            continue
        cc = w.copy_state
        cc.pending = cc.auto_refresh = False
        ccs.append(cc)
        if cc.enabled:
            todo.append(w)
    if todo:
        values = [_allocate(w) for w in todo]
        kernels.dequantize([w.rowwise_data for w in todo], [w.rowwise_scale_inv for w in todo],
                           [w.amax for w in todo], values)  # fmt: skip
        _mark_refreshed(todo, _fields(todo))
    remake_derived(ccs)


def remake_derived(ccs) -> None:
    """Remake the derived copies (`ComputeCopy.derived`) of the weights whose `ComputeCopy` states are `ccs`."""
    for cc in ccs:
        if cc.derived:
            for d in list(cc.derived):
                d.remake()


def _fields(weights) -> list:
    """What a copy is made from and into, flat: rowwise_data, rowwise_scale_inv, amax, value of each weight."""
    return [t for w in weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax, w.copy_state.value)]


def _mark_refreshed(weights, fields: list, counted: Optional[list] = None) -> None:
    """`ComputeCopy.record` for every weight just refreshed from `fields` (`_fields(weights)`), in bulk: it runs
    every step for every weight."""
    # The weights' own version counters (views of a copy made by ops on a weight share the weight's counter) and
    # those of the aliases layers compute with (counters of their own): this is what makes autograd refuse a graph
    # recorded with the previous values.
    counted = counted if counted is not None else [w for w in weights if not w.is_inference()]
    torch.autograd.graph.increment_version(counted + [a for w in counted for a in w.copy_state.live_aliases()])
    try:
        stamps = [version_key(fields[i:i + 3], fields[i + 3], w) for i, w in zip(range(0, len(fields), 4), weights)]
    except RuntimeError:  # an inference tensor has no version counter: record() makes that copy never fresh
        for w in weights:
            w.copy_state.record(w)
        return
    for j, w in enumerate(weights):
        cc = w.copy_state
        cc.sources = fields[4 * j:4 * j + 3]
        cc.stamp = stamps[j]
        cc.pending_uses = 0


class BoundRefresh:
    """`refresh_compute_copies` of a fixed list of weights, bound once: a call is one launch plus a check per
    weight that nothing it was bound to has been replaced (then it binds again) and the bookkeeping."""

    def __init__(self, weights: Sequence):
        self.weights = [w for w in weights if _has_copy(w)]
        self._ccs = [w.copy_state for w in self.weights]
        self._run, self._todo, self._bound, self._counted, self._epochs = None, [], [], [], None

    def _bind(self, todo) -> None:
        values = [_allocate(w) for w in todo]
        self._run = kernels.bind_dequantize([w.rowwise_data for w in todo], [w.rowwise_scale_inv for w in todo],
                                                  [w.amax for w in todo], values)  # fmt: skip
        self._todo, self._bound = todo, _fields(todo)
        self._counted = [w for w in todo if not w.is_inference()]

    def __call__(self) -> None:
        for cc in self._ccs:
            cc.pending = cc.auto_refresh = False
        if [cc.epoch for cc in self._ccs] != self._epochs:  # something was replaced: check what, bind again
            todo = [w for w, cc in zip(self.weights, self._ccs) if cc.enabled]
            if len(todo) != len(self._todo) or not all(map(operator.is_, _fields(todo), self._bound)):
                self._bind(todo)
            self._epochs = [cc.epoch for cc in self._ccs]
        if self._todo:
            self._run()
            _mark_refreshed(self._todo, self._bound, self._counted)
        remake_derived(self._ccs)


def mark_pending(weights: Sequence, *, auto_refresh: bool = False) -> None:
    """The bytes of `weights` are being rewritten (a cast): uses dequantize afresh until the next refresh, or,
    with `auto_refresh`, the first use refreshes the copy (after the caller's gather)."""
    for w in weights:
        cc = w.copy_state
        cc.pending, cc.auto_refresh = True, auto_refresh
        cc.casts += 1


def compute_copy_bytes(weights) -> int:
    """Bytes held by the compute copies of the NVFP4 weights in `weights` (a module or an iterable)."""
    if isinstance(weights, torch.nn.Module):
        weights = weights.parameters()
    seen, total = set(), 0
    for w in weights:
        if _has_copy(w) and w.copy_state.value is not None and id(w.copy_state) not in seen:
            seen.add(id(w.copy_state))
            v = w.copy_state.value
            total += v.numel() * v.element_size()
    return total
