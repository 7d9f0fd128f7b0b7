"""Layer rows: Megatron's parallel linears compute on the NVFP4 weight's compute copy (kept or lean), or in a compute
mode with GEMMs of its own (``--compute fp8``) through that mode's function (`mode_linear`)."""

from __future__ import annotations

from .. import tensor as _tensor
from ..compute.view import compute_view, forget
from ..compute.lean import is_lean
from ..compute.modes import DEFAULT, MODES
from .mode_linear import mode_forward_impl
from .lean_claim import claim, lean_call_refilled


def make_forward_impl(original):
    def _forward_impl(self, input, weight, *args, **kwargs):
        mode = MODES[getattr(self, "fp4_compute", DEFAULT)]
        if mode.parallel_linear is not None and type(weight) is _tensor.NVFP4Tensor:
            return mode_forward_impl(mode, self, input, weight, *args, **kwargs)
        # Megatron's linear function reads `weight.main_grad` with gradient_accumulation_fusion and calls the
        # weight's own gather with gtp_remat_size > 1: the parameter itself is passed then (the dispatch path).
        if (type(weight) is _tensor.NVFP4Tensor and not kwargs.get("gradient_accumulation_fusion")
                and kwargs.get("gtp_remat_size", 1) <= 1):  # fmt: skip
            if is_lean(weight):  # no kept copy: one made for this use, re-made in backward (fp4_dist.compute.lean)
                return lean_call_refilled(self, weight, lambda value: original(self, input, value, *args, **kwargs))
            weight = compute_view(self, weight)
        return original(self, input, weight, *args, **kwargs)

    return _forward_impl


def make_linear_forward(original):
    def forward(ctx, input, weight, *args):
        # A lean use's copy (compute.lean_claim.lean_call_refilled): the node keeps how to write it again, and saves
        # the layer's alias of the pool buffer as upstream saves any weight.
        use = claim(weight)
        if use is not None:
            ctx.fp4_lean = use
        return original(ctx, input, weight, *args)

    return forward


def make_linear_backward(original):
    def backward(ctx, *grads):
        use = getattr(ctx, "fp4_lean", None)
        if use is not None:
            use.refill()  # the pool buffer holds another weight's copy since the forward: write this one again
        return original(ctx, *grads)

    return backward


def make_apply(original):
    def _apply(self, fn, *args, **kwargs):
        forget(self)  # the cached view leads to the grad accumulator that torch's in-place swap poisons
        return original(self, fn, *args, **kwargs)

    return _apply

