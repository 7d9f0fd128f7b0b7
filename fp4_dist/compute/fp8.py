"""The FP8 compute mode (``compute="fp8"``, ``--compute fp8``; its row in `modes.MODES`): the GEMMs read each
weight's FP8 128 x 128 block copy, made once per weight update (`fp8_copy`), and the activations and output
gradients in FP8 1 x 128 groups (`fp8_autograd`). cuBLAS's block-scaled GEMMs on Hopper (sm_90), emulated on the
CPU (`fp8_gemm`); other devices are refused at set-up (`check_device`). docs/fp8.md says what it costs and gains.

What the row names:

    check_device     the one-time device check (`fp8_gemm.check_device`: the GEMMs agree with the emulation, the
                     kernels with their references)
    linear           an NVFP4Linear's forward: the layer's FP8 copy of its weight, `Fp8Linear`
    parallel_linear  a Megatron parallel linear's: the same, with its tensor-parallel communication
    FsdpUnsharded    FSDP2's unsharded weight: an `Fp8Param` holding the FP8 copy of the gathered bytes
    Fp8Options       what the layers keep between weight updates (`fp8_copy.Fp8Options`)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..tensor import NVFP4Tensor
from . import fp8_copy, fp8_gemm, fp8_param
from .fp8_autograd import Fp8Linear, fp8_linear
from .fp8_copy import Fp8Options
from .fp8_gemm import Fp8Operand

__all__ = ["check_device", "linear", "parallel_linear", "FsdpUnsharded", "Fp8Operand", "Fp8Options", "fp8_linear"]


def check_device(device: torch.device) -> Optional[str]:
    """None where the FP8 GEMMs run on `device` and agree there with the emulation, else why not (checked once)."""
    return fp8_gemm.check_device(device).refusal


def linear(module: torch.nn.Module, input: torch.Tensor, compiling: bool = False) -> torch.Tensor:
    """An NVFP4Linear's forward in this mode (the same inside a torch.compile'd model: `compiling`)."""
    w = module.weight
    if type(w) is fp8_param.Fp8Param:  # FSDP2's unsharded weight in this mode: the copy itself, through its
        return F.linear(input, w, module.bias)  # F.linear (dtype and freed-memory checks included)
    if type(w) is not NVFP4Tensor:  # never bf16 in its place without a word
        raise RuntimeError(
            f"NVFP4Linear computes in FP8 (convert_linear_weights(compute='fp8')) but its weight is now a "
            f"{type(w).__name__}, not an NVFP4Tensor: the FP8 mode reads the FP8 copy of an NVFP4 weight; convert "
            "with compute='bf16', or set the layer's fp4_compute to 'bf16'")
    return fp8_linear(input, w, module.bias, fp8_copy.weight_operand(module, w))


def parallel_linear(layer, input: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor],
                    allreduce_dgrad: bool, sequence_parallel: bool, tp_group) -> torch.Tensor:  # fmt: skip
    """A Megatron parallel linear's GEMMs in this mode, on the layer's FP8 copy of its weight."""
    operand = fp8_copy.weight_operand(layer, weight)
    return Fp8Linear.apply(input, weight, bias, operand, allreduce_dgrad, sequence_parallel, tp_group)


class FsdpUnsharded:
    """FSDP2's unsharded weight in this mode (`fp4_dist.fsdp.master`): the FP8 block copy of the gathered bytes,
    in tensors of the weight's own that FSDP2 frees and allocates around each gather (`fp8_param.own`)."""

    @staticmethod
    def make(fields: tuple, dtype: torch.dtype, numerics: str) -> tuple:
        """(what the weight holds, the unsharded parameter, its tensors FSDP2 manages) at the first gather (the FP8
        copy's values are those of the gathered bytes, whatever `numerics` made them)."""
        held = fp8_param.own(Fp8Operand.block_copy(*fields))
        tensors = tuple(t for t in held if isinstance(t, torch.Tensor))
        return held, fp8_param.Fp8Param(held, dtype), tensors

    @staticmethod
    def write(held: Fp8Operand, fields: tuple) -> None:
        """Write the copy of a later gather's bytes into the tensors `make` gave: on a GPU by the one launch that
        made them (`Fp8Operand.rewrite_block_copy`), else by making a copy and copying it in."""
        if not fp8_param.rewrite(held, fields):
            fp8_param.write(held, Fp8Operand.block_copy(*fields))
