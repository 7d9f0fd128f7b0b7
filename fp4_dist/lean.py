"""Lean compute: a layer's model-dtype copy of its NVFP4 weight exists only around its use.

With ``compute_copy=False`` a weight keeps no copy between updates (`fp4_dist.compute_copy`). An `NVFP4Linear` or
a Megatron parallel linear then computes as follows, with the same values and the same GEMMs as with a kept copy,
so losses and gradients are bitwise those of the default mode:

    forward    one bound dequantize launch writes the weight's values into the pool buffer of its shape (below),
               and the layer computes with its cached alias of that buffer
    autograd   what the linear saves for backward is not that buffer but a note naming the weight
               (`torch.autograd.graph.saved_tensors_hooks`, `lean_call`), so nothing of the copy stays alive
               between the forward and the backward of the layer, whatever the number of microbatches in flight
    backward   the note is unpacked into a new dequantization into the same pool buffer (one launch) for the
               input gradient; the weight gradient reaches the NVFP4 parameter through the alias's autograd node
               (clone's), as a plain [M, K] tensor

Megatron's linear function needs no hooks (`lean_call_refilled`): through the adapter its forward claims the use
and saves the alias of the pool buffer as it saves any weight, and its backward, Python already, writes the copy
into that buffer again (`_Use.refill`, one launch) before reading it. Forwards recomputed inside a backward take
copies of their own there.

The pool holds one buffer per (shape, dtype, device) of the lean weights, shared by all of them: every weight of a
transformer's layer stack takes its turn in the buffers of one layer. Sharing is safe because a copy is consumed by
the op it was made for before the next one is written, in the order of the one stream both run on; a buffer that
something still references at the next write (a copy kept past its use, which the layers never do) is left to
its holder and replaced by a new one, counted in `pool_stats()` and warned about once, so no copy is ever
overwritten under a reader.

Per use the host cost is what a kept copy costs plus one bound launch: the layer's alias is made once (one
dispatch through NVFP4Tensor) and reused while the weight's fields and the pool buffer stay the same; the launch is
bound to the weight's fields and the buffer (no plan lookup, no argument checks).

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
    """One pool buffer, and how many references to its storage the pool and the layers' aliases account for."""

    __slots__ = ("tensor", "expected", "__weakref__")

    def __init__(self, shape, dtype, device):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.expected = _use_count(self.tensor)

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
    __slots__ = ("buffers", "replaced", "warned")

    def __init__(self):
        self.buffers: dict = {}
        self.replaced = 0
        self.warned = False

    def take(self, key) -> _Buffer:
        """The buffer for `key` = (shape, dtype, device), new when there is none or the current one is held."""
        buf = self.buffers.get(key)
        if buf is not None and buf.free():
            return buf
        if buf is not None:
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
    """{"buffers", "bytes", "replaced"}: the pool's size and how often a held buffer had to be replaced."""
    return {"buffers": len(_POOL.buffers), "bytes": pool_bytes(), "replaced": _POOL.replaced}


def release_pool() -> None:
    """Let go of the pool's buffers (they are freed once the layers' aliases of them are dropped at their next
    use); the next lean use allocates again."""
    _POOL.buffers.clear()


class LeanView:
    """One layer's lean state: the pool buffer its weight's copy goes into, the bound dequantize launch into it,
    and the alias of it (linked to the weight by one autograd node) the layer computes with."""

    __slots__ = ("weight", "fields", "key", "buffer", "fill", "alias", "__weakref__")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.weight = self.fields = self.key = self.buffer = self.fill = self.alias = None

    def value(self, w: NVFP4Tensor, grad: bool, fresh_tensor: bool = True) -> torch.Tensor:
        """Write `w`'s values into its pool buffer (one launch) and return what to compute with: the alias
        (`grad`) or the buffer itself, as a new tensor object on it (`fresh_tensor`) or the alias the layer keeps
        (for a function that saves it and refills before reading it: a view of it would count as a holder)."""
        buf = self.buffer
        if (w is not self.weight or buf is not _POOL.buffers.get(self.key) or not buf.free()
                or self.fields[0] is not w.rowwise_data or self.fields[1] is not w.rowwise_scale_inv
                or self.fields[2] is not w.amax):  # fmt: skip
            buf = self._bind(w)
        self.fill()
        # A new tensor object per use (a view: no copy, one C++ call), never one the pool or the layer keeps: a
        # holder of it then shows in the buffer's reference count at the next write.
        if not grad:
            return buf.tensor.view(self.key[0])
        if self.alias is None:
            before = _use_count(buf.tensor)
            self.alias = alias_of(w, buf.tensor)
            buf.adopt(self.alias, before)
        return self.alias.view(self.key[0]) if fresh_tensor else self.alias

    def _bind(self, w: NVFP4Tensor) -> _Buffer:
        self.clear()
        key = (tuple(w.shape), w.dtype, w.rowwise_data.device)
        buf = _POOL.take(key)
        fields = (w.rowwise_data, w.rowwise_scale_inv, w.amax)
        self.fill = kernels.bind_dequantize([fields[0]], [fields[1]], [fields[2]], [buf.tensor])
        self.weight, self.fields, self.key, self.buffer = w, fields, key, buf
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
    return saved.view.value(w, False).as_strided(shape, stride, offset)


def _in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a recomputation of activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


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
    keeps of a lean use: the bound launch that wrote the copy and the versions of the bytes it was made from."""

    __slots__ = ("fill", "weight", "stamp")

    def __init__(self, fill, weight: NVFP4Tensor):
        self.fill, self.weight, self.stamp = fill, weight, _stamp(weight)

    def refill(self) -> None:
        """Write the copy again, into the buffer the node saved, right before the node reads it."""
        if _stamp(self.weight) != self.stamp:
            _raise_changed(self.weight)
        self.fill()


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
    if _in_backward():
        return op(_private(weight))
    if not weight.requires_grad:
        return lean_call(module, weight, op)
    value = view.value(weight, True, fresh_tensor=False)
    _CLAIM.pending = (value, _Use(view.fill, weight))
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
