"""The FP8 compute mode's linear as one autograd function: what Hopper's block-scaled FP8 GEMMs read and compute
(docs/fp8.md), with a Megatron parallel linear's tensor-parallel communication around them when asked.

Per linear, with W the NVFP4 weight [N, K]:

    forward   y  = x @ W^T       x: 1 x 128 groups along K;  W: its FP8 block copy (128 x 128)
    dgrad     dx = dy @ W        dy: 1 x 128 groups along N;  W's copy, transposed (the blocks are symmetric)
    wgrad     dW = dy^T @ x      dy and x: 1 x 128 groups along the tokens; fp32 result

x is quantized both ways from one read in the forward (`Fp8Operand.both`), and its transpose is what the layer keeps
for the backward: 1 byte per element instead of the input's 2. dy likewise, both ways at once, in the backward.

Tensor parallelism (Megatron's column- and row-parallel linears, `fp4_dist.megatron.mode_linear`): with sequence
parallelism the input is all-gathered along the sequence first, and the local input is kept for the backward and
gathered again there, as Megatron does; dx is all-reduced over the tensor-parallel group (column-parallel layers)
or reduce-scattered along the sequence. The communication is synchronous.

The GEMMs are `fp8_gemm.fp8_mm`: cuBLAS on Hopper, and on the CPU an emulation that sums each 128-group of the
contraction in fp32 and scales the partial sum by both operands' scales of the group, as cuBLAS does, in another
order of additions. Outputs are the input's dtype (bf16), the weight gradient fp32 then the weight's dtype.
Attention, norms, embeddings and whatever is not an NVFP4 linear stay in bf16.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..tensor import NVFP4Tensor
from ..tensor.copy import raise_changed, stamp
from .fp8_gemm import Fp8Operand, fp8_mm

__all__ = ["Fp8Operand", "Fp8Linear", "fp8_linear", "output", "saved_weight", "weight_from_saved",
           "weight_gradient"]


class Fp8Linear(torch.autograd.Function):
    """y = x @ W^T + bias with FP8 block-scaled GEMMs (module docstring); W an NVFP4 weight (or FSDP2's unsharded
    `Fp8Param`) and `operand` its FP8 block copy (made here when None). The backward reads the same copy; it raises
    if the weight's bytes changed since the forward, as autograd does for a parameter changed in place.
    `allreduce_dgrad`, `sequence_parallel`, `tp_group`: a Megatron parallel linear's communication."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, bias: Optional[torch.Tensor], operand: Optional[Fp8Operand] = None,
                allreduce_dgrad: bool = False, sequence_parallel: bool = False, tp_group=None):  # fmt: skip
        total = _gather_sequence(x, tp_group) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        w = operand if operand is not None else Fp8Operand.weight(weight)
        wgrad = ctx.needs_input_grad[1]
        if wgrad and not sequence_parallel:  # the weight gradient's operand too, from the same read: kept in FP8
            xq, xtq = Fp8Operand.both(x2)
            kept = (xtq.bits, xtq.scales)
        else:  # with sequence parallelism the local input is kept, as Megatron keeps it, and gathered again
            xq, nothing = Fp8Operand.rows(x2), x2.new_empty(0)
            kept = (x if wgrad else nothing, nothing)
        y = fp8_mm(xq, w, x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(*kept, *saved_weight(w))
        ctx.has_bias, ctx.weight, ctx.stamp = bias is not None, weight, _stamp(weight)
        ctx.comm = (allreduce_dgrad, sequence_parallel, tp_group)
        return output(y, total.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        kept, kept_scales, *kept_weight = ctx.saved_tensors
        weight = ctx.weight
        if _stamp(weight) != ctx.stamp:
            raise_changed(weight)
        allreduce_dgrad, sequence_parallel, tp_group = ctx.comm
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = weight_from_saved(kept_weight)
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if want_dx and want_dw:
            dyq, dytq = Fp8Operand.both(dy2)
        else:
            dyq = Fp8Operand.rows(dy2) if want_dx else None
            dytq = Fp8Operand.rows(dy2.t()) if want_dw else None
        dx = None
        if want_dx:
            dx = fp8_mm(dyq, w.t(), dy.dtype)
            dx = dx.view(*dy.shape[:-1], dx.shape[-1])  # sizes spelled out: an expert may get no tokens
            if sequence_parallel:
                dx = _reduce_scatter_sequence(dx, tp_group)
            elif allreduce_dgrad:
                dist.all_reduce(dx, group=tp_group)
        dw = None
        if want_dw:
            if sequence_parallel:  # the local input, gathered again
                rows = dy2.shape[0]
                xt = Fp8Operand.rows(_gather_sequence(kept, tp_group).reshape(rows, kept.shape[-1]).t())
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


def saved_weight(w: Fp8Operand) -> tuple:
    """What a linear's forward saves of its weight's FP8 block copy for the backward (`save_for_backward` takes
    tensors or None): the copy and its scales, in both layouts, and its transpose where it has one."""
    return w.bits, w.scales, w.cublas_scales, w.cublas_scales_t, w.bits_t


def weight_from_saved(saved) -> Fp8Operand:
    """The block operand `saved_weight` saved."""
    bits, scales, cublas_scales, cublas_scales_t, bits_t = saved
    return Fp8Operand(bits, scales, True, cublas_scales, cublas_scales_t, bits_t)


def output(y: torch.Tensor, input_shape) -> torch.Tensor:
    """The GEMM's result y [tokens, N] as a linear's output for an input of `input_shape` ([..., K]), a tensor that
    autograd does not take for a view of y (``aten._unsafe_view``, as ``torch.matmul`` returns its products): a view
    of a tensor made inside an autograd Function may not be modified in place, and callers do so (Megatron's MoE
    experts add their bias to their linear's output). y is a slice of cuBLAS's padded result where tokens were
    padded."""
    return torch.ops.aten._unsafe_view(y, (*input_shape[:-1], y.shape[-1]))


def weight_gradient(dyt: Fp8Operand, xt: Fp8Operand, dtype: torch.dtype) -> torch.Tensor:
    """dW = dy^T @ x from the output gradients' and the inputs' transposes, dy^T [N, T] and x^T [K, T], quantized in
    1 x 128 groups along the tokens: fp32 sums rounded once to `dtype`, straight out of the GEMM for bf16 and fp32."""
    out = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    dw = fp8_mm(dyt, xt, out)
    return dw if out == dtype else dw.to(dtype)


def _stamp(w) -> Optional[tuple]:
    """What must not change between the forward and the backward of an NVFP4 weight (`tensor.copy.stamp`); None for
    an inference tensor (no version counter, and no backward either) and for a weight that is not NVFP4 (FSDP2's
    unsharded `Fp8Param`, which FSDP2 writes again, with the same values, when it gathers for the backward)."""
    if type(w) is not NVFP4Tensor:
        return None
    try:
        return stamp(w)
    except RuntimeError:
        return None


def fp8_linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None,
               operand: Optional[Fp8Operand] = None) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight, bias)` with the FP8 block-scaled GEMMs, for an NVFP4 weight; `operand`: its FP8 block
    copy where the caller keeps one (`fp8_copy.weight_operand`). cuBLAS on Hopper, emulated on the CPU."""
    return Fp8Linear.apply(x, weight, bias, operand)
