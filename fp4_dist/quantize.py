"""Whole-tensor quantization: `quantize(x)` -> NVFP4Tensor (the ZeRO stages on one shard covering the weight)."""

from __future__ import annotations

from typing import Optional

import torch

from .format import DEFAULT_NUMERICS, check_numerics, rowwise_data_shape, rowwise_scale_shape
from .kernels import checks, quantize_rowwise
from .format import MODEL_DTYPES
from .tensor import NVFP4Tensor


def quantize(
    x: torch.Tensor, numerics: str = DEFAULT_NUMERICS, dtype: Optional[torch.dtype] = None, *, name: str = "input",
    amax: Optional[torch.Tensor] = None,
) -> NVFP4Tensor:
    """Quantize a 2D tensor [M, K] (K % 16 == 0) on any device to an NVFP4Tensor, bit-exact to the spec.

    Args:
        x: fp32, bf16 or fp16 values.
        numerics: "te" (TransformerEngine main) or "te-2.14" (its older block-scale formula).
        dtype: model dtype the result reports and the values are rounded to first; default bf16 (fp16 for an
            fp16 input). Pass torch.float32 to quantize fp32 values without the bf16 rounding.
        name: what errors call `x`.
        amax: fp32 [1], an amax this weight shares with others (`fp4_dist.shared_amax`); the tensor amax is the
            larger of it and max|x|. None: max|x|.
    Returns:
        NVFP4Tensor with rowwise fields set (call `make_columnwise()` for the transposed copy).
    Raises ValueError naming `name` if `x` holds inf or NaN.
    """
    check_numerics(numerics)
    flat, (m, k) = checks.quantize_source(x, name)
    dtype = dtype or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    data = torch.zeros(rowwise_data_shape(m, k), dtype=torch.uint8, device=x.device)
    scale_inv = torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=x.device)
    out_amax = torch.empty(1, dtype=torch.float32, device=x.device)
    quantize_rowwise(flat, (m, k), round_to=dtype, numerics=numerics, rowwise_data=data, scale_inv=scale_inv,
                     amax=out_amax, name=name, shared_amax=amax)  # fmt: skip
    return NVFP4Tensor((m, k), dtype, data, scale_inv, out_amax, numerics=numerics)
