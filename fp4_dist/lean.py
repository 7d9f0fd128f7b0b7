"""Lean compute: a layer's model-dtype copy of its NVFP4 weight exists only around its use.

With ``compute_copy=False`` a weight keeps no copy between updates (`fp4_dist.compute_copy`). An `NVFP4Linear` or
a Megatron parallel linear then computes as follows, with the same values and the same GEMMs as with a kept copy,
so losses and gradients are bitwise those of the default mode:

    forward    the weight's values are made in the pool buffer of its shape (below), unless the buffer holds them
               already, and the layer computes with its cached alias of that buffer
    autograd   what the linear saves for backward is not that buffer but a note naming the weight
               (`torch.autograd.graph.saved_tensors_hooks`, `lean_call`), so nothing of the copy stays alive
               between the forward and the backward of the layer, whatever the number of microbatches in flight
    backward   the note is unpacked into the same pool buffer, made again unless it holds the values still, for
               the input gradient; the weight gradient reaches the NVFP4 parameter through the alias's autograd
               node (clone's), as a plain [M, K] tensor

Megatron's linear function needs no hooks (`lean_call_refilled`): through the adapter its forward claims the use
and saves the alias of the pool buffer as it saves any weight, and its backward, Python already, makes sure the
buffer holds the copy again (`_Use.refill`) before reading it. Forwards recomputed inside a backward take copies
of their own there.

The pool holds one buffer per (shape, dtype, device) of the lean weights, shared by all of them: every weight of a
transformer's layer stack takes its turn in the buffers of one layer. Sharing is safe because a copy is consumed by
the op it was made for before the next one is written, in the order of the one stream both run on; a buffer that
something still references at the next write (a copy kept past its use, which the layers never do) is left to
its holder and replaced by a new one, counted in `pool_stats()` and warned about once, so no copy is ever
overwritten under a reader.

Launches. Each buffer records whose values it holds and what proved them current then (`_current`: the weight's
cast count and version counters, as for a kept copy; nothing while a cast's bytes await their all-gather). A use
that finds its values there launches nothing: the backward of the last layer after its forward, the forward of
the first layer after its backward. A use that does not makes one launch that also fills the buffers of the uses
that came after it last time (`_Order`, learned as the uses come; `_Batch`: as far as each has a buffer of its own,
so one launch per layer of a transformer stack). The order only saves launches: every use checks its own buffer,
so a wrong guess costs a launch, never a value. Megatron GPT, 8 layers: 58 launches per 256 uses.

Per use the host cost is what a kept copy costs plus those checks (about a microsecond): the layer's alias is made
once (one dispatch through NVFP4Tensor) and reused while the weight's fields and the pool buffer stay the same;
the launches are bound to the weights' fields and the buffers (no plan lookup, no argument checks).

A weight whose bytes change between a layer's forward and its backward (an optimizer step or a load in between)
makes that backward raise, as a parameter changed in place does in PyTorch. Memory: the pool (`pool_bytes()`, at
most one buffer per distinct weight shape) instead of a copy per weight; `held_copies()` counts pool buffers that
something besides the pool and the layers' aliases references (tests use it).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable

import torch

from . import kernels
from ._user import user_stacklevel
from .tensor import NVFP4Tensor
from .tensor_ops import alias_of

_ATTR = "_fp4_lean_view"


def is_lean(w) -> bool:
    """Whether `w` is an NVFP4 weight that keeps no compute copy (computed with lean copies)."""
    return type(w) is NVFP4Tensor and not w.copy_state.enabled and not torch.is_inference_mode_enabled()


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(t: torch.Tensor) -> int:
    """References to `t`'s storage (tensors and views on it), plus the one the query itself takes; 0 where this
    torch does not say (the pool then cannot see holders and trusts that layers consume their copies, as they do)."""
    if _STORAGE_USE_COUNT is None:
        return 0
    return _STORAGE_USE_COUNT(t.untyped_storage()._cdata)


class _Buffer:
    """One pool buffer, how many references to its storage the pool and the layers' aliases account for, and
    whose values it holds: the bound fields of the layer that wrote it last and `_current` of their weight then
    (None: nothing proves what it holds)."""

    __slots__ = ("tensor", "expected", "fields", "token", "version", "retired", "__weakref__")

    def __init__(self, shape, dtype, device):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.expected = _use_count(self.tensor)
        self.retired = False  # the pool let go of it (replaced or released): layers bound to it bind again
        self.mark(None, None)

    def mark(self, fields, token) -> None:
        """The buffer was just written with the values of `fields` as `token` says they are (None: unknown)."""
        self.fields, self.token, self.version = fields, token, self.tensor._version

    def free(self) -> bool:
        """Whether nothing but the pool and the layers' aliases references the buffer: the next copy may go in."""
        return _use_count(self.tensor) == self.expected

    def adopt(self, alias: torch.Tensor, before: int) -> None:
        """`alias` (made from this buffer after `before` was counted) is a layer's: account for it while it lives."""
        held = _use_count(self.tensor) - before
        self.expected += held
        ref = weakref.ref(self)
        weakref.finalize(alias, _release, ref, held)


def _release(ref, held: int) -> None:
    buf = ref()
    if buf is not None:
        buf.expected -= held


class _Pool:
    __slots__ = ("buffers", "replaced", "warned", "uses", "launches")

    def __init__(self):
        self.buffers: dict = {}
        self.replaced = 0
        self.warned = False
        self.uses = self.launches = 0  # lean uses seen, dequantize launches they made

    def take(self, key) -> _Buffer:
        """The buffer for `key` = (shape, dtype, device), new when there is none or the current one is held."""
        buf = self.buffers.get(key)
        if buf is not None and buf.free():
            return buf
        if buf is not None:
            buf.retired = True
            self._replaced(key)
        buf = self.buffers[key] = _Buffer(*key)
        return buf

    def _replaced(self, key) -> None:
        self.replaced += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"fp4_dist.lean: a lean copy of an NVFP4 weight of shape {list(key[0])} was still referenced when the "
                "next weight of that shape needed the pool buffer; the holder keeps it and the pool takes a new "
                "buffer (correct, but memory the lean mode is meant to save). Something keeps the tensor a layer "
                "computed with past its use", stacklevel=user_stacklevel())  # fmt: skip


_POOL = _Pool()


def pool_bytes() -> int:
    """Bytes the lean pool's buffers hold (one buffer per distinct shape, dtype and device of the lean weights)."""
    return sum(b.tensor.numel() * b.tensor.element_size() for b in _POOL.buffers.values())


def held_copies() -> int:
    """Pool buffers that something besides the pool and the layers' aliases references right now (0 between
    uses: nothing keeps a lean copy)."""
    return sum(not b.free() for b in _POOL.buffers.values())


def pool_stats() -> dict:
    """{"buffers", "bytes", "replaced", "uses", "launches"}: the pool's size, how often a held buffer had to be
    replaced, and how many lean uses (forward and backward) made how many dequantize launches (fewer launches
    than uses: copies found made already, by the use before or by a batched fill)."""
    return {"buffers": len(_POOL.buffers), "bytes": pool_bytes(), "replaced": _POOL.replaced, "uses": _POOL.uses,
            "launches": _POOL.launches}  # fmt: skip


def release_pool() -> None:
    """Let go of the pool's buffers (they are freed once the layers' aliases of them are dropped at their next
    use); the next lean use allocates again."""
    for buf in _POOL.buffers.values():
        buf.retired = True
    _POOL.buffers.clear()


# A lean use is made in one of two directions: a forward, or a backward writing its copy again.
_FWD, _BWD = 0, 1
_BATCH = 8  # most fills one launch makes


def _current(w: NVFP4Tensor):
    """What proves that a copy holds `w`'s current values: its cast count (`ComputeCopy.casts`) and the version
    counters of its bytes and of itself; None between a cast and its all-gather's processing (or for an inference
    tensor), when nothing proves a copy current."""
    return _token(w.copy_state, (w.rowwise_data, w.rowwise_scale_inv, w.amax), w)


def _token(cc, fields: tuple, w: NVFP4Tensor):
    """`_current(w)` from `w`'s copy state and fields as a layer holds them (what a use has at hand)."""
    if cc.pending:
        return None
    try:
        return (cc.casts, fields[0]._version, fields[1]._version, fields[2]._version, w._version)
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _bound(fields: tuple, w: NVFP4Tensor) -> bool:
    """Whether `fields` (a layer's binding, or a use's) are `w`'s fields now."""
    return fields[0] is w.rowwise_data and fields[1] is w.rowwise_scale_inv and fields[2] is w.amax


class _Order:
    """The order lean uses come in, learned as they come: each (layer, direction) links to the one that came
    after it last time. A changed link bumps `epoch`, and the batches built along the old links are built again.
    `tail` is where the last use's link goes: its layer's `next` list and the direction (the list, not the layer,
    so that the order keeps no layer alive)."""

    __slots__ = ("tail", "epoch")

    def __init__(self):
        self.tail, self.epoch = None, 0


_ORDER = _Order()


class _Batch:
    """The fills that one launch makes when a use finds its buffer not holding its weight: its own, then those of
    the uses the learned order says come next, as far as each has a buffer of its own (a shape not seen before in
    the batch): the next uses then find their copies made. A use the order got wrong (or whose weight changes
    before it) finds its buffer not holding its values and fills it itself, so the order is never trusted for
    values, only for saving launches."""

    __slots__ = ("epoch", "members", "fills", "launch")

    def __init__(self, head: "LeanView", d: int):
        self.epoch = _ORDER.epoch
        members, keys, link = [head], {head.key}, head.next[d]
        while link is not None and len(members) < _BATCH:
            v = link[0]()
            if (v is None or v.fill is None or v.key in keys or v.key[1:] != head.key[1:]
                    or v.buffer.retired or not _bound(v.fields, v.weight)):  # fmt: skip
                break
            members.append(v)
            keys.add(v.key)
            link = v.next[link[1]]
        self.members = tuple(v.ref for v in members)
        self.fills = tuple(v.fill for v in members)
        if len(members) == 1:
            self.launch = head.fill
        else:
            self.launch = kernels.bind_dequantize([v.fields[0] for v in members], [v.fields[1] for v in members],
                                                  [v.fields[2] for v in members],
                                                  [v.buffer.tensor for v in members])  # fmt: skip

    def still_bound(self) -> bool:
        """Whether the learned order and every member's binding are what the batch was built from."""
        if self.epoch != _ORDER.epoch:
            return False
        for ref, fill in zip(self.members, self.fills):
            v = ref()
            if v is None or v.fill is not fill:
                return False
        return True

    def run(self, head_token) -> bool:
        """Fill every member's buffer (one launch) and record what each holds; False, with nothing written, when
        a member's buffer is referenced by something or its weight is between a cast and its gather."""
        views, tokens = [], []
        for ref in self.members[1:]:
            v = ref()
            token = _token(v.cc, v.fields, v.weight)
            if token is None or not v.buffer.free():
                return False
            views.append(v)
            tokens.append(token)
        _POOL.launches += 1
        self.launch()
        for v, token in zip(views, tokens):
            v.buffer.mark(v.fields, token)
        head = self.members[0]()
        head.buffer.mark(head.fields, head_token)
        return True


class LeanView:
    """One layer's lean state: the pool buffer its weight's copy goes into, the bound dequantize launch into it,
    the alias of it (linked to the weight by one autograd node) the layer computes with, and its places in the
    learned order of uses (one per direction) with the batched fills that start there."""

    __slots__ = ("weight", "cc", "fields", "key", "buffer", "fill", "alias", "use", "ref", "here", "next", "tails",
                 "batches", "__weakref__")  # fmt: skip

    def __init__(self):
        self.ref = weakref.ref(self)
        self.here = ((self.ref, _FWD), (self.ref, _BWD))  # this layer's places, as links to it
        self.next = [None, None]
        self.tails = ((self.next, _FWD), (self.next, _BWD))
        self.clear()

    def clear(self) -> None:
        self.weight = self.cc = self.fields = self.key = self.buffer = self.fill = self.alias = self.use = None
        self.batches = [None, None]

    def value(self, w: NVFP4Tensor, grad: bool, fresh_tensor: bool = True, d: int = _FWD) -> torch.Tensor:
        """Make sure `w`'s values are in its pool buffer (a launch unless the buffer holds them already) and
        return what to compute with: the alias (`grad`) or the buffer itself, as a new tensor object on it
        (`fresh_tensor`) or the alias the layer keeps (for a function that saves it and refills before reading
        it: a view of it would count as a holder). `d`: the direction of the use (forward / backward). The buffer
        then records what proved the values (`buffer.token`: `_current` of `w`, None where nothing did)."""
        if w is not self.weight or self.buffer.retired or not _bound(self.fields, w):
            self._bind(w)
        token = _token(self.cc, self.fields, w)
        if not self.note_use(d, token):
            # Only a write needs the buffer free: one that holds these values serves its holder and this use alike.
            if not self.buffer.free():
                self._bind(w)
            self.fill_now(d, token)
        buf = self.buffer
        # A new tensor object per use (a view: no copy, one C++ call), never one the pool or the layer keeps: a
        # holder of it then shows in the buffer's reference count at the next write.
        if not grad:
            return buf.tensor.view(self.key[0])
        if self.alias is None:
            before = _use_count(buf.tensor)
            self.alias = alias_of(w, buf.tensor)
            buf.adopt(self.alias, before)
        return self.alias.view(self.key[0]) if fresh_tensor else self.alias

    def note_use(self, d: int, token) -> bool:
        """Note the use in the learned order; whether the bound buffer holds the weight's values as `token`
        (`_current` of the weight, not None) says they are now. A use that gets False calls `fill_now`."""
        tail, here = _ORDER.tail, self.here[d]
        if tail is not None and tail[0][tail[1]] is not here:
            tail[0][tail[1]] = here
            _ORDER.epoch += 1
        _ORDER.tail = self.tails[d]
        _POOL.uses += 1
        buf = self.buffer
        return (token is not None and buf.fields is self.fields and buf.token == token
                and buf.tensor._version == buf.version)  # fmt: skip

    def fill_now(self, d: int, token) -> None:
        """Write the weight's values into the bound buffer (in stream order): one launch, which also fills the
        buffers of the uses expected next."""
        if token is not None:
            batch = self.batches[d]
            if batch is None or not batch.still_bound():
                batch = self.batches[d] = _Batch(self, d)
            if batch.run(token):
                return
        _POOL.launches += 1
        self.fill()
        self.buffer.mark(self.fields, token)

    def _bind(self, w: NVFP4Tensor) -> _Buffer:
        self.clear()
        key = (tuple(w.shape), w.dtype, w.rowwise_data.device)
        buf = _POOL.take(key)
        fields = (w.rowwise_data, w.rowwise_scale_inv, w.amax)
        self.fill = kernels.bind_dequantize([fields[0]], [fields[1]], [fields[2]], [buf.tensor])
        self.weight, self.cc, self.fields, self.key, self.buffer = w, w.copy_state, fields, key, buf
        return buf

    def __deepcopy__(self, memo) -> "LeanView":
        return LeanView()

    def __reduce__(self):
        return LeanView, ()


def lean_view(module: torch.nn.Module) -> LeanView:
    """`module`'s lean state (made on first use; not a submodule, parameter or buffer: no state_dict entry)."""
    view = module.__dict__.get(_ATTR)
    if view is None:
        view = LeanView()
        object.__setattr__(module, _ATTR, view)
    return view


def forget(module: torch.nn.Module) -> None:
    """Drop `module`'s lean state (before `nn.Module._apply` swaps its parameters; see `compute_view.forget`)."""
    view = module.__dict__.get(_ATTR)
    if view is not None:
        view.clear()


class _Note:
    """What autograd keeps in place of a lean copy: the layer's lean state, the weight, the view of the copy that
    was saved, and the versions of the weight's bytes it was made from."""

    __slots__ = ("view", "weight", "geometry", "stamp")

    def __init__(self, view: LeanView, weight: NVFP4Tensor, saved: torch.Tensor):
        self.view, self.weight = view, weight
        self.geometry = (tuple(saved.shape), saved.stride(), saved.storage_offset())
        self.stamp = _stamp(weight)


def _stamp(w: NVFP4Tensor) -> tuple:
    return (id(w.rowwise_data), w.rowwise_data._version, id(w.rowwise_scale_inv), w.rowwise_scale_inv._version,
            id(w.amax), w.amax._version)  # fmt: skip


def lean_call(module: torch.nn.Module, weight: NVFP4Tensor, op: Callable[[torch.Tensor], torch.Tensor]):
    """``op(copy)`` for `module`'s use of its lean weight `weight`: `copy` holds the weight's values (linked to it
    by an autograd node when grad is on); whatever autograd saves of it inside `op` is saved as a note that
    re-dequantizes in backward (see the module docstring). `op` must consume the copy, not keep it."""
    view = lean_view(module)
    if not torch.is_grad_enabled():
        return op(view.value(weight, False))
    value = view.value(weight, weight.requires_grad)
    ptr, device = value.untyped_storage().data_ptr(), value.device

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == ptr:
            return _Note(view, weight, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        return op(value)


def _name(w: NVFP4Tensor) -> str:
    """How an error names a weight: its module path where a conversion recorded one, else its shape."""
    return str(getattr(w, "fp4_dist_name", None) or list(w.shape))


def _raise_changed(w: NVFP4Tensor) -> None:
    raise RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: the "
        f"NVFP4 weight {_name(w)} changed between the forward and the backward of its layer (an optimizer step or "
        "a load in between?)")


def _unpack(saved):
    if not isinstance(saved, _Note):
        return saved
    w = saved.weight
    if _stamp(w) != saved.stamp:
        _raise_changed(w)
    shape, stride, offset = saved.geometry
    return saved.view.value(w, False, d=_BWD).as_strided(shape, stride, offset)


# The id of the backward pass this thread runs in, -1 outside one.
_graph_task_id = torch._C._current_graph_task_id


def _private(w: NVFP4Tensor) -> torch.Tensor:
    """A copy of its own for a forward that `lean_call_refilled` runs inside a backward (activation recomputation):
    the recomputed node saves it for its backward, so it must not be a pool buffer another node writes meanwhile.
    (`lean_call` needs none: its notes are never handed to checkpointing, so a recomputation never runs between a
    note's refill and its read.)"""
    value = w.dequantize(w.dtype)
    return alias_of(w, value) if w.requires_grad else value


# ------------------------------------------------------------------------------------ refilled at backward
class _Use:
    """What the autograd node of a function that refills before it reads (Megatron's linear, through the adapter)
    keeps of a lean use: the layer's lean state, the bound launch that wrote the copy, the buffer it wrote, and
    what proved the weight's values then (`_current`; where nothing did, the versions of its bytes). The
    microbatches of a step share one (`LeanView.use`): it changes only with the weight."""

    __slots__ = ("view", "fill", "buffer", "weight", "cc", "fields", "token", "stamp")

    def __init__(self, view: LeanView, weight: NVFP4Tensor, token):
        self.view, self.fill, self.buffer, self.weight = view, view.fill, view.buffer, weight
        self.cc, self.fields, self.token = view.cc, view.fields, token
        self.stamp = _stamp(weight) if token is None else None

    def refill(self) -> None:
        """Make sure the buffer the node saved holds the copy again, right before the node reads it."""
        w, f = self.weight, self.fields
        if not _bound(f, w):
            _raise_changed(w)
        token = _token(self.cc, f, w)
        if self.token is not None:
            if token != self.token:
                _raise_changed(w)
        elif _stamp(w) != self.stamp:
            _raise_changed(w)
        view = self.view
        if view.fill is self.fill:  # the layer is bound as at the forward: the same buffer and fields
            if not view.note_use(_BWD, token):
                view.fill_now(_BWD, token)
        else:
            _POOL.uses += 1
            _POOL.launches += 1
            self.fill()
            self.buffer.mark(None, None)


_CLAIM = threading.local()


def lean_call_refilled(module: torch.nn.Module, weight: NVFP4Tensor, op: Callable[[torch.Tensor], torch.Tensor]):
    """`lean_call` for an op whose autograd function claims the use (`claim` in its forward) and calls `refill` of
    what it claimed at the start of its backward: the function then saves the layer's alias of the pool buffer
    itself (no saved-tensor hooks, no Python per saved tensor) and the copy is written again just before its
    backward reads it. An op that does not claim the use raises (its graph would read whatever the buffer holds
    then)."""
    view = lean_view(module)
    if not torch.is_grad_enabled():
        return op(view.value(weight, False))
    if _graph_task_id() != -1:  # a recomputation inside a backward (activation checkpointing)
        return op(_private(weight))
    if not weight.requires_grad:
        return lean_call(module, weight, op)
    value = view.value(weight, True, fresh_tensor=False)
    use, token = view.use, view.buffer.token
    if token is None or use is None or use.token != token or use.fill is not view.fill:
        use = view.use = _Use(view, weight, token)
    _CLAIM.pending = (value, use)
    try:
        out = op(value)
    finally:
        unclaimed, _CLAIM.pending = getattr(_CLAIM, "pending", None), None
    if unclaimed is not None:
        raise RuntimeError(
            f"fp4_dist.lean: the lean copy of NVFP4 weight {_name(weight)} was not claimed by the autograd function "
            "it was made for, so its backward would not write the copy again before reading it; this "
            "megatron-core's linear function is not the one the adapter knows")
    return out


def claim(weight: torch.Tensor):
    """In an autograd function's forward: the `_Use` whose copy `weight` is (None if it is none), to keep on the
    function's context and `refill()` at the start of its backward."""
    pending = getattr(_CLAIM, "pending", None)
    if pending is None or pending[0] is not weight:
        return None
    _CLAIM.pending = None
    return pending[1]
