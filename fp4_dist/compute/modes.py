"""The compute modes: what an NVFP4 layer's GEMMs read, one row each in `MODES`.

A mode is one module of this package holding its `ComputeMode` row and the code the row names (`bf16.py`,
`fp8.py`). Everything that offers a choice of mode reads this table and nothing else: `convert_linear_weights`
(``compute=``), `fully_shard_nvfp4` (``compute=``), the Megatron options (``--compute``), the example trainer
(``--fp4-compute``), Zero1Optimizer (through the converted layers). Adding a mode is a module and a row here.

    mode   GEMMs read                          per weight update           per use                  bytes/weight
    bf16   the weight's bf16 values            nothing (lean), or a bf16   a bf16 copy in the lean  0.5 (lean),
                                               copy (kept copies)          pool (lean only)         2.5 (kept)
    fp8    its FP8 128 x 128 block copy; x     the FP8 block copy and its  the activation's and     2.5 (GPU),
           and dy in FP8 1 x 128 groups        transpose (GPU; optional)   gradient's FP8 groups    else 1.5
    nvfp4  the NVFP4 weight itself; x, dy      nothing                     x, dy in NVFP4 1 x 16;   0.5
           and their Hadamard-transformed                                  RHT(x^T), RHT(dy^T)
           transposes in NVFP4 1 x 16

`prepare` runs a mode's one-time device check at set-up, into a per-device table the data path only reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from . import bf16, fp8, nvfp4

__all__ = ["ComputeMode", "MODES", "DEFAULT", "mode_named", "check_options", "options_from_pairs", "prepare"]


@dataclass(frozen=True, kw_only=True)
class ComputeMode:
    """One way of computing with NVFP4 weights (module docstring). The descriptive fields are what the docs and
    error messages say of it; the callables are what the layers run."""

    name: str
    """How users choose it (``compute=NAME``, ``--compute NAME``)."""
    gemms_read: str
    """What its GEMMs read, in a phrase."""
    per_update: str
    """What it makes from the packed bytes once per weight update."""
    per_use: str
    """What it makes at each use of a weight (a layer's forward or backward)."""
    devices: str
    """Where it runs, in a phrase (`check_device` decides)."""
    bytes_per_weight: str
    """Memory per weight between steps, the packed 0.5 bytes included."""
    kept_copies: bool
    """Whether ``compute_copy=True`` (``--compute-copy``: a bf16 copy kept between updates) applies to it."""
    lean_depth: bool
    """Whether ``--lean-depth`` (layers of bf16 copies held at once in the lean pool) applies to it."""
    check_device: Callable[[torch.device], Optional[str]]
    """The one-time check of a device: None where the mode runs there, else the sentence that refuses it."""
    linear: Callable
    """``linear(module, input, compiling=False)``: an `NVFP4Linear`'s forward (`compiling`: eagerly inside a
    torch.compile'd model)."""
    parallel_linear: Optional[Callable] = None
    """``parallel_linear(layer, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group)``: a Megatron
    parallel linear's GEMMs and tensor-parallel communication in this mode; None: Megatron's own linear function on
    the weight's values."""
    options: Optional[type] = None
    """The frozen dataclass of this mode's options (``convert_linear_weights(options=...)``), or None: it has none.
    An instance says which linears keep the default mode (``kept_in_default(names) -> {name: reason}``) and is
    each layer's ``fp4_options``."""
    cuda_graphs: Optional[str] = None
    """None where a captured CUDA graph replays this mode's GEMMs as they run eagerly; else why it does not, in a
    clause (Megatron's start-up refuses its graphs with the mode, naming it)."""
    fsdp_unsharded: Optional[object] = None
    """FSDP2's unsharded weight in this mode, an object with ``make(fields, dtype, numerics) -> (held, parameter,
    tensors)`` and ``write(held, fields)`` (the gathered ``(rowwise_data, scale_inv, amax)``); None: the dequantized
    values."""

    def flags(self) -> str:
        """The command-line spelling of this mode, for messages that name the flag to drop."""
        return f"--compute {self.name} (--fp4-compute {self.name} in the example trainer)"


MODES: dict[str, ComputeMode] = {
    m.name: m
    for m in (
        ComputeMode(name="bf16", gemms_read="the weight's values in its compute dtype (bf16 unless the model is fp16 "
                    "or fp32)", per_update="nothing (lean), or a bf16 copy of each weight (kept copies)",
                    per_use="a bf16 copy in the lean pool (lean only)", devices="CUDA GPUs (sm_80+) and the CPU",
                    bytes_per_weight="0.5 (lean), 2.5 (kept copies)", kept_copies=True, lean_depth=True,
                    check_device=bf16.check_device, linear=bf16.linear),
        ComputeMode(name="fp8", gemms_read="the weight's FP8 128 x 128 block copy, with the activations and "
                    "gradients in FP8 1 x 128 groups", per_update="the FP8 block copy (1 byte per weight)",
                    per_use="the FP8 1 x 128 groups of the activation and of the output gradient",
                    devices="Hopper GPUs (sm_90, cuBLAS's block-scaled GEMMs) and the CPU (emulated)",
                    bytes_per_weight="2.5 on a GPU (the copy's transpose kept; Fp8Options), else 1.5",
                    kept_copies=False, lean_depth=False, check_device=fp8.check_device, linear=fp8.linear,
                    parallel_linear=fp8.parallel_linear, options=fp8.Fp8Options, fsdp_unsharded=fp8.FsdpUnsharded),
        ComputeMode(name="nvfp4", gemms_read="the NVFP4 weight's codes and tile scales, with the activations and "
                    "output gradients in NVFP4 1 x 16 blocks (the gradients stochastically rounded) and both "
                    "weight-gradient operands through a 16-point random Hadamard transform",
                    per_update="nothing (the GEMMs read the packed weight)",
                    per_use="the NVFP4 1 x 16 blocks of x and dy, and of their transformed transposes",
                    devices="the CPU and CUDA GPUs of sm_80 to sm_90 (emulated GEMMs; quantizers bit for bit "
                    "TransformerEngine's, CuPy kernels on a GPU; the GPU path not yet run by CI); sm_100+ is refused "
                    "until its native NVFP4 GEMM is built and run", bytes_per_weight="0.5", kept_copies=False,
                    lean_depth=False,
                    check_device=nvfp4.check_device, linear=nvfp4.linear, parallel_linear=nvfp4.parallel_linear,
                    options=nvfp4.Nvfp4Recipe, cuda_graphs=nvfp4.CUDA_GRAPHS,
                    fsdp_unsharded=nvfp4.FsdpUnsharded),
    )
}  # fmt: skip
"""Every compute mode by name: the one definition (module docstring)."""

DEFAULT = "bf16"
"""The mode a layer computes in unless told otherwise."""


def mode_named(name, who: str) -> ComputeMode:
    """The mode called `name`; ValueError naming `who` (the function or flag that took it) and the choices."""
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ValueError(f"{who}: compute must be one of {tuple(MODES)}, got {name!r}")
    return mode


def check_options(mode: ComputeMode, options, who: str) -> None:
    """TypeError naming `who` (the function and its compute argument) unless `options` is None or an instance of
    `mode`'s ``options`` dataclass."""
    if options is not None and (mode.options is None or not isinstance(options, mode.options)):
        want = f"a {mode.options.__name__}" if mode.options else "None (it has no options)"
        raise TypeError(f"{who}: options for the {mode.name} compute mode must be {want}, got "
                        f"{type(options).__name__}")


def options_from_pairs(mode: ComputeMode, pairs, who: str):
    """`mode`'s options (an instance of its ``options`` dataclass) with the fields that `pairs` ("NAME=VALUE"
    strings, from the command line) set, the rest at their defaults; None where `pairs` is empty. ValueError naming
    `who` (the flag) for a mode without options, an unknown field or a value of the wrong kind."""
    pairs = list(pairs or ())
    if not pairs:
        return None
    if mode.options is None:
        raise ValueError(f"{who}: the {mode.name} compute mode has no options; got {', '.join(pairs)}")
    known = {f.name: f.type for f in fields(mode.options)}
    layer_choice = getattr(mode.options, "LAYER_CHOICE", ())
    values = {}
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or name not in known:
            settable = sorted(set(known) - set(layer_choice))
            raise ValueError(f"{who}: expected NAME=VALUE with NAME one of {settable} (the {mode.name} mode's "
                             f"{mode.options.__name__}), got {pair!r}")
        if name in layer_choice:
            raise ValueError(f"{who}: {name} chooses layers, which only convert_linear_weights(options=...) applies; "
                             "here every converted linear computes in the mode")
        values[name] = _option_value(known[name], text, f"{who} {name}")
    return mode.options(**values)


def _option_value(kind, text: str, who: str):
    kind = {"bool": bool, "int": int}.get(kind, kind)  # the dataclass annotations are strings here
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{who}: expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{who}: expected an integer, got {text!r}") from None
    raise ValueError(f"{who}: options of type {kind} are not set from the command line")


def prepare(mode: ComputeMode, devices) -> Optional[str]:
    """Run `mode`'s one-time check on each of `devices` (set-up: before any weight computes there); None where it
    runs on all of them, else the first refusal."""
    for device in devices:
        why = mode.check_device(torch.device(device))
        if why is not None:
            return why
    return None
