"""Computing with NVFP4 weights: what a layer multiplies by, made from the packed bytes once per change of them.

The compute modes, one row each (`modes.MODES`: what the GEMMs read, what is made per update and per use, where it
runs, bytes per weight) and one module each:

    modes.py         the table of modes, its one-time device check (`prepare`)
    bf16.py          the bf16 mode (the default): the GEMMs read the weight's values, kept or lean
    fp8.py           the FP8 mode: the GEMMs read FP8 block copies (cuBLAS on Hopper, emulated on the CPU); its
                     options `Fp8Options`
    nvfp4.py         the nvfp4 mode: TransformerEngine's NVFP4 training recipe, every GEMM on NVFP4 operands
                     (emulated: the reference on the CPU, CuPy kernels on sm_80 to sm_90); its options `Nvfp4Recipe`
    nvfp4_gemm.py    its emulated GEMMs and operand kernels per device, and the per-device check table

What the bf16 mode computes with:

    alias.py         plain tensors on a copy's memory, linked to the weight by one autograd node
    view.py          a layer's cached alias of its weight's copy (`compute_view`)
    lean.py          weights that keep no copy (the default, ``compute_copy=False``): a copy around each use only
    pool.py          the lean pool: buffers per weight shape for one layer or `set_pool_depth` layers;
                     `pool_stats`, `pool_bytes`, `release_pool`
    lean_order.py    the learned order of lean uses and the batched fills it allows

What the FP8 mode computes with:

    fp8_autograd.py  the FP8 linear's forward and backward (`Fp8Linear`), with tensor-parallel communication
    fp8_gemm.py      the block-scaled GEMMs and their operands (`Fp8Operand`); the per-device check table
    fp8_copy.py      a layer's FP8 block copy of its weight, made once per weight update, and what it keeps
    fp8_param.py     FSDP2's unsharded weight in the FP8 mode: a parameter holding the FP8 block copy

And the layer:

    linear.py        NVFP4Linear (what `convert_linear_weights` makes of nn.Linear): computes as its mode says
    consumed.py      what the GEMMs will read of a weight without remaking it, for the parity checks

The copies themselves (`ComputeCopy`, `refresh_compute_copies`, `compute_copy_bytes`) belong to the weight:
`fp4_dist.tensor.copy`. Megatron's linear function claims its lean uses through `fp4_dist.megatron.lean_claim`.
"""

from __future__ import annotations

from ..tensor.copy import compute_copy_bytes, refresh_compute_copies
from .linear import NVFP4Linear
from .modes import MODES, ComputeMode
from .pool import pool_bytes, pool_depth, pool_stats, release_pool, set_pool_depth
from .view import compute_view

__all__ = ["NVFP4Linear", "MODES", "ComputeMode", "compute_view", "compute_copy_bytes", "refresh_compute_copies",
           "pool_stats", "pool_bytes", "release_pool", "pool_depth", "set_pool_depth"]  # fmt: skip
