"""The bf16 compute mode (the default; its row in `modes.MODES`): the GEMMs read the weight's values in its compute
dtype (bf16 unless the model is fp16 or fp32), from a copy kept between updates (``compute_copy=True``, `view.py`)
or, by default, made around each use in the lean pool (`lean.py`). It runs wherever the package's kernels do (CUDA
GPUs and the CPU), so its device check has nothing to refuse.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .lean import is_lean, lean_call
from .view import compute_view

__all__ = ["check_device", "linear"]


def check_device(device: torch.device) -> Optional[str]:
    """None: the mode computes on any device the kernels run on (they check themselves)."""
    return None


def linear(module: torch.nn.Module, input: torch.Tensor, compiling: bool = False) -> torch.Tensor:
    """An NVFP4Linear's forward in this mode: through a lean copy where the weight keeps none, else through the
    layer's cached view of its kept copy. `compiling` (the forward runs eagerly inside a torch.compile'd model):
    through the view, whose dispatch makes the values of a lean weight too, with no saved-tensor hooks."""
    w = module.weight
    if not compiling and is_lean(w):
        return lean_call(module, w, lambda value: F.linear(input, value, module.bias), fresh_tensor=False)
    return F.linear(input, compute_view(module, w), module.bias)
