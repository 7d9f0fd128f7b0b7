"""fp4_dist: NVFP4 weights for ZeRO / Megatron-Core training, with a 4-bit parameter all-gather.

Public API (everything else is internal and may change)::

    format      NVFP4Tensor, quantize, is_nvfp4_tensor, convert_linear_weights
    compute     NVFP4Linear (fp4_dist.compute_view: a layer's cached alias of its weight's compute copy)
    zero        cast_master_weights_to_nvfp4 (= quantize_master_weights), post_all_gather_processing
    export      fp4_dist.export: export_compressed_tensors, load_compressed_tensors, VLLM_FUSED (imported on use:
                it needs safetensors)
"""

from . import launch  # noqa: F401 - first, so that a process group made after `import fp4_dist` can be freed
from .compute_view import NVFP4Linear
from .convert import ConversionReport, convert_linear_weights
from .optim import cast_master_weights_to_nvfp4, post_all_gather_processing, quantize_master_weights
from .quantize import quantize
from .tensor import NVFP4Tensor, is_nvfp4_tensor

__all__ = [
    # format and single-tensor quantization
    "NVFP4Tensor",
    "quantize",
    "is_nvfp4_tensor",
    "convert_linear_weights",
    "ConversionReport",
    # computing with NVFP4 weights
    "NVFP4Linear",
    # ZeRO partial cast (TransformerEngine's quantize_master_weights signature)
    "cast_master_weights_to_nvfp4",
    "quantize_master_weights",
    "post_all_gather_processing",
]

__version__ = "0.1.0"
