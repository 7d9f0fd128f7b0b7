"""Plain tensors that alias memory holding an NVFP4 weight's values and pass their gradient to the weight.

A layer computes with such an alias instead of the weight: a plain tensor skips the subclass's Python dispatch at
every use. It must still be linked to the weight by autograd, so that the weight gradient reaches the parameter's
grad accumulator and every hook on it (Megatron's DDP), through one C++ node whose backward passes the gradient
through: clone's. ``clone`` of a weight with `ops.ALIAS_FORMAT` returns a placeholder made under that node,
and the placeholder is then bound to the memory (``set_`` under no_grad: the node stays, the storage changes).

The alias is not an autograd view of the weight: it has a version counter of its own, so a refresh of the weight's
copy (which bumps the weight's counter) does not make autograd rebuild its node by replaying a view op through the
Python dispatch, once per weight per step. Refreshes bump the alias's counter instead (`ComputeCopy.aliases`).
"""

from __future__ import annotations

import torch

from ..tensor import NVFP4Tensor
from ..tensor.ops import ALIAS_FORMAT


def alias_onto(w: NVFP4Tensor, memory: torch.Tensor) -> torch.Tensor:
    """A plain tensor on `memory` (a plain [M, K] tensor of `w`'s dtype, which the caller keeps holding `w`'s
    values whenever the alias is read), linked to `w` by clone's autograd node when grad is on."""
    alias = w.clone(memory_format=ALIAS_FORMAT)
    with torch.no_grad():  # rebinding storage is not an op autograd should record: the clone node is the link
        alias.set_(memory.untyped_storage(), memory.storage_offset(), memory.shape, memory.stride())
    return alias
