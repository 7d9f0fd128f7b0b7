"""The FP8 compute mode's linear layer, emulated: what Hopper's block-scaled FP8 GEMMs read and compute, multiplied in
fp32 (the CPU path, and the reference of the GPU path to come; docs/fp8.md).

Per linear, with W the NVFP4 weight [N, K]:

    forward   y  = x @ W^T       x: 1 x 128 groups along K;  W: its FP8 block copy (128 x 128)
    dgrad     dx = dy @ W        dy: 1 x 128 groups along N;  W's copy, transposed (the blocks are symmetric)
    wgrad     dW = dy^T @ x      dy and x: 1 x 128 groups along the tokens; fp32 result

A block-scaled GEMM sums, for each 128-group of the contraction dimension, the product of the E4M3 values in fp32
and multiplies that partial sum by the two operands' scales of the group; `block_scaled_mm` does the same in
torch's fp32 matmul, group by group in order, so it differs from cuBLAS only in the order of additions. Outputs
are the input's dtype (bf16), the weight gradient fp32 then the weight's dtype. Attention, norms, embeddings and
whatever is not an NVFP4 linear stay in bf16.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..format import FP8_BLOCK, ceil_div
from ..kernels.fp8_block_reference import fp8_block_copy
from ..kernels.fp8_rows_reference import quantize_rows_1x128

__all__ = ["Fp8Operand", "block_scaled_mm", "Fp8BlockLinear", "fp8_linear"]


class Fp8Operand(NamedTuple):
    """One GEMM operand [rows, K] as the block-scaled GEMM reads it: E4M3 bits (uint8) and fp32 scales, either one
    per 1 x 128 group ([rows, ceil(K/128)]) or one per 128 x 128 block ([ceil(rows/128), ceil(K/128)])."""

    bits: torch.Tensor
    scales: torch.Tensor
    blocks: bool

    @classmethod
    def rows(cls, x: torch.Tensor) -> "Fp8Operand":
        """x [rows, K] quantized in 1 x 128 groups along K."""
        return cls(*quantize_rows_1x128(x), blocks=False)

    @classmethod
    def weight(cls, w) -> "Fp8Operand":
        """NVFP4 weight `w` [N, K] as its FP8 block copy."""
        return cls(*fp8_block_copy(w.rowwise_data, w.rowwise_scale_inv, w.amax), blocks=True)

    def t(self) -> "Fp8Operand":
        """The transposed operand: only a 128 x 128 block copy transposes without requantizing."""
        if not self.blocks:
            raise ValueError("a 1 x 128 operand does not transpose: quantize the transposed tensor instead")
        return Fp8Operand(self.bits.t(), self.scales.t(), blocks=True)

    def group_scales(self, j: int) -> torch.Tensor:
        """fp32 [rows]: each row's scale for the contraction group j."""
        column = self.scales[:, j]
        return column.repeat_interleave(FP8_BLOCK)[: self.bits.shape[0]] if self.blocks else column


def block_scaled_mm(a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """fp32 [rows of a, rows of b] = a @ b^T over their common K, group by group (module docstring)."""
    k = a.bits.shape[1]
    if b.bits.shape[1] != k:
        raise ValueError(f"block_scaled_mm: the operands' K differ ({k} and {b.bits.shape[1]})")
    out = torch.zeros(a.bits.shape[0], b.bits.shape[0], dtype=torch.float32, device=a.bits.device)
    ea = a.bits.view(torch.float8_e4m3fn).to(torch.float32)
    eb = b.bits.view(torch.float8_e4m3fn).to(torch.float32)
    for j in range(ceil_div(k, FP8_BLOCK)):
        cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
        partial = ea[:, cols] @ eb[:, cols].t()
        out += partial * a.group_scales(j)[:, None] * b.group_scales(j)[None, :]
    return out


class Fp8BlockLinear(torch.autograd.Function):
    """y = x @ W^T + bias with FP8 block-scaled GEMMs (module docstring); W an NVFP4 weight, whose FP8 copy is made
    at the forward and kept for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, bias: Optional[torch.Tensor]):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        w = Fp8Operand.weight(weight)
        y = block_scaled_mm(Fp8Operand.rows(x2), w).to(x.dtype)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2, w.bits, w.scales)
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w_bits, w_scales = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = Fp8Operand(w_bits, w_scales, blocks=True)
        dx = block_scaled_mm(Fp8Operand.rows(dy2), w.t()).to(dy.dtype)
        dw = block_scaled_mm(Fp8Operand.rows(dy2.t()), Fp8Operand.rows(x2.t())).to(ctx.weight_dtype)
        db = dy2.sum(dim=0) if ctx.has_bias else None
        return dx.view(*dy.shape[:-1], -1), dw, db


def fp8_linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the FP8 block-scaled GEMMs, for an NVFP4 weight (emulated: any device)."""
    return Fp8BlockLinear.apply(x, weight, bias)
