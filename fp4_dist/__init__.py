"""fp4_dist: NVFP4 weights for ZeRO / Megatron-Core training, with a 4-bit parameter all-gather.

Public API (everything else is internal and may change)::

    format      NVFP4Tensor, quantize, is_nvfp4_tensor, convert_linear_weights
"""

from .convert import ConversionReport, convert_linear_weights
from .quantize import quantize
from .tensor import NVFP4Tensor, is_nvfp4_tensor

__all__ = [
    # format and single-tensor quantization
    "NVFP4Tensor",
    "quantize",
    "is_nvfp4_tensor",
    "convert_linear_weights",
    "ConversionReport",
]

__version__ = "0.1.0"
