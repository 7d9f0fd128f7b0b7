"""Megatron's parallel linears in a compute mode that brings its own GEMMs (a row of `fp4_dist.compute.modes.MODES`
with a ``parallel_linear``, e.g. ``--compute fp8``): the layer's ``_forward_impl`` computes with the mode's function
instead of Megatron's linear function, with the same tensor-parallel communication around the same GEMMs:

    forward   sequence parallel: all-gather the input along the sequence (tensor-parallel group); y = x W^T + b
    backward  dgrad dx = dy W, all-reduced over the tensor-parallel group (column-parallel layers) or
              reduce-scattered along the sequence (sequence parallel); wgrad dW = dy^T x, returned as the
              weight's gradient, which Megatron's DDP hooks add to its main_grad

Megatron's options that such a mode does not take stop the run with a sentence naming the flag, on every rank: at
start-up (`startup.refuse_unsupported_args`: no --fp4-param-gather, gradient-accumulation fusion), else at the
layer's first use (weights sharded for rematerialization, deferred embedding wgrad).
"""

from __future__ import annotations

from typing import Optional

from ..compute.modes import ComputeMode
from ..tensor.copy import weight_name


def mode_forward_impl(mode: ComputeMode, layer, input, weight, bias=None, gradient_accumulation_fusion: bool = False,
                      allreduce_dgrad: bool = False, sequence_parallel: bool = False, grad_output_buffer=None,
                      wgrad_deferral_limit: Optional[int] = None, tp_group=None, gtp_remat_size: int = 1):  # fmt: skip
    """A Megatron parallel linear's ``_forward_impl`` for an NVFP4 weight in `mode`."""
    if gradient_accumulation_fusion:
        _refuse(mode, weight, "gradient-accumulation fusion (its kernel writes main_grad): add "
                              "--no-gradient-accumulation-fusion")
    if grad_output_buffer is not None:
        _refuse(mode, weight, "deferred embedding weight gradients: drop --defer-embedding-wgrad-compute")
    if gtp_remat_size > 1:
        _refuse(mode, weight, "weights sharded for rematerialization (gtp_remat_size > 1): drop "
                              "--tensor-parallel-num-weight-shards")
    if (allreduce_dgrad or sequence_parallel) and tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    return mode.parallel_linear(layer, input, weight, bias, bool(allreduce_dgrad), bool(sequence_parallel), tp_group)


def _refuse(mode: ComputeMode, weight, what: str) -> None:
    raise RuntimeError(f"fp4_dist.megatron: the {mode.name} compute mode ({mode.flags()}) does not take {what} "
                       f"(NVFP4 weight {weight_name(weight)})")
