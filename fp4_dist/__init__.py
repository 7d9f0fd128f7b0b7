"""fp4_dist: NVFP4 weights for ZeRO, FSDP2 and Megatron-Core training, all-gathered in 4 bits.

Entry points (everything else is internal and may change)::

    one tensor      NVFP4Tensor, quantize, is_nvfp4_tensor
    a model         convert_linear_weights (-> ConversionReport), NVFP4Linear
    ZeRO cast       cast_master_weights_to_nvfp4 (= quantize_master_weights), post_all_gather_processing:
                    TransformerEngine's signature and semantics (fp4_dist.cast)
    ZeRO-1          Zero1Optimizer, Zero1Config (fp4_dist.optim; checkpoints: fp4_dist.optim.load_checkpoint)
    FSDP2           fully_shard_nvfp4 (fp4_dist.fsdp)
    Megatron-Core   python -m fp4_dist.megatron.run <script> ... --fp4-param-gather, or fp4_dist.megatron.enable()
    export          export_compressed_tensors, load_compressed_tensors, VLLM_FUSED (fp4_dist.export; loaded on first
                    use: it needs safetensors)
    processes       fp4_dist.launch.init_distributed / shutdown (torchrun, mpirun or a single process)

The numeric contract is the spec (docs/); `format.DEFAULT_NUMERICS` is the block-scale formula used unless told.

Modules of the root (each subpackage's docstring maps its own files)::

    format.py       the format in numbers: constants, dtypes, shape arithmetic, byte rules
    quantize.py     quantize(x): a whole tensor to an NVFP4Tensor
    convert.py      convert_linear_weights: a model's nn.Linear weights swapped for NVFP4 parameters
    shared_amax.py  weights that share one amax (vLLM's fused layers), honoured by every cast
    launch.py       init_distributed / shutdown, from torchrun, mpirun or nothing
    compare.py      byte comparison that says where (the run-time parity checks and the tests)
    testing.py      pytest-free helpers for bitwise tests
    _user.py        where the user's code is on the stack (warnings point at the user's line)
    _moved.py       the entry points that moved out of the package with the examples
"""

from __future__ import annotations

import importlib

from . import launch  # noqa: F401 - first, so that a process group made after `import fp4_dist` can be freed
from .cast import cast_master_weights_to_nvfp4, post_all_gather_processing, quantize_master_weights
from .compute.linear import NVFP4Linear
from .convert import ConversionReport, convert_linear_weights
from .fsdp import fully_shard_nvfp4
from .optim import Zero1Config, Zero1Optimizer
from .quantize import quantize
from .tensor import NVFP4Tensor, is_nvfp4_tensor

_LAZY = {"export_compressed_tensors": "export", "load_compressed_tensors": "export", "VLLM_FUSED": "export"}

__all__ = [
    # one tensor
    "NVFP4Tensor",
    "quantize",
    "is_nvfp4_tensor",
    # a model
    "convert_linear_weights",
    "ConversionReport",
    "NVFP4Linear",
    # ZeRO partial cast (TransformerEngine's quantize_master_weights signature)
    "cast_master_weights_to_nvfp4",
    "quantize_master_weights",
    "post_all_gather_processing",
    # trainers
    "Zero1Optimizer",
    "Zero1Config",
    "fully_shard_nvfp4",
    # export (loaded on first use)
    "export_compressed_tensors",
    "load_compressed_tensors",
    "VLLM_FUSED",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4_dist' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
