"""Activations and gradients as FP8 E4M3 with one scale per 1 x 128 group, in plain PyTorch: the CPU path and the
oracle of a kernel to come (docs/fp8.md).

A row of x [R, C] is cut into groups of 128 along C (the last one ragged); each group g gets a power-of-two scale,
as TransformerEngine's Float8BlockScaling recipe gives by default:

    a_g   = max |x| over the group (fp32 of the model-dtype values)
    k_g   = the smallest integer with a_g <= 448 * 2^k_g (0 for an all-zero group; at least -126, fp32's normal range)
    e     = E4M3(x * 2^-k_g), round to nearest even (the product is exact: a power of two)
    scale = 2^k_g (fp32)

Each element is then rounded once, so any device gets the same bits. A group holding inf or NaN gets a NaN scale:
the GEMM's output is not finite, as a bf16 GEMM's would not be (no group hides one). For the weight gradient the
operands are grouped along the tokens: quantize the transposes (`x.t()`, `dy.t()`).
"""

from __future__ import annotations

import torch

from ..format import FP8_BLOCK, ceil_div
from .fp8_block_reference import pow2, smallest_shift
from .reference import e4m3_rne_satfinite


def quantize_rows_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bits, uint8 [R, C]; scales, fp32 [R, ceil(C/128)]) of x [R, C] (module docstring): value[r, c] =
    float(e[r, c]) * scales[r, c // 128]."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_1x128: x must be 2D [rows, columns], got shape {list(x.shape)}")
    r, c = x.shape
    groups = ceil_div(c, FP8_BLOCK)
    values = x.to(torch.float32)
    padded = values.new_zeros(r, groups * FP8_BLOCK)
    padded[:, :c] = values
    amax = padded.view(r, groups, FP8_BLOCK).abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    safe = torch.where(finite, amax, torch.zeros_like(amax))
    shift = smallest_shift(safe).clamp(min=-126)
    per_element = shift.repeat_interleave(FP8_BLOCK, dim=1)[:, :c]
    bits = e4m3_rne_satfinite((values * pow2(-per_element)).abs()) | ((values < 0).to(torch.uint8) << 7)
    scales = torch.where(finite, pow2(shift), torch.full_like(amax, float("nan")))
    return bits, scales


def rows_1x128_values(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [R, C] values of a 1 x 128 quantized tensor."""
    per_element = scales.repeat_interleave(FP8_BLOCK, dim=1)[:, : bits.shape[1]]
    return bits.view(torch.float8_e4m3fn).to(torch.float32) * per_element
