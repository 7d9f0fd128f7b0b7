"""Swap the weights of a model's nn.Linear layers for NVFP4 parameters."""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from .compute.linear import NVFP4Linear, ready_for_compile
from .compute.modes import DEFAULT, check_options, mode_named, prepare
from .format import DEFAULT_NUMERICS, MODEL_DTYPES, TILE
from .quantize import quantize
from .shared_amax import ATTR as AMAX_GROUP_ATTR
from .shared_amax import check_patterns, group_amax, sibling_groups
from .tensor import is_nvfp4_tensor


@dataclass
class ConversionReport:
    """Which linear weights became NVFP4 and why the others stayed in high precision, and what their GEMMs read.
    `fp4_dist.fsdp.FSDPReport` is this report with how each weight is gathered."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    shared_amax: dict = field(default_factory=dict)
    """Converted weights that share one amax with their siblings (``{weight: AmaxGroup}``, `shared_amax`)."""
    tied: dict[str, list[str]] = field(default_factory=dict)
    """Converted weights that other modules share (``{linear: [other owners]}``): every owner holds the one NVFP4
    parameter, so the tie survives (an embedding tied to the output head reads the NVFP4 values too)."""
    compute: str = DEFAULT
    """What the converted layers' GEMMs read (a name in `compute.modes.MODES`)."""
    in_mode: list[str] = field(default_factory=list)
    """With a compute mode other than the default: the linears computing in it (every NVFP4Linear)."""
    not_in_mode: dict[str, str] = field(default_factory=dict)
    """With a compute mode other than the default: linears holding an NVFP4 weight that compute in the default
    mode all the same, and why (``{linear: reason}``)."""

    @property
    def fp8(self) -> list[str]:
        """`in_mode`, by the name users of ``compute="fp8"`` know."""
        return self.in_mode

    @property
    def not_fp8(self) -> dict[str, str]:
        """`not_in_mode`, by the name users of ``compute="fp8"`` know."""
        return self.not_in_mode

    def compute_lines(self) -> list[str]:
        """The report's lines on the compute mode (none in the default mode)."""
        if self.compute == DEFAULT and not self.in_mode and not self.not_in_mode:
            return []
        lines = [f"  {self.compute.upper()} compute: {len(self.in_mode)} linears, {len(self.not_in_mode)} with NVFP4 "
                 f"weights in {DEFAULT}"]
        return lines + [f"  {DEFAULT} compute {name}: {why}" for name, why in self.not_in_mode.items()]

    def __str__(self) -> str:
        lines = [f"NVFP4 weights: {len(self.converted)} converted, {len(self.skipped)} kept in high precision"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"  tied {name}.weight with {', '.join(others)}" for name, others in self.tied.items()]
        groups = list(dict.fromkeys(self.shared_amax.values()))
        lines += [f"  one amax: {g}" for g in groups]
        return "\n".join(lines + self.compute_lines())


def convert_linear_weights(
    model: nn.Module,
    *,
    numerics: str = DEFAULT_NUMERICS,
    dtype: Optional[torch.dtype] = None,
    skip: tuple[str, ...] = (),
    compute_copy: bool = False,
    shared_amax: Sequence[Sequence[str]] = (),
    compute: str = DEFAULT,
    options=None,
    verbose: bool = False,
) -> ConversionReport:
    """Replace every eligible nn.Linear weight (2D, K % 16 == 0) by an NVFP4 parameter, in place.

    A converted layer whose class is nn.Linear itself becomes an `NVFP4Linear`, an nn.Linear whose forward computes
    with the weight's bf16 values without going through its dispatch: by default (lean) a copy written into a pool
    buffer around each use (`fp4_dist.compute.lean`), with `compute_copy=True` a cached plain alias of the weight's
    kept compute copy (`fp4_dist.compute.view`: the host cost of a bf16 forward). Subclasses keep their class and
    forward and compute through the weight's dispatch, with the same values. A weight shared by several modules
    (tied embeddings) becomes one NVFP4 parameter that every owner holds. Weights that are NVFP4 already are left as
    they are, so a second call converts nothing more (with ``compute="fp8"`` it switches the NVFP4Linear layers it
    finds to FP8).

    Args:
        model: any module; its nn.Linear children are converted where eligible.
        numerics: block-scale formula ("te" or "te-2.14").
        dtype: model dtype the NVFP4 weights report (their compute dtype); None: each linear's own dtype (bf16,
            fp16 or fp32).
        skip: module names (as in `named_modules`) to leave in high precision, e.g. the output head; a module
            holding linears (a block) leaves all of them. An entry that names no linear raises ValueError.
        compute_copy: keep each weight's values in the compute dtype between updates (2.5 bytes per weight with
            the packed bytes, against bf16's 2), so forward and backward use them without dequantizing. Default
            False (lean): 0.5 bytes per weight, each use dequantizes into a buffer shared by the weights of its
            shape (`fp4_dist.compute.lean`); the same values. `NVFP4Tensor.compute_copy` sets it per weight later.
        shared_amax: sibling linears whose weights share one amax, by leaf name, e.g.
            ``(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))`` (`fp4_dist.export.VLLM_FUSED`): under each
            parent module the converted members of a tuple get one amax, the largest of theirs, here and in every
            later cast (`fp4_dist.shared_amax`), so an export gives each group one global scale (what vLLM's fused
            layers need). Listed in the report.
        compute: what the GEMMs of the layers this call converts read. "bf16" (default): the weights' values in
            their compute dtype. "fp8": each weight's FP8 block copy (1 byte per weight, made once per update from
            the NVFP4 bytes), the activations and gradients quantized to FP8 per 1 x 128, by cuBLAS's block-scaled
            GEMMs on Hopper (sm_90) and emulated on the CPU (docs/fp8.md). Only `NVFP4Linear` layers (converted
            plain nn.Linear, now or by an earlier call) compute in FP8; the report names the other linears holding
            NVFP4 weights (subclasses, plain owners of a tied weight), which compute in bf16. The FP8 copies take
            1 byte per weight beside the packed 0.5 (docs/fp8.md: what else a step holds for a while). "nvfp4":
            the NVFP4 training recipe, every GEMM on NVFP4 operands, emulated (CPU, and CUDA GPUs of sm_80 to
            sm_90 by CuPy kernels; docs/nvfp4_recipe.md).
        options: the compute mode's options, an instance of its row's ``options`` type (``compute="nvfp4"``:
            `fp4_dist.compute.nvfp4.Nvfp4Recipe`, which also names the linears kept in bf16); None: its defaults.
        verbose: print the report.
    Returns:
        ConversionReport naming converted, skipped (with the reason) and tied weights.
    Raises:
        TypeError if `model` is not an nn.Module; ValueError if it is sharded already, if `dtype` is not one
        NVFP4 weights compute in, or for an unknown `compute` or ``compute="fp8"`` with ``compute_copy=True``;
        RuntimeError, before converting anything, if ``compute="fp8"`` and a weight is on a device where the FP8
        GEMMs do not run (a GPU other than sm_90: the sentence says what they need).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_linear_weights: model must be an nn.Module, got {type(model).__name__}")
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ValueError(f"convert_linear_weights: dtype must be None (each linear's own) or one of {MODEL_DTYPES}, "
                         f"got {dtype}")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            "convert_linear_weights: this model is already sharded (its parameters are DTensors, e.g. by torch's "
            "fully_shard); convert the unsharded model, or shard it with fp4_dist.fsdp.fully_shard_nvfp4, which "
            "converts the linear weights itself")
    mode = mode_named(compute, "convert_linear_weights")
    check_options(mode, options, "convert_linear_weights")
    if compute_copy and not mode.kept_copies:
        raise ValueError(f"convert_linear_weights: compute={compute!r} reads {mode.gemms_read}, never a bf16 "
                         "compute copy: leave compute_copy False")
    why = prepare(mode, {p.device for p in model.parameters() if p.device.type != "meta"})
    if why is not None:
        raise RuntimeError(f"convert_linear_weights: {why}; convert with compute={DEFAULT!r} (the default)")
    owners = weight_owners(model)
    report, done = ConversionReport(compute=compute), {}
    linears = {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    skip = skipped_linears(model, skip, "convert_linear_weights")
    kept = {name: _kept_reason(name, w, skip) for name, w in linears.items() if not is_nvfp4_tensor(w)}
    patterns = check_patterns(shared_amax) if shared_amax else ()
    groups = _amax_groups(linears, kept, patterns, dtype) if patterns else {}
    if patterns:
        warn_shared_amax("convert_linear_weights", kept, patterns, bool(groups), stacklevel=3)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if id(w) in done:  # tied to a linear converted above: it holds the same NVFP4 parameter already
            continue
        if is_nvfp4_tensor(w):
            continue
        why = kept[name]
        if why:
            report.skipped[name] = why
        else:
            group, shared = groups.get(f"{name}.weight", (None, None))
            q = quantize(w.detach(), numerics=numerics, dtype=model_dtype_of(w, dtype), name=f"{name}.weight",
                         amax=shared)  # fmt: skip
            q.compute_copy = compute_copy
            others = [o for o in owners[id(w)] if o[0] is not module]
            new = install_nvfp4(module, q, f"{name}.weight", w.requires_grad, [(o, attr) for o, attr, _ in others])
            if group is not None:
                setattr(new, AMAX_GROUP_ATTR, group)
                report.shared_amax[f"{name}.weight"] = group
            if others:
                report.tied[name] = [f"{qual}.{attr}" if qual else attr for _, attr, qual in others]
            done[id(w)] = new
            # An optimizer built before this call still holds `w`, which no longer gets gradients: let it say so.
            w._fp4_dist_replaced_by = f"{name}.weight"
            report.converted.append(name)
    if compute != DEFAULT:
        _set_compute(model, report, mode.options and (options or mode.options()))
    if any(why != "listed in skip" for why in report.skipped.values()):
        warnings.warn(str(report), stacklevel=2)
    if verbose:
        print(report)
    return report


def _set_compute(model: nn.Module, report: ConversionReport, options=None) -> None:
    """Every NVFP4Linear of `model` (converted by this call or before) computes in the report's mode, but those the
    mode's `options` keep in the default mode; `report` lists them, and names each other linear holding an NVFP4
    weight, which computes in the default mode, with the reason."""
    layers = [(n, m) for n, m in model.named_modules() if type(m) is NVFP4Linear and is_nvfp4_tensor(m.weight)]
    kept = options.kept_in_default([n for n, _ in layers]) if options is not None else {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not is_nvfp4_tensor(module.weight):
            continue
        if type(module) is NVFP4Linear and name in kept:
            module.fp4_compute, module.fp4_options = DEFAULT, None
            report.not_in_mode[name] = f"kept in {DEFAULT} by the {report.compute} mode's options: {kept[name]}"
        elif type(module) is NVFP4Linear:
            module.fp4_compute, module.fp4_options = report.compute, options
            report.in_mode.append(name)
        elif type(module) is nn.Linear:
            report.not_in_mode[name] = ("a plain nn.Linear sharing another layer's NVFP4 weight computes through the "
                                        f"weight's dispatch, in {DEFAULT}")  # fmt: skip
        else:
            report.not_in_mode[name] = (f"{type(module).__name__} keeps its own forward (a subclass of nn.Linear), "
                                        f"which computes through the weight's dispatch, in {DEFAULT}")  # fmt: skip


def model_dtype_of(w: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype an NVFP4 weight made from `w` computes in: `dtype` if given, else `w`'s own when NVFP4 weights can
    compute in it, else bf16."""
    return dtype or (w.dtype if w.dtype in MODEL_DTYPES else torch.bfloat16)


def install_nvfp4(module: nn.Module, q, name: str, requires_grad: bool, others=()) -> nn.Parameter:
    """Make `q` the ``weight`` parameter of `module` (and the `others` (module, attribute) owners of a tied weight),
    named `name` in messages; a plain nn.Linear becomes an `NVFP4Linear` (its forward is F.linear, so computing
    with the layer's cached view of the compute copy is the same)."""
    new = nn.Parameter(q, requires_grad=requires_grad)
    new.fp4_dist_name = name
    for owner, attr in [(module, "weight"), *others]:
        setattr(owner, attr, new)
    if type(module) is nn.Linear:
        ready_for_compile()
        module.__class__ = NVFP4Linear
    return new


def skipped_linears(model: nn.Module, skip, who: str) -> set:
    """The linear layers `skip` names: each entry a module name as in ``named_modules``, a linear or a module
    holding linears (all of them). Raises ValueError naming entries that name no module, or no linear: a typo
    would leave the layer it meant in 4 bits without a word."""
    if isinstance(skip, str):
        raise TypeError(f"{who}: skip is a sequence of module names, got the string {skip!r}")
    modules = dict(model.named_modules())
    linears = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
    out, unknown = set(), []
    for entry in skip:
        under = [n for n in linears if n == entry or (entry in modules and n.startswith(entry + "."))]
        if not under:
            unknown.append(entry)
        out.update(under)
    if unknown:
        near = {e: difflib.get_close_matches(e, list(modules), n=2) for e in unknown}
        hints = "; ".join(f"{e!r}" + (f" (did you mean {' or '.join(map(repr, m))}?)" if m else "")
                          for e, m in near.items())  # fmt: skip
        raise ValueError(f"{who}: skip names no linear layer of this model: {hints}. Entries are module names as "
                         "model.named_modules() gives them, of a linear or of a module holding linears")
    return out


def _kept_reason(name: str, w: torch.Tensor, skip) -> Optional[str]:
    """Why the linear `name` keeps its high-precision weight `w`, or None when it is converted."""
    if name in skip:
        return "listed in skip"
    if w.shape[1] % TILE:
        return f"in_features = {w.shape[1]} is not a multiple of {TILE}"
    if not torch.isfinite(w).all():
        return "weight holds non-finite values"
    return None


def _amax_groups(linears: dict, kept: dict, patterns, dtype) -> dict:
    """{weight name: (AmaxGroup, its shared amax)} of the sibling groups among the linears this call converts
    (`kept`: linear name -> why it keeps its weight, None for those converted)."""
    out = {}
    for g in sibling_groups([name for name, why in kept.items() if why is None], patterns):
        ws = [linears[m[: -len(".weight")]] for m in g.members]
        shared = group_amax(ws, model_dtype_of(ws[0], dtype))
        out.update({m: (g, shared) for m in g.members})
    return out


def warn_shared_amax(who: str, kept: dict, patterns, formed: bool, stacklevel: int) -> None:
    """Say what the `shared_amax` patterns did not do: form any group of siblings, or keep a group whole (a member
    kept in high precision). `kept`: every linear looked at -> why it stays in high precision, None if NVFP4."""
    split = []
    for g in sibling_groups(list(kept), patterns):
        stays = [m for m in g.members if kept[m[: -len(".weight")]]]
        if stays and len(stays) < len(g.members):
            split += [f"{m[: -len('.weight')]} (of {', '.join(g.members)})" for m in stays]
    if split:
        warnings.warn(f"{who}: some shared_amax groups are split, a member kept in high precision "
                      f"({'; '.join(split[:4])}{' ...' if len(split) > 4 else ''}): their other members share an "
                      "amax, but a fused layer (vLLM's qkv) cannot hold a high-precision member with NVFP4 ones",
                      UserWarning, stacklevel=stacklevel)
    if not formed:
        warnings.warn(f"{who}: shared_amax {list(patterns)} forms no group of sibling linears in this model (each "
                      "pattern names leaf modules of one parent, e.g. 'q_proj'), so no weights share an amax",
                      UserWarning, stacklevel=stacklevel)


def weight_owners(model: nn.Module) -> dict:
    """{id(parameter): [(module, attribute, module name)]} over every module, shared parameters included."""
    owners: dict = {}
    for qual, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            entry = (module, attr, qual)
            if not any(e[0] is module and e[1] == attr for e in owners.setdefault(id(p), [])):
                owners[id(p)].append(entry)
    return owners
