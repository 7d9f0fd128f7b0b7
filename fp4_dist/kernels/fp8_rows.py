"""The CUDA 1 x 128 FP8 quantization of activations and gradients (`cuda/fp8_rows.cu`): the bits and scales of
`fp8_rows_reference.quantize_rows_1x128`, in one launch per tensor. The FP8 compute mode uses it on a GPU where it
gave the reference's bits (`fp4_dist.compute.fp8_gemm.require_fp8_gemm` checks, once per device)."""

from __future__ import annotations

import torch

from ..format import FP8_BLOCK, ceil_div
from . import _launch, outputs

__all__ = ["quantize_rows_1x128", "quantize_both"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_rows_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bits, uint8 [R, C]; scales, fp32 [R, ceil(C/128)], outer-dim-major) of the CUDA tensor x [R, C] (any
    strides: the transpose of a row-major tensor is read in place), on torch's current stream, by the kernel `path`
    picks."""
    if not x.is_cuda or x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"fp8_rows.quantize_rows_1x128: x must be a 2D CUDA tensor of {DTYPES}, got "
                         f"{x.dtype} {list(x.shape)} on {x.device}")  # fmt: skip
    rows, cols = x.shape
    bits = outputs.empty(rows, cols, dtype=torch.uint8, device=x.device)
    scales = scales_buffer(rows, cols, x.device)
    if x.numel():
        LAUNCHERS[path(x)](x, bits, scales)
    return bits, scales


def quantize_both(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(`quantize_rows_1x128(x)`, `quantize_rows_1x128(x.t())`) of the CUDA tensor x [R, C], the same bits: for a
    bf16 or fp16 x with unit column stride in one read of x (one launch), else by the two calls."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1):
        return quantize_rows_1x128(x), quantize_rows_1x128(x.t())
    rows, cols = x.shape
    bits = outputs.empty(rows, cols, dtype=torch.uint8, device=x.device)
    bits_t = outputs.empty(cols, rows, dtype=torch.uint8, device=x.device)
    scales, scales_t = scales_buffer(rows, cols, x.device), scales_buffer(cols, rows, x.device)
    if x.numel():
        _launch.launch_both_1x128(x, bits, scales, bits_t, scales_t)
    return (bits, scales), (bits_t, scales_t)


def scales_buffer(rows: int, cols: int, device) -> torch.Tensor:
    """fp32 [rows, ceil(cols/128)] for the kernels' scales, outer-dim-major (strides (1, rows)): the layout
    cuBLAS's 1 x 128 recipe reads, so the GEMM takes them as they are."""
    return outputs.empty(ceil_div(cols, FP8_BLOCK), rows, dtype=torch.float32, device=device).t()


def _launch_transposed(x: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor) -> None:
    _launch.launch_cols_1x128(x.t(), bits, scales)


LAUNCHERS = {"rows": _launch.launch_rows_1x128_vec, "transposed": _launch_transposed,
             "strided": _launch.launch_rows_1x128}  # fmt: skip


def path(x: torch.Tensor) -> str:
    """Which kernel quantizes x [R, C]: "rows" (row-major, 16-element aligned: 16-byte loads and stores),
    "transposed" (the transpose of a row-major tensor, the weight gradient's operands: staged through shared
    memory so that both its reads and its writes are coalesced), else "strided" (any strides, one warp per group)."""
    rows, cols = x.shape
    aligned = x.data_ptr() % 16 == 0
    if x.stride(1) == 1 and cols % 16 == 0 and (x.stride(0) % 16 == 0 or rows == 1) and aligned:
        return "rows"
    if x.stride(0) == 1 and cols > 1:
        return "transposed"
    return "strided"
