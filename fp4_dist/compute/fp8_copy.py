"""A layer's FP8 block copy of its NVFP4 weight (the FP8 compute mode): made at the first use after the weight's
bytes change, then read by every forward and backward until they change again (once per optimizer step).

1 byte per weight and one fp32 per 128 x 128 block, beside the packed 0.5 bytes: 1.5 bytes per weight against bf16's
2. The copy proves itself current as the lean copies do (`pool.copy_token`: the weight's cast count and the
version counters of its bytes); between a cast and its all-gather's processing nothing proves a copy current, and
each use makes one of its own (not kept).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tensor.copy import bound, rowwise_fields
from .fp8_gemm import Fp8Operand
from .pool import copy_token

__all__ = ["weight_operand", "kept_operand", "forget", "fp8_copy_bytes"]

_ATTR = "_fp4_fp8_copy"


class Fp8Copy:
    """The copy a layer keeps: the weight fields it was made from, what proved them current then, the operand."""

    __slots__ = ("fields", "token", "operand")

    def __init__(self, fields: tuple, token: tuple, operand: Fp8Operand):
        self.fields, self.token, self.operand = fields, token, operand

    def __deepcopy__(self, memo):  # a copied layer makes its own from its own weight
        return None

    def __reduce__(self):
        return type(None), ()


def weight_operand(module: torch.nn.Module, w) -> Fp8Operand:
    """The FP8 block copy of `module`'s NVFP4 weight `w`, made now unless the one the layer keeps is current."""
    kept = module.__dict__.get(_ATTR)
    token = copy_token(w.copy_state, rowwise_fields(w), w)
    if kept is not None and token is not None and kept.token == token and bound(kept.fields, w):
        return kept.operand
    operand = Fp8Operand.weight(w)
    # Not kept when nothing proves it current: the next use makes its own, and the old copy's memory goes now.
    module.__dict__[_ATTR] = Fp8Copy(rowwise_fields(w), token, operand) if token is not None else None
    return operand


def kept_operand(module: torch.nn.Module, w) -> Optional[Fp8Operand]:
    """The copy `module` keeps of `w` if it proves itself current (what its next use reads as it is), else None."""
    kept = module.__dict__.get(_ATTR)
    if kept is None:
        return None
    token = copy_token(w.copy_state, rowwise_fields(w), w)
    return kept.operand if token is not None and kept.token == token and bound(kept.fields, w) else None


def forget(module: torch.nn.Module) -> None:
    """Drop `module`'s copy (its weight moves: `nn.Module._apply`)."""
    module.__dict__.pop(_ATTR, None)


def fp8_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes the FP8 copies of `model`'s layers hold now (values, block scales, and those laid out for cuBLAS)."""
    storages = {}  # by storage: tensors that share one are counted once
    for m in model.modules():
        kept = m.__dict__.get(_ATTR)
        if kept is not None:
            op = kept.operand
            for t in (op.bits, op.scales, op.cublas_scales, op.cublas_scales_t):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
