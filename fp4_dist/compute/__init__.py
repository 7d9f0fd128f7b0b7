"""Computing with NVFP4 weights: what a layer multiplies by, made from the packed bytes once per change of them.

    copy.py        ComputeCopy: a weight's kept model-dtype copy, its freshness key, the batched refresh after a
                   gather; `compute_copy_bytes`
    alias.py       plain tensors on a copy's memory, linked to the weight by one autograd node
    view.py        a layer's cached alias of its weight's copy (`compute_view`)
    linear.py      NVFP4Linear (what `convert_linear_weights` makes of nn.Linear)
    lean.py        weights that keep no copy (``compute_copy=False``): a copy around each use only
    pool.py        the lean pool: one buffer per weight shape; `pool_stats`, `pool_bytes`, `release_pool`
    lean_order.py  the learned order of lean uses and the batched fills it allows
    lean_claim.py  lean uses that Megatron's linear function claims and refills in its backward

`fp4_dist.tensor` imports `copy.py`, and `view.py` imports `fp4_dist.tensor`: this package's names are therefore
loaded on first use (PEP 562), not when the package is.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "NVFP4Linear": "linear",
    "compute_view": "view",
    "compute_copy_bytes": "copy",
    "refresh_compute_copies": "copy",
    "pool_stats": "pool",
    "pool_bytes": "pool",
    "release_pool": "pool",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4_dist.compute' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted(list(globals()) + __all__)
