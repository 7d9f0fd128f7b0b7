"""The FP8 compute mode in Megatron's parallel linears (``--compute fp8`` / ``--fp4-compute fp8``): the layer's
``_forward_impl`` computes with `Fp8ParallelLinear` instead of Megatron's linear function, with the same tensor-
parallel communication around the same GEMMs, which read FP8 (`fp4_dist.compute.fp8`):

    forward   sequence parallel: all-gather the input along the sequence (tensor-parallel group); y = x W^T + b
    backward  dgrad dx = dy W, all-reduced over the tensor-parallel group (column-parallel layers) or
              reduce-scattered along the sequence (sequence parallel); wgrad dW = dy^T x, returned as the
              weight's gradient, which Megatron's DDP hooks add to its main_grad

The weight's FP8 copy is the layer's (`fp4_dist.compute.fp8_copy`), made once per weight update. Megatron's
options that this path does not take stop the run with a sentence naming the flag, on every rank: at start-up
(`startup.refuse_unsupported_args`: no --fp4-param-gather, gradient-accumulation fusion), else at the layer's first
use (weights sharded for rematerialization, deferred embedding wgrad).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..compute import fp8_copy
from ..compute.fp8 import output, saved_weight, weight_from_saved, weight_gradient
from ..compute.fp8_gemm import Fp8Operand, fp8_mm
from ..compute.lean import raise_changed, stamp, weight_name
from .startup import FP8_FLAGS


class Fp8ParallelLinear(torch.autograd.Function):
    """Megatron's LinearWithGradAccumulationAndAsyncCommunication with FP8 block-scaled GEMMs (module docstring);
    the communication is synchronous."""

    @staticmethod
    def forward(ctx, input, weight, bias, operand: Fp8Operand, allreduce_dgrad: bool, sequence_parallel: bool,
                tp_group):  # fmt: skip
        total = _gather_sequence(input, tp_group) if sequence_parallel else input
        k = total.shape[-1]
        x2 = total.reshape(-1, k)
        wgrad = ctx.needs_input_grad[1]
        if wgrad and not sequence_parallel:  # the weight gradient's operand from the same read, kept in FP8
            xq, xtq = Fp8Operand.both(x2)
            kept = (xtq.bits, xtq.scales)
        else:  # with sequence parallelism the local input is kept, as Megatron keeps it, and gathered again
            xq, nothing = Fp8Operand.rows(x2), input.new_empty(0)
            kept = (input if wgrad else nothing, nothing)
        y = fp8_mm(xq, operand, input.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(*kept, *saved_weight(operand))
        ctx.weight, ctx.stamp, ctx.has_bias = weight, stamp(weight), bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        return output(y, total.shape)

    @staticmethod
    def backward(ctx, dy):
        kept, kept_scales, *kept_weight = ctx.saved_tensors
        weight = ctx.weight
        if stamp(weight) != ctx.stamp:
            raise_changed(weight)
        want_dw = ctx.needs_input_grad[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = weight_from_saved(kept_weight)
        if want_dw:
            dyq, dytq = Fp8Operand.both(dy2)
        else:
            dyq, dytq = Fp8Operand.rows(dy2), None
        rows = dy2.shape[0]
        dx = fp8_mm(dyq, w.t(), dy.dtype)
        dx = dx.view(*dy.shape[:-1], dx.shape[-1])  # sizes spelled out: an expert may get no tokens
        if ctx.sequence_parallel:
            dx = _reduce_scatter_sequence(dx, ctx.tp_group)
        elif ctx.allreduce_dgrad:
            dist.all_reduce(dx, group=ctx.tp_group)
        dw = None
        if want_dw:
            if ctx.sequence_parallel:  # the local input, gathered again
                xt = Fp8Operand.rows(_gather_sequence(kept, ctx.tp_group).reshape(rows, kept.shape[-1]).t())
            else:  # x^T in FP8, kept by the forward
                xt = Fp8Operand(kept, kept_scales, False)
            dw = weight_gradient(dytq, xt, weight.dtype)
        db = dy2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def fp8_forward_impl(layer, input, weight, bias=None, gradient_accumulation_fusion: bool = False,
                     allreduce_dgrad: bool = False, sequence_parallel: bool = False, grad_output_buffer=None,
                     wgrad_deferral_limit: Optional[int] = None, tp_group=None, gtp_remat_size: int = 1):  # fmt: skip
    """A Megatron parallel linear's ``_forward_impl`` for an NVFP4 weight in the FP8 compute mode."""
    if gradient_accumulation_fusion:
        _refuse(weight, "gradient-accumulation fusion (its kernel writes main_grad): add "
                        "--no-gradient-accumulation-fusion")
    if grad_output_buffer is not None:
        _refuse(weight, "deferred embedding weight gradients: drop --defer-embedding-wgrad-compute")
    if gtp_remat_size > 1:
        _refuse(weight, "weights sharded for rematerialization (gtp_remat_size > 1): drop "
                        "--tensor-parallel-num-weight-shards")
    if (allreduce_dgrad or sequence_parallel) and tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    operand = fp8_copy.weight_operand(layer, weight)
    return Fp8ParallelLinear.apply(input, weight, bias, operand, bool(allreduce_dgrad), bool(sequence_parallel),
                                   tp_group)  # fmt: skip


def _refuse(weight, what: str) -> None:
    raise RuntimeError(f"fp4_dist.megatron: the FP8 compute mode ({FP8_FLAGS}) does not take {what} "
                       f"(NVFP4 weight {weight_name(weight)})")
