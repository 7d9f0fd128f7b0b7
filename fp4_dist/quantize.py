"""Whole-tensor quantization: the ZeRO stages run on one shard that covers the whole weight.

Quantizing W in one piece and casting it shard by shard are the same code path (amax -> scales -> cast), so
"distributed == whole" reduces to the shard bookkeeping being right.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import kernels
from .format import check_numerics, check_weight_shape, rowwise_data_shape, rowwise_scale_shape
from .kernels.validate import ROUND_TO_DTYPES
from .tensor import NVFP4Tensor


def _check_input(x, name: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(x, NVFP4Tensor):
        raise TypeError(f"{name} is already an NVFP4Tensor; dequantize() it first if you mean to re-quantize")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise TypeError(f"{name}: NVFP4 quantizes fp32/bf16/fp16 values, got dtype {x.dtype}")
    return check_weight_shape(x.shape, name)


def _default_model_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _amax_stage(flat: torch.Tensor, shape, round_to: torch.dtype, name: str) -> torch.Tensor:
    amaxes = kernels.partial_amax([flat], [0], [shape], round_to=round_to)
    if not torch.isfinite(amaxes[0]).item():  # the amax maps NaN to inf, so one scalar read covers both
        raise ValueError(
            f"{name} holds non-finite values (inf or NaN); NVFP4 cannot encode them. Nothing was written"
        )
    return amaxes


def quantize(
    x: torch.Tensor, numerics: str = "te", dtype: Optional[torch.dtype] = None, *, name: str = "input"
) -> NVFP4Tensor:
    """Quantize a 2D tensor [M, K] (K % 16 == 0) on any device to an NVFP4Tensor, bit-exact to the spec.

    Args:
        x: fp32, bf16 or fp16 values.
        numerics: "te" (TransformerEngine main) or "te-2.14" (its older block-scale formula).
        dtype: model dtype the result reports and the values are rounded to first; default bf16 (fp16 for an
            fp16 input). Pass torch.float32 to quantize fp32 values without the bf16 rounding.
    Returns:
        NVFP4Tensor with rowwise fields set (call `make_columnwise()` for the transposed copy).
    """
    check_numerics(numerics)
    m, k = _check_input(x, name)
    dtype = dtype or _default_model_dtype(x)
    if dtype not in ROUND_TO_DTYPES:
        raise TypeError(f"dtype must be one of {ROUND_TO_DTYPES}, got {dtype}")
    flat = _flat_source(x)
    amaxes = _amax_stage(flat, (m, k), dtype, name)
    out = NVFP4Tensor(
        (m, k),
        dtype,
        torch.zeros(rowwise_data_shape(m, k), dtype=torch.uint8, device=x.device),
        torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=x.device),
        torch.empty(1, dtype=torch.float32, device=x.device),
        numerics=numerics,
    )
    _scale_and_cast(flat, amaxes, out)
    return out


def quantize_into(src: torch.Tensor, dst: NVFP4Tensor) -> None:
    """Re-quantize `src` into `dst`'s existing buffers (storage kept); rebuild its columnwise copy if present."""
    m, k = _check_input(src, "source")
    if (m, k) != tuple(dst.shape):
        raise ValueError(f"cannot quantize a {[m, k]} tensor into an NVFP4Tensor of shape {list(dst.shape)}")
    if src.device != dst.rowwise_data.device:
        raise ValueError(f"source is on {src.device} but the NVFP4Tensor is on {dst.rowwise_data.device}")
    flat = _flat_source(src)
    amaxes = _amax_stage(flat, (m, k), dst.dtype, "source")
    _scale_and_cast(flat, amaxes, dst)
    if dst.columnwise_data is not None:
        dst.make_columnwise()


def _flat_source(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()  # fp16 -> fp32 is exact; the stages read fp32 or bf16
    return x.detach().reshape(-1).contiguous()


def _scale_and_cast(flat: torch.Tensor, amaxes: torch.Tensor, out: NVFP4Tensor) -> None:
    shape = tuple(out.shape)
    enc = kernels.fused_scale(amaxes, [shape], [out.rowwise_scale_inv], [out.amax], numerics=out.numerics)
    kernels.partial_cast([flat], [0], [shape], enc, [out.rowwise_data.view(-1)], round_to=out.dtype)
