"""The NVFP4 weight and what it holds: the storage layer every other part of the package computes with.

    nvfp4.py   NVFP4Tensor, the container: packed fields, logical shape and model dtype, checkpoint flattening
    ops.py     its op table: which aten ops keep the packed form, which run on the values, which are refused
    copy.py    ComputeCopy, a weight's model-dtype copy of its values and its freshness key;
               `refresh_compute_copies` (one launch for many weights), `compute_copy_bytes`

Nothing here imports `fp4_dist.compute` or a trainer: the layers that multiply by the copies sit above.
"""

from __future__ import annotations

from .copy import compute_copy_bytes, refresh_compute_copies
from .nvfp4 import FIELDS, NVFP4Tensor, _rebuild, is_nvfp4_tensor

__all__ = ["NVFP4Tensor", "is_nvfp4_tensor", "FIELDS", "compute_copy_bytes", "refresh_compute_copies"]
