"""Swap the weights of a model's nn.Linear layers for NVFP4 parameters."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .compute_view import NVFP4Linear
from .format import TILE
from .quantize import quantize


@dataclass
class ConversionReport:
    """Which linear weights became NVFP4 and why the others stayed in high precision."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"NVFP4 weights: {len(self.converted)} converted, {len(self.skipped)} kept in high precision"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def convert_linear_weights(
    model: nn.Module,
    *,
    numerics: str = "te",
    dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = (),
    compute_copy: bool = True,
    verbose: bool = False,
) -> ConversionReport:
    """Replace every eligible nn.Linear weight (2D, K % 16 == 0) by an NVFP4 parameter, in place.

    A converted layer whose class is nn.Linear itself becomes an `NVFP4Linear` (an nn.Linear whose forward
    computes with a cached plain alias of the weight's compute copy, `fp4_dist.compute_view`: the host cost of a
    bf16 forward); subclasses keep their class and forward and compute through the weight's dispatch, with the
    same values.

    Args:
        model: any module; its nn.Linear children are converted where eligible.
        numerics: block-scale formula ("te" or "te-2.14").
        dtype: model dtype the NVFP4 weights report (their compute dtype), bf16 by default.
        skip: module names (as in `named_modules`) to leave in high precision, e.g. the output head.
        compute_copy: keep each weight's values in ``dtype`` between updates, so forward and backward use them
            without dequantizing (2 bytes per element); False dequantizes on every use instead
            (`NVFP4Tensor.compute_copy`, settable per weight later).
        verbose: print the report.
    Returns:
        ConversionReport naming converted and skipped weights (with the reason).
    """
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            "convert_linear_weights: this model is already sharded (its parameters are DTensors, e.g. by torch's "
            "fully_shard); convert the unsharded model, or shard it with fp4_dist.fsdp.fully_shard_nvfp4, which "
            "converts the linear weights itself")
    report = ConversionReport()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if name in skip:
            report.skipped[name] = "listed in skip"
        elif w.shape[1] % TILE:
            report.skipped[name] = f"in_features = {w.shape[1]} is not a multiple of {TILE}"
        elif not torch.isfinite(w).all():
            report.skipped[name] = "weight holds non-finite values"
        else:
            q = quantize(w.detach(), numerics=numerics, dtype=dtype, name=f"{name}.weight")
            q.compute_copy = compute_copy
            module.weight = nn.Parameter(q, requires_grad=w.requires_grad)
            if type(module) is nn.Linear:  # its forward is F.linear: computing with the cached view is the same
                module.__class__ = NVFP4Linear
            # An optimizer built before this call still holds `w`, which no longer gets gradients: let it say so.
            w._fp4_dist_replaced_by = f"{name}.weight"
            report.converted.append(name)
    if any(why != "listed in skip" for why in report.skipped.values()):
        warnings.warn(str(report), stacklevel=2)
    if verbose:
        print(report)
    return report
