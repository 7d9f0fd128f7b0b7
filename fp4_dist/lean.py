"""Lean compute: a layer's model-dtype copy of its NVFP4 weight exists only around its use.

With ``compute_copy=False`` a weight keeps no copy between updates (`fp4_dist.compute_copy`). An `NVFP4Linear`
then computes as follows, with the same values and the same GEMMs as with a kept copy, so losses and gradients
are bitwise those of the default mode:

    forward    dequantize the weight into a fresh [M, K] tensor (one launch), F.linear with it, let it go
    autograd   what the linear saves for backward is not that tensor but a note naming the weight
               (`torch.autograd.graph.saved_tensors_hooks`), so nothing of the copy stays alive between the
               forward and the backward of the layer, whatever the number of microbatches in flight
    backward   the note is unpacked into a new dequantization (one launch) for the input gradient; the weight
               gradient reaches the NVFP4 parameter through clone's autograd node, as a plain [M, K] tensor

A weight whose bytes change between a layer's forward and its backward (an optimizer step or a load in between)
makes that backward raise, as a parameter changed in place does in PyTorch. Memory: at most the copies of the
layers computing at one moment; time: one dequantize launch per use (forward, backward), at memory speed.
`live_copies()` counts the dequantized copies alive (tests use it).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from .tensor import NVFP4Tensor
from .tensor_ops import clone_value

_LIVE: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()


def live_copies() -> int:
    """Dequantized copies made by lean layers that are still alive."""
    return len(_LIVE)


class _Note:
    """What autograd keeps in place of a lean copy: the weight, the view of the copy that was saved, and the
    versions of the weight's bytes it was made from."""

    __slots__ = ("weight", "geometry", "stamp")

    def __init__(self, weight: NVFP4Tensor, saved: torch.Tensor):
        self.weight = weight
        self.geometry = (tuple(saved.shape), saved.stride(), saved.storage_offset())
        self.stamp = _stamp(weight)


def _stamp(w: NVFP4Tensor) -> tuple:
    return (id(w.rowwise_data), w.rowwise_data._version, id(w.rowwise_scale_inv), w.rowwise_scale_inv._version,
            id(w.amax), w.amax._version)  # fmt: skip


def _copy(w: NVFP4Tensor, grad: bool) -> torch.Tensor:
    value = clone_value(w, fresh=True) if grad else w.dequantize(w.dtype)
    _LIVE.add(value)
    return value


def is_lean(w) -> bool:
    """Whether `w` is an NVFP4 weight that keeps no compute copy (computed with lean copies)."""
    return type(w) is NVFP4Tensor and not w.copy_state.enabled and not torch.is_inference_mode_enabled()


@contextlib.contextmanager
def lean_use(weight: NVFP4Tensor):
    """Yields a fresh copy of `weight` to compute with in place of it (linked to it by clone's autograd node when
    grad is on); whatever autograd saves of that copy inside the block is saved as a note that re-dequantizes in
    backward (see the module docstring). Leave the block right after the op."""
    grad = torch.is_grad_enabled() and weight.requires_grad
    value = _copy(weight, grad)
    if not torch.is_grad_enabled():
        yield value
        return
    # Autograd keeps the hooks with what they packed: the closure holds the copy's address, never the copy.
    ptr, device = value.untyped_storage().data_ptr(), value.device

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == ptr:
            return _Note(weight, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield value


def lean_linear(input: torch.Tensor, weight: NVFP4Tensor, bias=None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` computing with a copy of `weight` that exists only around its use."""
    with lean_use(weight) as value:
        return F.linear(input, value, bias)


def _unpack(saved):
    if not isinstance(saved, _Note):
        return saved
    w = saved.weight
    if _stamp(w) != saved.stamp:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: the "
            f"NVFP4 weight {getattr(w, 'fp4_dist_name', None) or list(w.shape)} changed between the forward and the "
            "backward of its layer (an optimizer step or a load in between?)")
    shape, stride, offset = saved.geometry
    return _copy(w, False).as_strided(shape, stride, offset)
