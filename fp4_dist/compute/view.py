"""A layer's view of its NVFP4 weight: a plain alias of the weight's compute copy, what lets a forward cost what a
bf16 forward costs.

An op on an NVFP4Tensor goes through PyTorch's Python dispatch (`NVFP4Tensor.__torch_dispatch__`) even when the
compute copy is current: ~15-20 us of host time per use of a linear weight, what any wrapper-subclass parameter
costs, and the whole of the NVFP4 path's extra cost once the step is host-bound (bench/RESULTS.md).
A layer uses its weight in every microbatch but the weight changes once per step, so the layer keeps, per change
of the copy, one plain tensor that

- aliases the compute copy (no memory of its own; a refresh overwrites the copy in place and the view sees it),
- is connected to the parameter by a single C++ autograd node (`compute_alias`: clone's, whose backward
  passes the gradient through), so the weight gradient still reaches the parameter's grad accumulator and every
  hook on it (Megatron's DDP),
- has a version counter of its own, which every refresh of the copy bumps (`copy._mark_refreshed`), so a
  backward through a graph recorded before a refresh raises, as for a plain parameter changed in place. It is not
  an autograd view of the parameter: were it one, the bump of the parameter's counter at each refresh would make
  autograd rebuild its node by replaying the view op through the Python dispatch, once per weight per step.

Under CUDA graph capture a use gets an alias of its own instead of the cached one: autograd runs a node's backward
on the stream its forward ran on, and the cached alias's node was recorded on an eager stream, which a captured
backward may not wait on. Its values are the same copy (`compute_alias`).

Per use the layer checks that the copy is current (`ComputeCopy.fresh_for`, a few attribute reads) and passes the
view where it passed the weight: a training step (cast, all-gather, one refresh of every copy) keeps the same view
and node, and so do uses under no_grad (evaluation, the no_grad forward of reentrant activation checkpointing). When the copy is not current at a use (bytes changed by copy_, quantize_, load_state_dict, ...), the
layer refreshes it and makes the view again; between a cast and its all-gather, with `compute_copy = False`, or
under inference mode it passes the weight itself (the dispatch path, which handles those cases).

The cache belongs to the layer, not to the weight: the view's autograd node holds the parameter, so a cache on the
parameter would be a reference cycle through C++ that Python's garbage collector cannot see (the weight would never
be freed), and it is dropped before the layer is moved or cast (`forget`: torch then swaps a subclass parameter in
place and poisons the grad accumulator the view's node leads to). Users: `NVFP4Linear` (`linear.py`: what
`convert_linear_weights` makes of a plain nn.Linear) and the Megatron adapter's hooks of its parallel linear layers.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..tensor import NVFP4Tensor
from .. import kernels
from . import lean
from .alias import alias_onto
from ..tensor.copy import refresh_compute_copies, version_key

_ATTR = "_fp4_compute_view"


class ComputeView:
    """One layer's cached view of its NVFP4 weight's compute copy; call it with the weight on every use."""

    __slots__ = ("weight", "view", "value", "grad", "__weakref__")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Forget the view (and with it the references to the weight and its copy)."""
        self.weight = self.view = self.value = self.grad = None

    def __call__(self, w: NVFP4Tensor) -> torch.Tensor:
        """The tensor to compute with in place of `w`: the cached view while it is current, else see `_make`."""
        cc = w.copy_state
        enabled = torch.is_grad_enabled()
        grad = enabled and w.requires_grad
        # With grad off, a view made with grad serves as well (nothing is recorded): evaluation under no_grad, and
        # the no_grad forward of reentrant activation checkpointing (Megatron's recompute), keep the one view.
        if w is self.weight and (grad is self.grad or not enabled) and cc.value is self.value and not cc.pending:
            # ComputeCopy.fresh_for inlined (every use of every weight runs this), less its dtype test: a weight's
            # dtype changes only by a parameter swap (nn.Module._apply), and the layer drops its view before one.
            src, stamp = cc.sources, cc.stamp
            if (stamp is not None and src[0] is w.rowwise_data and src[1] is w.rowwise_scale_inv
                    and src[2] is w.amax and stamp == version_key(src, self.value, w)):  # fmt: skip
                return compute_alias(w) if grad and kernels.capturing() else self.view
        view = self._make(w, grad)
        return compute_alias(w) if grad and view is not w and kernels.capturing() else view

    def _make(self, w: NVFP4Tensor, grad: bool) -> torch.Tensor:
        self.clear()
        cc = w.copy_state
        if cc.pending and cc.auto_refresh and cc.enabled:
            refresh_compute_copies([w])  # the first use after a cast whose caller does no post-processing
        if not cc.enabled or cc.pending or torch.is_inference_mode_enabled():
            return w
        if not cc.fresh_for(w):
            refresh_compute_copies([w])
            if not cc.fresh_for(w):  # an inference tensor: nothing can prove a copy current
                return w
        view = compute_alias(w)  # one dispatch; a training step's refresh keeps it (see the module docstring)
        self.weight, self.view, self.value, self.grad = w, view, cc.value, grad
        cc.views.add(self)  # so that turning the copy off frees its memory now, not at this layer's next use
        return view

    # A module holding a cache is deep-copied (EMA, model surgery) or pickled: the copy starts without a view.
    def __deepcopy__(self, memo) -> "ComputeView":
        return ComputeView()

    def __reduce__(self):
        return ComputeView, ()


def compute_alias(w: NVFP4Tensor) -> torch.Tensor:
    """A plain tensor that aliases `w`'s current compute copy and is linked to `w` by one C++ autograd node whose
    backward passes the gradient through (clone's): what a layer caches to compute with.

    Unlike a view op on `w` (expand, alias, ...), it is not an autograd view of `w`: it has a version counter of
    its own, so bumping `w`'s counter (every refresh of the copy does) does not make autograd rebuild its node,
    which for a tensor subclass means replaying the view op through the Python dispatch, once per weight per
    step. Every refresh of the copy bumps this tensor's counter instead (`ComputeCopy.aliases`), for as long as
    it lives, in a layer's cache or only in a recorded graph. The caller makes sure the copy is current
    (`fp4_dist.compute.alias` says how the alias is made).
    """
    cc = w.copy_state
    alias = alias_onto(w, cc.value)
    cc.live_aliases()  # forgets the dead ones: a weight that is never refreshed must not collect them
    cc.aliases.append(weakref.ref(alias))
    return alias


def compute_view(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """What `module` computes with in place of its weight `w`: the module's cached view when `w` is an NVFP4 weight
    (see the module docstring), `w` itself otherwise."""
    if type(w) is not NVFP4Tensor:
        return w
    cache = module.__dict__.get(_ATTR)
    if cache is None:
        cache = ComputeView()
        object.__setattr__(module, _ATTR, cache)  # not a submodule, parameter or buffer: no state_dict entry
    return cache(w)


def forget(module: nn.Module) -> None:
    """Drop `module`'s cached view. `nn.Module._apply` (`.to`, `.cuda`, `.bfloat16`, ...) swaps a tensor-subclass
    parameter in place and poisons its old grad accumulator, the one the view's autograd node leads to (a backward
    through the view would then raise): layers that cache a view call this first (the view is remade at the next
    use, linked to the parameter as it is after the swap)."""
    cache = module.__dict__.get(_ATTR)
    if cache is not None:
        cache.clear()
    lean.forget(module)
