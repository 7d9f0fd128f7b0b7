"""Lean uses that Megatron's linear function claims (through the adapter): it saves the layer's alias of the pool
buffer as it saves any weight, and its backward makes sure the buffer holds the copy again before reading it
(`Use.refill`), so it needs no saved-tensor hooks. Forwards recomputed inside a backward take copies of their own.

The claim travels from `lean_call_refilled` to the function's forward through a thread-local: the function is
Megatron's, called by Megatron's layer inside `op`, and takes no argument of ours.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .. import kernels
from ..tensor import NVFP4Tensor
from ..compute.alias import alias_onto
from ..tensor.copy import bound, raise_changed, stamp, weight_name
from ..compute.lean import LeanView, lean_call, lean_view
from ..compute.lean_order import BWD
from ..compute.pool import AUDIT, POOL, copy_token

# The id of the backward pass this thread runs in, -1 outside one.
_graph_task_id = torch._C._current_graph_task_id


def _private(w: NVFP4Tensor) -> torch.Tensor:
    """A copy of its own for a forward that `lean_call_refilled` runs inside a backward (activation recomputation):
    the recomputed node saves it for its backward, so it must not be a pool buffer another node writes meanwhile.
    (`lean_call` needs none: its notes are never handed to checkpointing, so a recomputation never runs between a
    note's refill and its read.)"""
    value = w.dequantize(w.dtype)
    return alias_onto(w, value) if w.requires_grad else value


class Use:
    """What the autograd node of a function that refills before it reads (Megatron's linear, through the adapter)
    keeps of a lean use: the layer's lean state, the bound launch that wrote the copy, the buffer it wrote, and
    what proved the weight's values then (`pool.copy_token`; where nothing did, the versions of its bytes). The
    microbatches of a step share one (`LeanView.use`): it changes only with the weight."""

    __slots__ = ("view", "fill", "buffer", "weight", "cc", "fields", "token", "stamp")

    def __init__(self, view: LeanView, weight: NVFP4Tensor, token):
        self.view, self.fill, self.buffer, self.weight = view, view.fill, view.buffer, weight
        self.cc, self.fields, self.token = view.cc, view.fields, token
        self.stamp = stamp(weight) if token is None else None

    def refill(self) -> None:
        """Make sure the buffer the node saved holds the copy again, right before the node reads it."""
        w, f = self.weight, self.fields
        if not bound(f, w):
            raise_changed(w)
        token = copy_token(self.cc, f, w)
        if self.token is not None:
            if token != self.token:
                raise_changed(w)
        elif stamp(w) != self.stamp:
            raise_changed(w)
        view = self.view
        if view.fill is self.fill and kernels.capturing():  # a backward being captured
            view.graphed_fill()
        elif view.fill is self.fill:  # the layer is bound as at the forward: the same buffer and fields
            if not view.note_use(BWD, token):
                view.fill_now(BWD, token)
        else:
            POOL.uses += 1
            POOL.launched()
            self.fill()
            self.buffer.mark(None, None)
        if AUDIT.on and not kernels.capturing():
            AUDIT.note(self.buffer.tensor, w)


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
        use = view.use = Use(view, weight, token)
    _CLAIM.pending = (value, use)
    try:
        out = op(value)
    finally:
        unclaimed, _CLAIM.pending = getattr(_CLAIM, "pending", None), None
    if unclaimed is not None:
        raise RuntimeError(
            f"fp4_dist.compute.lean: the lean copy of NVFP4 weight {weight_name(weight)} was not claimed by the "
            "autograd function it was made for, so its backward would not write the copy again before reading "
            "it; this megatron-core's linear function is not the one the adapter knows")
    return out


def claim(weight: torch.Tensor):
    """In an autograd function's forward: the `Use` whose copy `weight` is (None if it is none), to keep on the
    function's context and `refill()` at the start of its backward."""
    pending = getattr(_CLAIM, "pending", None)
    if pending is None or pending[0] is not weight:
        return None
    _CLAIM.pending = None
    return pending[1]
