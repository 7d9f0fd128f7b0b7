"""NVFP4Linear: the nn.Linear that `convert_linear_weights` makes of a plain one, computing as its compute mode says
(``fp4_compute``, a name in `modes.MODES`: the bf16 values of its weight by default, `bf16.py`)."""

from __future__ import annotations

import torch
from torch import nn

from . import fp8_copy
from .modes import DEFAULT, MODES
from .view import forget


def _linear_eagerly(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """An NVFP4Linear's forward when torch.compile traces the model, behind ``torch._dynamo.disable``
    (`_OUTSIDE_THE_GRAPH`): run eagerly, as a graph break. Its weight
    comes from the layer's view cache, Python state (version counters, weak references) that dynamo would guard
    on, and re-specialise, in a frame every layer shares (one recompile per layer shape, then the recompile
    limit). Kept out, the compiled graphs are the code between the linears, and each resumes at its own place in
    the caller (a block's forward resumes after its q/k/v projection with that projection's shape, in every
    block alike). The GEMM is an extern kernel under inductor anyway."""
    return MODES[module.fp4_compute].linear(module, input, compiling=True)


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
    """nn.Linear whose forward computes as its compute mode says (`fp4_compute`, a name in `modes.MODES`).

    `convert_linear_weights` turns the plain nn.Linear layers it converts into this class (subclasses of nn.Linear
    keep their class and their own forward: they take the dispatch path, with the same values). With a weight that
    is not NVFP4 it is nn.Linear.
    """

    fp4_compute = DEFAULT
    fp4_options = None
    """The compute mode's options (its row's ``options`` type), set by `convert_linear_weights`; None: defaults."""

    def __init__(self, *args, **kwargs):
        ready_for_compile()
        super().__init__(*args, **kwargs)

    def __setstate__(self, state):  # unpickled (torch.load of a whole model) in a process that converted nothing
        ready_for_compile()
        super().__setstate__(state)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # constant-folded by dynamo; a quarter of a microsecond in eager mode
            return _OUTSIDE_THE_GRAPH(self, input)
        return MODES[self.fp4_compute].linear(self, input)

    def _apply(self, fn, *args, **kwargs):
        forget(self)
        fp8_copy.forget(self)
        return super()._apply(fn, *args, **kwargs)
