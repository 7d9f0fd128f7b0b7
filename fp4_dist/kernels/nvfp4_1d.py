"""The CUDA NVFP4 1 x 16 quantization of activations and gradients and the unscaled values the emulated GEMM reads
(`cuda/nvfp4_1d.cu`): the bits of `nvfp4_1d_reference`, function for function, with the same signatures.

Each quantization is two launches on torch's current stream (no host sync: the amax stays on the device): the
tensor amax (after the transform, for a transformed operand) into a zeroed fp32 [1], then the codes and scales.
A wgrad operand, pad16(t)^T of t [T, C] through the transform, is read in place through strides: neither the
transpose nor the padding nor the transformed values are materialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..format import ceil_div
from . import _launch, outputs
from .nvfp4_1d_reference import BLOCK, SEED_BOUND, Nvfp4Rows, draw_seed

__all__ = ["quantize_rows_1x16", "quantize_rows_1x16_sr", "quantize_cols_1x16", "quantize_cols_1x16_sr",
           "unscaled_values", "Operand"]  # fmt: skip

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# flags of the kernels (cuda/nvfp4_1d.cu: kFlagQFast, kFlagRht, kFlagSr)
Q_FAST, RHT, SR = 1, 2, 4


@dataclass(frozen=True)
class Operand:
    """The tensor a kernel quantizes, Q [rows, out_cols], as a strided view of `src`: Q[q, j] = src[q * s_q + j * s_j]
    (elements) for j < length, zero for length <= j < out_cols."""

    src: torch.Tensor
    rows: int
    length: int
    out_cols: int
    s_q: int
    s_j: int
    q_fast: bool
    """Consecutive threads take consecutive rows of Q (the columns of a row-major t: coalesced reads)."""


def rows_operand(x: torch.Tensor) -> Operand:
    """x [R, C] itself (any strides)."""
    _check(x, "x")
    return Operand(x, x.shape[0], x.shape[1], x.shape[1], x.stride(0), x.stride(1), q_fast=False)


def cols_operand(t: torch.Tensor) -> Operand:
    """pad16(t)^T [C, T16] of t [T, C] (any strides), the tokens zero-padded to a multiple of 16."""
    _check(t, "t")
    tokens, cols = t.shape
    return Operand(t, cols, tokens, ceil_div(tokens, BLOCK) * BLOCK, t.stride(1), t.stride(0), q_fast=True)


def _check(x: torch.Tensor, name: str) -> None:
    if not x.is_cuda or x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"nvfp4_1d: {name} must be a 2D CUDA tensor of {DTYPES}, got {x.dtype} {list(x.shape)} "
                         f"on {x.device}")  # fmt: skip


def _quantize(op: Operand, flags: int, seed: int, amax: Optional[torch.Tensor]) -> Nvfp4Rows:
    """Codes, scales and amax of `op` (amax: the given one, else max|Q| by the amax kernel)."""
    if not 0 <= seed < SEED_BOUND:
        raise ValueError(f"nvfp4_1d: stochastic rounding seed must be in [0, 2^63), got {seed}")
    if flags & RHT and op.out_cols % BLOCK:
        raise ValueError(f"nvfp4_1d: the transform needs whole 16-element groups, got {op.out_cols} columns")
    flags |= Q_FAST if op.q_fast else 0
    device = op.src.device
    empty = op.rows * op.out_cols == 0
    if amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device=device)
        if not empty:
            _launch.launch_amax_1x16(op, flags & ~SR, amax)
    elif empty:  # the reference's amax of an empty tensor, whatever was given
        amax = torch.zeros(1, dtype=torch.float32, device=device)
    else:
        amax = amax.reshape(1).to(device=device, dtype=torch.float32)
    data = outputs.empty(op.rows, ceil_div(op.out_cols, 2), dtype=torch.uint8, device=device)
    scales = outputs.empty(op.rows, ceil_div(op.out_cols, BLOCK), dtype=torch.uint8, device=device)
    if not empty:
        _launch.launch_quantize_1x16(op, flags, seed, amax, data, scales)
    return Nvfp4Rows(data, scales, amax, op.out_cols)


def quantize_rows_1x16(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Nvfp4Rows:
    """`nvfp4_1d_reference.quantize_rows_1x16` of the CUDA tensor x [R, C]."""
    return _quantize(rows_operand(x), 0, 0, amax)


def quantize_rows_1x16_sr(x: torch.Tensor, seed: Optional[int] = None,
                          amax: Optional[torch.Tensor] = None) -> Nvfp4Rows:  # fmt: skip
    """`nvfp4_1d_reference.quantize_rows_1x16_sr` of the CUDA tensor x [R, C]: the same bits for the same seed."""
    return _quantize(rows_operand(x), SR, draw_seed() if seed is None else seed, amax)


def quantize_cols_1x16(t: torch.Tensor, rht: bool) -> Nvfp4Rows:
    """`nvfp4_1d_reference.quantize_cols_1x16` of the CUDA tensor t [T, C]: the wgrad operand, read in place."""
    return _quantize(cols_operand(t), RHT if rht else 0, 0, None)


def quantize_cols_1x16_sr(t: torch.Tensor, rht: bool, seed: Optional[int] = None) -> Nvfp4Rows:
    """`nvfp4_1d_reference.quantize_cols_1x16_sr` of the CUDA tensor t [T, C]."""
    return _quantize(cols_operand(t), (RHT if rht else 0) | SR, draw_seed() if seed is None else seed, None)


def unscaled_values(q: Nvfp4Rows) -> torch.Tensor:
    """bf16 [rows, cols]: e2m1(code) * float(block scale) of q's codes on its CUDA device, in one launch: each value
    exact in bf16 (`compute.nvfp4_gemm.check_bf16_exact` checks every code and scale), equal to
    `nvfp4_1d_reference.unscaled_values` (fp32) rounded to bf16, which changes nothing."""
    rows = q.data.shape[0]
    if q.data.stride(-1) != 1 or q.scales.stride(-1) != 1:
        raise ValueError("nvfp4_1d.unscaled_values: data and scales need unit column stride")
    out = outputs.empty(rows, q.cols, dtype=torch.bfloat16, device=q.data.device)
    if rows * q.cols:
        _launch.launch_unscaled_bf16(q.data, q.scales, rows, q.cols, out)
    return out
