"""NVFP4Linear: the nn.Linear that `convert_linear_weights` makes of a plain one, computing with the cached view of
its NVFP4 weight (`view.compute_view`), for a weight that keeps no copy a lean copy (`lean.lean_call`), or in the
FP8 compute mode (``fp4_compute = "fp8"``) with block-scaled FP8 GEMMs on the weight's FP8 copy (`fp8_copy`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor import NVFP4Tensor
from . import fp8_copy
from .fp8 import fp8_linear
from .fp8_param import Fp8Param
from .lean import is_lean, lean_call
from .view import compute_view, forget

COMPUTE_MODES = ("bf16", "fp8")
"""What an NVFP4Linear's GEMMs read: "bf16", the weight's values in its compute dtype (bf16 unless the model is
fp16 or fp32); "fp8", its FP8 block copy, with the activations and gradients in FP8 (`fp8`)."""


def _linear_eagerly(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """An NVFP4Linear's forward when torch.compile traces the model, behind ``torch._dynamo.disable``
    (`_OUTSIDE_THE_GRAPH`): run eagerly, as a graph break. Its weight
    comes from the layer's view cache, Python state (version counters, weak references) that dynamo would guard
    on, and re-specialise, in a frame every layer shares (one recompile per layer shape, then the recompile
    limit). Kept out, the compiled graphs are the code between the linears, and each resumes at its own place in
    the caller (a block's forward resumes after its q/k/v projection with that projection's shape, in every
    block alike). The GEMM is an extern kernel under inductor anyway."""
    if module.fp4_compute == "fp8":
        return _fp8_forward(module, input)
    return F.linear(input, compute_view(module, module.weight), module.bias)


def _fp8_forward(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if type(w) is Fp8Param:  # FSDP2's unsharded weight in the FP8 mode (fully_shard_nvfp4): the copy itself,
        return F.linear(input, w, module.bias)  # through its F.linear (dtype and freed-memory checks included)
    if type(w) is not NVFP4Tensor:  # never bf16 in its place without a word
        raise RuntimeError(
            f"NVFP4Linear computes in FP8 (convert_linear_weights(compute='fp8')) but its weight is now a "
            f"{type(w).__name__}, not an NVFP4Tensor: the FP8 mode reads the FP8 copy of an NVFP4 weight; convert "
            "with compute='bf16', or set the layer's fp4_compute to 'bf16'")
    return fp8_linear(input, w, module.bias, fp8_copy.weight_operand(module, w))


_OUTSIDE_THE_GRAPH = None
"""`_linear_eagerly` behind ``torch._dynamo.disable``, made by `ready_for_compile`."""


def ready_for_compile() -> None:
    """Make `_OUTSIDE_THE_GRAPH` (idempotent). Called wherever a layer becomes an NVFP4Linear, so that it exists
    before torch.compile traces one and never changes under a compiled graph's guards; not at import, where it
    would import dynamo (a second of CPU time) into every process that imports fp4_dist, a Megatron rank on CPU
    included."""
    global _OUTSIDE_THE_GRAPH
    if _OUTSIDE_THE_GRAPH is None:
        _OUTSIDE_THE_GRAPH = torch._dynamo.disable(_linear_eagerly, recursive=True)


class NVFP4Linear(nn.Linear):
    """nn.Linear whose forward computes with the cached view of an NVFP4 weight (`compute_view`).

    `convert_linear_weights` turns the plain nn.Linear layers it converts into this class (subclasses of nn.Linear
    keep their class and their own forward: they take the dispatch path, with the same values). With a weight that
    is not NVFP4 it is nn.Linear. `fp4_compute` ("bf16" or "fp8", `COMPUTE_MODES`) says what its GEMMs read.
    """

    fp4_compute = "bf16"

    def __init__(self, *args, **kwargs):
        ready_for_compile()
        super().__init__(*args, **kwargs)

    def __setstate__(self, state):  # unpickled (torch.load of a whole model) in a process that converted nothing
        ready_for_compile()
        super().__setstate__(state)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # constant-folded by dynamo; a quarter of a microsecond in eager mode
            return _OUTSIDE_THE_GRAPH(self, input)
        w = self.weight
        if self.fp4_compute == "fp8":
            return _fp8_forward(self, input)
        if is_lean(w):
            return lean_call(self, w, lambda value: F.linear(input, value, self.bias), fresh_tensor=False)
        return F.linear(input, compute_view(self, w), self.bias)

    def _apply(self, fn, *args, **kwargs):
        forget(self)
        fp8_copy.forget(self)
        return super()._apply(fn, *args, **kwargs)
