"""Lean compute: a layer's model-dtype copy of its NVFP4 weight exists only around its use.

With ``compute_copy=False`` a weight keeps no copy between updates (`fp4_dist.tensor.copy`). An `NVFP4Linear` or
a Megatron parallel linear then computes as follows, with the same values and the same GEMMs as with a kept copy,
so losses and gradients are bitwise those of the default mode:

    forward    the weight's values are made in the pool buffer of its shape (`pool.py`), unless the buffer holds
               them already, and the layer computes with its cached alias of that buffer
    autograd   what the linear saves for backward is not that buffer but a note naming the weight
               (`torch.autograd.graph.saved_tensors_hooks`, `lean_call`), so nothing of the copy stays alive
               between the forward and the backward of the layer, whatever the number of microbatches in flight
    backward   the note is unpacked into the same pool buffer, made again unless it holds the values still, for
               the input gradient; the weight gradient reaches the NVFP4 parameter through the alias's autograd
               node (clone's), as a plain [M, K] tensor

Megatron's linear function needs no hooks: it claims the use instead (`lean_claim.py`).

Launches. A use that finds its values in its buffer launches nothing: the backward of the last layer after its
forward, the forward of the first layer after its backward. A use that does not makes one launch that also fills
the buffers of the uses expected next (`lean_order.py`).

Host cost per use: the layer's alias is made once (one dispatch through NVFP4Tensor) and reused while the weight's
fields and the pool buffer stay the same, and the launches are bound to the weights' fields and the buffers (no plan
lookup, no argument checks). Through Megatron's claim a use then costs a kept copy's lookup plus about 2 us
of checks (forward and backward). Through the saved-tensor hooks (`NVFP4Linear`) autograd calls Python to pack and
unpack every tensor the linear saves: tens of microseconds more than a kept copy per forward and backward on a CPU
core (`python bench/host_per_use.py --device cpu --size 256`: 250-299 against 206-223 us over three runs).

A weight whose bytes change between a layer's forward and its backward (an optimizer step or a load in between)
makes that backward raise, as a parameter changed in place does in PyTorch. Memory: the pool (`pool_bytes()`, at
most one buffer per distinct weight shape) instead of a copy per weight.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .. import kernels
from ..tensor import NVFP4Tensor
from .alias import alias_onto
from ..tensor.copy import bound, raise_changed, stamp
from .lean_order import BWD, FWD, ORDER, Batch
from .pool import AUDIT, POOL, Buffer, copy_token, use_count

_ATTR = "_fp4_lean_view"


def is_lean(w) -> bool:
    """Whether `w` is an NVFP4 weight that keeps no compute copy (computed with lean copies)."""
    return type(w) is NVFP4Tensor and not w.copy_state.enabled and not torch.is_inference_mode_enabled()


class LeanView:
    """One layer's lean state: the pool buffer its weight's copy goes into, the bound dequantize launch into it,
    the alias of it (linked to the weight by one autograd node) the layer computes with, and its places in the
    learned order of uses (one per direction) with the batched fills that start there."""

    __slots__ = ("weight", "cc", "fields", "key", "buffer", "fill", "alias", "use", "ref", "here", "next", "tails",
                 "batches", "ordinal", "__weakref__")  # fmt: skip

    def __init__(self):
        self.ordinal = None  # (key, this layer's place among the layers of its weight shape: `POOL.ordinal`)
        self.ref = weakref.ref(self)
        self.here = ((self.ref, FWD), (self.ref, BWD))  # this layer's places, as links to it
        self.next = [None, None]
        self.tails = ((self.next, FWD), (self.next, BWD))
        self.clear()

    def clear(self) -> None:
        self.weight = self.cc = self.fields = self.key = self.buffer = self.fill = self.alias = self.use = None
        self.batches = [None, None]

    def value(self, w: NVFP4Tensor, grad: bool, fresh_tensor: bool = True, d: int = FWD) -> torch.Tensor:
        """Make sure `w`'s values are in its pool buffer (a launch unless the buffer holds them already) and
        return what to compute with: the alias (`grad`) or the buffer itself, as a new tensor object on it
        (`fresh_tensor`) or the alias the layer keeps (for a function that saves it and refills before reading
        it: a view of it would count as a holder). `d`: the direction of the use (forward / backward). The buffer
        then records what proved the values (`buffer.token`: `pool.copy_token`, None where nothing did)."""
        if w is not self.weight or self.buffer.retired or not bound(self.fields, w):
            self._bind(w)
        captured = kernels.capturing()
        if captured:
            self.graphed_fill()
        else:
            self._fill_unless_held(w, d)
            if AUDIT.on:
                AUDIT.note(self.buffer.tensor, w)
        buf = self.buffer
        # A new tensor object per use (a view: no copy, one C++ call), never one the pool or the layer keeps: a
        # holder of it then shows in the buffer's reference count at the next write.
        if not grad:
            return buf.tensor.view(self.key[0])
        if captured:
            # An alias of its own: the kept one's autograd node was recorded on an eager stream, which a captured
            # backward may not wait on (`fp4_dist.compute.view` says more).
            return _adopted_alias(w, buf)
        if self.alias is None:
            self.alias = _adopted_alias(w, buf)
        return self.alias.view(self.key[0]) if fresh_tensor else self.alias

    def _fill_unless_held(self, w: NVFP4Tensor, d: int) -> None:
        token = copy_token(self.cc, self.fields, w)
        if not self.note_use(d, token):
            # Only a write needs the buffer free: one that holds these values serves its holder and this use alike.
            if not self.buffer.free():
                self._bind(w)
            self.fill_now(d, token)

    def graphed_fill(self) -> None:
        """A use inside a CUDA graph capture: write the copy into the bound buffer unconditionally, alone (no batch:
        the learned order and the tokens are host state a replay never consults), and mark the buffer as one a
        graph writes (`pool.Buffer.graphed`). Every replay then writes the copy from the weight's bytes of that
        step right before its GEMM reads it, whatever ran in between."""
        # No test of holders here: a holder inside the graph (a saved alias) reads the buffer only after its own
        # use writes it again (`lean_claim.Use.refill`), in the stream order every replay keeps.
        POOL.uses += 1
        POOL.launched()
        self.buffer.graphed = True
        self.fill()
        self.buffer.mark(None, None)

    def note_use(self, d: int, token) -> bool:
        """Note the use in the learned order; whether the bound buffer holds the weight's values as `token`
        (`pool.copy_token` of the weight, not None) says they are now. A use that gets False calls `fill_now`."""
        tail, here = ORDER.tail, self.here[d]
        if tail is not None and tail[0][tail[1]] is not here:
            tail[0][tail[1]] = here
            ORDER.epoch += 1
        ORDER.tail = self.tails[d]
        POOL.uses += 1
        buf = self.buffer
        return (token is not None and buf.fields is self.fields and buf.token == token
                and buf.tensor._version == buf.version)  # fmt: skip

    def fill_now(self, d: int, token) -> None:
        """Write the weight's values into the bound buffer (in stream order): one launch, which also fills the
        buffers of the uses expected next."""
        if token is not None:
            batch = self.batches[d]
            if batch is None or not batch.still_bound():
                batch = self.batches[d] = Batch(self, d)
            if batch.run(token):
                return
        POOL.launched()
        self.fill()
        self.buffer.mark(self.fields, token)

    def _bind(self, w: NVFP4Tensor) -> Buffer:
        self.clear()
        key = (tuple(w.shape), w.dtype, w.rowwise_data.device)
        if self.ordinal is None or self.ordinal[0] != key:
            self.ordinal = (key, POOL.ordinal(key))
        buf = POOL.take(key, self.ordinal[1])
        fields = (w.rowwise_data, w.rowwise_scale_inv, w.amax)
        self.fill = kernels.bind_dequantize([fields[0]], [fields[1]], [fields[2]], [buf.tensor])
        self.weight, self.cc, self.fields, self.key, self.buffer = w, w.copy_state, fields, key, buf
        return buf

    def __deepcopy__(self, memo) -> "LeanView":
        return LeanView()

    def __reduce__(self):
        return LeanView, ()


def _adopted_alias(w: NVFP4Tensor, buf: Buffer) -> torch.Tensor:
    """An alias of pool buffer `buf` linked to `w` (`alias_onto`), accounted for by the buffer while it lives."""
    before = use_count(buf.tensor)
    alias = alias_onto(w, buf.tensor)
    buf.adopt(alias, before)
    return alias


def lean_view(module: torch.nn.Module) -> LeanView:
    """`module`'s lean state (made on first use; not a submodule, parameter or buffer: no state_dict entry)."""
    view = module.__dict__.get(_ATTR)
    if view is None:
        view = LeanView()
        object.__setattr__(module, _ATTR, view)
    return view


def forget(module: torch.nn.Module) -> None:
    """Drop `module`'s lean state (before `nn.Module._apply` swaps its parameters; see `view.forget`)."""
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
        self.stamp = stamp(weight)


def lean_call(module: torch.nn.Module, weight: NVFP4Tensor, op: Callable[[torch.Tensor], torch.Tensor],
              fresh_tensor: bool = True):
    """``op(copy)`` for `module`'s use of its lean weight `weight`: `copy` holds the weight's values (linked to it
    by an autograd node when grad is on); whatever autograd saves of it inside `op` is saved as a note that
    re-dequantizes in backward (see the module docstring). `op` must consume the copy, not keep it. `fresh_tensor`
    False gives `op` the layer's alias itself instead of a new view of it, for an op known to keep nothing of its
    argument but what autograd saves (``F.linear``): one view and its autograd node fewer per use (about 6 us of
    host per forward on a CPU core, `bench/host_per_use.py --device cpu`)."""
    view = lean_view(module)
    if not torch.is_grad_enabled():
        return op(view.value(weight, False))
    value = view.value(weight, weight.requires_grad, fresh_tensor)
    ptr, device = value.untyped_storage().data_ptr(), value.device

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == ptr:
            return _Note(view, weight, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        return op(value)


def _unpack(saved):
    if not isinstance(saved, _Note):
        return saved
    w = saved.weight
    if stamp(w) != saved.stamp:
        raise_changed(w)
    shape, stride, offset = saved.geometry
    return saved.view.value(w, False, d=BWD).as_strided(shape, stride, offset)
