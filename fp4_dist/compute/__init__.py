"""Computing with NVFP4 weights: what a layer multiplies by, made from the packed bytes once per change of them.

    alias.py       plain tensors on a copy's memory, linked to the weight by one autograd node
    view.py        a layer's cached alias of its weight's copy (`compute_view`)
    linear.py      NVFP4Linear (what `convert_linear_weights` makes of nn.Linear)
    lean.py        weights that keep no copy (the default, ``compute_copy=False``): a copy around each use only
    pool.py        the lean pool: buffers per weight shape for one layer or `set_pool_depth` layers;
                   `pool_stats`, `pool_bytes`, `release_pool`
    lean_order.py  the learned order of lean uses and the batched fills it allows
    fp8.py         the FP8 compute mode's linear (FP8 block-scaled GEMMs: cuBLAS on Hopper, emulated on the CPU)
    fp8_param.py   FSDP2's unsharded weight in the FP8 mode: a parameter holding the FP8 block copy

The copies themselves (`ComputeCopy`, `refresh_compute_copies`, `compute_copy_bytes`) belong to the weight:
`fp4_dist.tensor.copy`. Megatron's linear function claims its lean uses through `fp4_dist.megatron.lean_claim`.
"""

from __future__ import annotations

from ..tensor.copy import compute_copy_bytes, refresh_compute_copies
from .linear import NVFP4Linear
from .pool import pool_bytes, pool_depth, pool_stats, release_pool, set_pool_depth
from .view import compute_view

__all__ = ["NVFP4Linear", "compute_view", "compute_copy_bytes", "refresh_compute_copies", "pool_stats", "pool_bytes",
           "release_pool", "pool_depth", "set_pool_depth"]  # fmt: skip
