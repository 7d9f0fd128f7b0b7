"""What a layer's GEMMs will read of an NVFP4 weight at their next use, where a copy is kept and proves itself
current (so the use reads it as it is, without remaking it): the weight's kept bf16 copy (``compute_copy=True``)
and a layer's FP8 block copy (the FP8 mode). The parity checks compare these with the copies of the reference bytes
(`fp4_dist.megatron.parity`): a copy that is stale or misplaced while claiming to be current, which no check of the
gathered bytes sees, then fails the check. A lean weight keeps no copy between its uses: nothing to compare.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..tensor import NVFP4Tensor
from . import fp8_copy
from .fp8_gemm import Fp8Operand

__all__ = ["consumed_pairs", "holders_of"]


def consumed_pairs(name: str, w: NVFP4Tensor, holders, reference: NVFP4Tensor) -> Iterator[tuple]:
    """(label, what the next use reads, what it must equal) for each kept copy of weight `w` (named `name`) that
    proves itself current; `holders`: the modules that hold `w` as their weight; `reference`: the NVFP4 weight
    the gathered bytes must equal (the quantized full master)."""
    cc = w.copy_state
    if cc.enabled and cc.fresh_for(w):
        yield f"{name} kept bf16 copy", cc.value, reference.dequantize(w.dtype)
    want = None
    for module in holders:
        operand = fp8_copy.kept_operand(module, w)
        if operand is None:
            continue
        if want is None:
            want = Fp8Operand.weight(reference)
        for field in ("bits", "scales", "cublas_scales", "cublas_scales_t", "bits_t"):
            got = getattr(operand, field)
            if got is not None:
                yield f"{name} FP8 copy ({field})", got, getattr(want, field)


def holders_of(model: torch.nn.Module) -> dict:
    """{id(weight): [modules holding it as ``weight``]} of `model`."""
    out: dict = {}
    for module in model.modules():
        w = module.__dict__.get("_parameters", {}).get("weight")
        if w is not None:
            out.setdefault(id(w), []).append(module)
    return out
