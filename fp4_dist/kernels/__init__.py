"""NVFP4 stages over lists of weights, for every device (`stages.py` documents the pipeline).

Modules, and the one way a call travels through them::

    stages.py       the public API: each stage as a call form (`partial_cast`) and a bound form
                    (`bind_partial_cast`); CPU tensors run `reference.py`, CUDA tensors a plan and a launch
    checks.py       every argument check (both devices), run before anything is built or written
    cuda_plans.py   CUDA only: the work table a launch reads (`Plan`), laid out from checked arguments
    _launch.py      CUDA only: compiles cuda/*.cu once per device (NVRTC) and launches on torch's stream
    reference.py    the numeric contract in plain PyTorch: the CPU path and the oracle of every kernel
    fp8_block.py    the FP8 block copy of an NVFP4 weight (Hopper's FP8 GEMMs, docs/fp8.md) and the byte
                    transpose the dgrad reads; fp8_block_reference.py is its plain-PyTorch oracle
    fp8_rows.py     activations and gradients in FP8 with one scale per 1 x 128 group; fp8_rows_reference.py
                    likewise
    nvfp4_1d_reference.py  activations and gradients in NVFP4 with one E4M3 scale per 1 x 16 block (round to
                    nearest even or stochastic, with hashed random bits) and the 16-point random Hadamard transform
                    of the wgrad operands, bit for bit TransformerEngine's reference quantizer where that is defined;
                    nvfp4_1d.py + cuda/nvfp4_1d.cu, its kernels (the same bits; the GEMM's bf16 unscaled values)
    outputs.py      kernel outputs allocated without the fill of torch's deterministic mode (written whole)
"""

from . import reference
from .cuda_plans import capturing
from .stages import (
    AmaxLayout,
    Bound,
    amax_layout,
    bind_dequantize,
    bind_expand_scales,
    bind_fused_scale,
    bind_nibble_transpose,
    bind_owner_scales,
    bind_partial_amax,
    bind_partial_cast,
    bind_scale_transpose,
    dequantize,
    expand_scales,
    fused_scale,
    nibble_transpose,
    owner_scales,
    partial_amax,
    partial_cast,
    quantize_rowwise,
    scale_transpose,
    signature,
)

__all__ = [
    "reference", "capturing",
    "AmaxLayout", "amax_layout", "signature", "Bound", "quantize_rowwise",
    "partial_amax", "bind_partial_amax", "fused_scale", "bind_fused_scale", "partial_cast", "bind_partial_cast",
    "owner_scales", "bind_owner_scales", "expand_scales", "bind_expand_scales",
    "nibble_transpose", "bind_nibble_transpose", "scale_transpose", "bind_scale_transpose",
    "dequantize", "bind_dequantize",
]  # fmt: skip
