"""The FP8 compute mode's linear layer: what Hopper's block-scaled FP8 GEMMs read and compute (docs/fp8.md).

Per linear, with W the NVFP4 weight [N, K]:

    forward   y  = x @ W^T       x: 1 x 128 groups along K;  W: its FP8 block copy (128 x 128)
    dgrad     dx = dy @ W        dy: 1 x 128 groups along N;  W's copy, transposed (the blocks are symmetric)
    wgrad     dW = dy^T @ x      dy and x: 1 x 128 groups along the tokens; fp32 result

x is quantized both ways from one read in the forward (`Fp8Operand.both`), and its transpose is what the layer keeps
for the backward: 1 byte per element instead of the input's 2. dy likewise, both ways at once, in the backward.

The GEMMs are `fp8_gemm.fp8_mm`: cuBLAS on Hopper, and on the CPU an emulation that sums each 128-group of the
contraction in fp32 and scales the partial sum by both operands' scales of the group, as cuBLAS does, in another
order of additions. Outputs are the input's dtype (bf16), the weight gradient fp32 then the weight's dtype.
Attention, norms, embeddings and whatever is not an NVFP4 linear stay in bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tensor import NVFP4Tensor
from .fp8_gemm import Fp8Operand, fp8_mm
from .lean import raise_changed, stamp

__all__ = ["Fp8Operand", "Fp8BlockLinear", "fp8_linear", "output", "saved_weight", "weight_from_saved",
           "weight_gradient"]


class Fp8BlockLinear(torch.autograd.Function):
    """y = x @ W^T + bias with FP8 block-scaled GEMMs (module docstring); W an NVFP4 weight and `operand` its FP8
    block copy (made here when None). The backward reads the same copy; it raises if the weight's bytes changed
    since the forward, as autograd does for a parameter changed in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, bias: Optional[torch.Tensor], operand: Optional[Fp8Operand] = None):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        w = operand if operand is not None else Fp8Operand.weight(weight)
        if ctx.needs_input_grad[1]:  # the weight gradient's operand too, from the same read: kept in FP8
            xq, xtq = Fp8Operand.both(x2)
        else:
            xq, xtq = Fp8Operand.rows(x2), Fp8Operand(x2.new_empty(0, dtype=torch.uint8), x2.new_empty(0), False)
        y = fp8_mm(xq, w, x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xtq.bits, xtq.scales, *saved_weight(w))
        ctx.has_bias, ctx.weight, ctx.stamp = bias is not None, weight, _stamp(weight)
        return output(y, x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xt_bits, xt_scales, *kept_weight = ctx.saved_tensors
        weight = ctx.weight
        if _stamp(weight) != ctx.stamp:
            raise_changed(weight)
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = weight_from_saved(kept_weight)
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if want_dx and want_dw:
            dyq, dytq = Fp8Operand.both(dy2)
        else:
            dyq = Fp8Operand.rows(dy2) if want_dx else None
            dytq = Fp8Operand.rows(dy2.t()) if want_dw else None
        dx = fp8_mm(dyq, w.t(), dy.dtype) if want_dx else None
        dw = weight_gradient(dytq, Fp8Operand(xt_bits, xt_scales, False), weight.dtype) if want_dw else None
        db = dy2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dx.view(*dy.shape[:-1], dx.shape[-1]) if dx is not None else None), dw, db, None


def saved_weight(w: Fp8Operand) -> tuple:
    """What a linear's forward saves of its weight's FP8 block copy for the backward (`save_for_backward` takes
    tensors or None): the copy and its scales, in both layouts."""
    return w.bits, w.scales, w.cublas_scales, w.cublas_scales_t


def weight_from_saved(saved) -> Fp8Operand:
    """The block operand `saved_weight` saved."""
    bits, scales, cublas_scales, cublas_scales_t = saved
    return Fp8Operand(bits, scales, True, cublas_scales, cublas_scales_t)


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
    """What must not change between the forward and the backward of an NVFP4 weight (`lean.stamp`); None for an
    inference tensor (no version counter, and no backward either) and for a weight that is not NVFP4 (FSDP2's
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
    return Fp8BlockLinear.apply(x, weight, bias, operand)
