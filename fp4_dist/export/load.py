"""Load a compressed-tensors NVFP4 checkpoint into NVFP4 weights: the stored codes, scales and amax, unchanged.

fp4_dist holds one E4M3 scale per 16x16 tile, so a checkpoint loads when its 1x16 scales repeat on the 16 rows of
each tile (fp4_dist's own export, or any writer that quantized with 16x16 tiles); otherwise the load refuses,
naming the first weight and tile that break it. The amax comes from fp4_dist's metadata when present; for
another writer's checkpoint it is derived from the global scale so that our decode matches its decode
(`global_scale.amax_for_global_scale`; the report counts scale values that would still differ).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..checkpoint import atomic
from .._user import user_stacklevel
from ..convert import install_nvfp4, model_dtype_of
from ..format import DEFAULT_NUMERICS, TILE, ceil_div, check_weight_shape
from ..kernels.reference import dequantize as reference_dequantize
from ..kernels.reference import expand_rowwise_scales
from ..tensor import NVFP4Tensor, is_nvfp4_tensor
from . import ct_format
from .global_scale import amax_for_global_scale

MASTERS_WARNING = (
    "fp4_dist: weights loaded from a 4-bit checkpoint. Fp32 masters made from them (Zero1Optimizer, "
    "fully_shard_nvfp4, Megatron's optimizer) start at these 4-bit values, which trains worse than starting from "
    "high-precision weights; to resume a run, load its own DCP or Megatron checkpoint, which holds the masters")


@dataclass
class LoadReport:
    nvfp4: list[str] = field(default_factory=list)
    """Weights set from packed NVFP4 tensors."""
    dense: list[str] = field(default_factory=list)
    derived_amax: dict[str, int] = field(default_factory=dict)
    """Weights whose amax was derived from the global scale (no fp4_dist metadata): {name: scale values whose
    decode factor differs from the checkpoint's, 0 when the decodes agree}."""
    missing: list[str] = field(default_factory=list)
    """Model tensors the checkpoint does not hold (left as they were)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors the model has no place for."""


def load_compressed_tensors(model: nn.Module, folder, *, strict: bool = True, verify: bool = True) -> LoadReport:
    """Set `model`'s weights from a compressed-tensors NVFP4 checkpoint folder, in place.

    Packed weights become NVFP4 parameters with the stored bytes (a plain nn.Linear becomes an `NVFP4Linear`, as
    `convert_linear_weights` does; an NVFP4 weight already there is overwritten field by field, keeping its
    storage). Other tensors are copied into the model's parameters and buffers, converted to their dtype. Build
    optimizers after loading. Warns that masters made from these weights start at 4-bit values.

    Args:
        strict: raise KeyError when a model tensor is missing from the checkpoint or a checkpoint tensor has no
            place in the model (as `load_state_dict`); False lists them in the report.
        verify: check every file against the folder's manifest first (`fp4_dist.checkpoint.manifest`); False
            skips the check.
    Raises:
        DamagedCheckpointError (a ValueError) naming the file and its first bad offset, when a file's bytes differ
        from the manifest; nothing is changed then.
        ValueError naming the weight and tile when a weight's scales are not constant within a 16x16 tile, or
        its shape differs from the model's; nothing is changed then.
    """
    folder = atomic.resolve(folder)
    tensors, amaxes, config = ct_format.read_checkpoint(folder, verify=verify)
    ct_format.check_format(config, folder)
    report = LoadReport()
    staged = {}
    for module_name in ct_format.nvfp4_modules(tensors):
        name = f"{module_name}.weight"
        staged[name] = _nvfp4_fields(model, module_name, tensors, amaxes.get(name), report)
    # Tensors only: a module's extra state (Megatron's ``_extra_state`` entries, None or bytes) is no weight, and an
    # export holds none
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    dense = {n: t for n, t in tensors.items() if not n.endswith(ct_format.SUFFIXES)}
    side = ct_format.read_side_fields(folder)
    for name in [n for n in dense if f"{n}.rowwise_data" in side and n in targets and is_nvfp4_tensor(targets[n])]:
        staged[name] = _side_fields(name, dense.pop(name), side, targets[name])
    report.unexpected = sorted(n for n in dense if n not in targets)
    loaded = {id(targets[n]) for n in list(staged) + list(dense) if n in targets}
    report.missing = [n for n, t in targets.items() if id(t) not in loaded]
    if strict and (report.missing or report.unexpected):
        raise KeyError(f"load_compressed_tensors: model tensors missing from {folder}: {report.missing[:5]}; "
                       f"checkpoint tensors with no place in the model: {report.unexpected[:5]} (strict=False "
                       "loads the rest)")
    for name, fields in staged.items():
        _install(model, name, fields)
        report.nvfp4.append(name)
    with torch.no_grad():
        for name, t in dense.items():
            if name in targets:
                dst = targets[name]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: the checkpoint holds {list(t.shape)}, the model {list(dst.shape)}")
                dst.copy_(t.to(dst.dtype))
                report.dense.append(name)
    warnings.warn(MASTERS_WARNING, UserWarning, stacklevel=user_stacklevel())
    return report


def _nvfp4_fields(model: nn.Module, module_name: str, tensors, amax: Optional[float], report: LoadReport) -> dict:
    name = f"{module_name}.weight"
    packed = tensors[f"{module_name}.weight_packed"]
    scale = tensors[f"{module_name}.weight_scale"]
    g = float(tensors[f"{module_name}.weight_global_scale"].reshape(-1)[0])
    m, k = check_weight_shape((packed.shape[0], packed.shape[1] * 2), name)
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise KeyError(f"{name}: the checkpoint holds this NVFP4 weight but the model has no module "
                       f"{module_name!r}") from None
    current = getattr(module, "weight", None)
    if current is None or tuple(current.shape) != (m, k):
        raise ValueError(f"{name}: the checkpoint holds [{m}, {k}], the model "
                         f"{list(current.shape) if current is not None else 'no weight'}")
    if packed.dtype != torch.uint8 or tuple(scale.shape) != (m, ceil_div(k, TILE)):
        raise ValueError(f"{name}: weight_packed must be uint8 [{m}, {k // 2}] and weight_scale [{m}, {k // TILE}] "
                         f"(got {packed.dtype} {list(packed.shape)}, {list(scale.shape)})")
    bytes_ = scale.contiguous().view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else \
        scale.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    compact = bytes_[0::TILE]
    _check_tile_constant(name, bytes_, compact)
    if amax is None:
        amax, differ = amax_for_global_scale(g, compact)
        report.derived_amax[name] = differ
    if is_nvfp4_tensor(current):
        dtype, numerics = current.dtype, current.numerics
    else:
        dtype, numerics = model_dtype_of(current), DEFAULT_NUMERICS
    return dict(shape=(m, k), dtype=dtype, numerics=numerics, device=current.device,
                rowwise_data=packed.contiguous(), rowwise_scale_inv=expand_rowwise_scales(compact, m, k),
                amax=torch.tensor([amax], dtype=torch.float32))  # fmt: skip


def _side_fields(name: str, value: torch.Tensor, side: dict, current) -> dict:
    """The packed fields of an NVFP4 weight stored dense (a tied embedding), checked against its stored values."""
    f = {k: side[f"{name}.{k}"] for k in ("rowwise_data", "rowwise_scale_inv", "amax")}
    m, k = tuple(current.shape)
    decoded = reference_dequantize(f["rowwise_data"], f["rowwise_scale_inv"], f["amax"], value.dtype)
    if tuple(value.shape) != (m, k) or not torch.equal(decoded, value):
        raise ValueError(f"{name}: the dense tensor in the checkpoint is not the dequantize of its packed fields in "
                         f"{ct_format.SIDE_FILE} (was one of them edited?)")
    return dict(shape=(m, k), dtype=current.dtype, numerics=current.numerics, device=current.device, **f)


def _check_tile_constant(name: str, bytes_: torch.Tensor, compact: torch.Tensor) -> None:
    m = bytes_.shape[0]
    expanded = compact.repeat_interleave(TILE, dim=0)[:m]
    bad = (expanded != bytes_).nonzero()
    if bad.numel():
        r, c = (int(v) for v in bad[0])
        first = TILE * (r // TILE)
        raise ValueError(
            f"{name}: its scales are not constant within 16x16 tile (row band {r // TILE}, column block {c}): row "
            f"{r} holds scale byte 0x{int(bytes_[r, c]):02x}, row {first} holds 0x{int(bytes_[first, c]):02x}. "
            "fp4_dist keeps one E4M3 scale per 16x16 tile, so it loads checkpoints whose 1x16 scales repeat on each "
            "tile's 16 rows (fp4_dist's own export); one quantized with 1x16 blocks (llm-compressor, ModelOpt) "
            "cannot be held exactly. Nothing was loaded")


def _install(model: nn.Module, name: str, f: dict) -> None:
    module = model.get_submodule(name[: -len(".weight")])
    dev = f["device"]
    fields = {k: f[k].to(dev) for k in ("rowwise_data", "rowwise_scale_inv", "amax")}
    current = module.weight
    if is_nvfp4_tensor(current):
        with torch.no_grad():
            for k, t in fields.items():
                getattr(current, k).copy_(t)
        if current.columnwise_data is not None:
            current.make_columnwise()
        return
    q = NVFP4Tensor(f["shape"], f["dtype"], **fields, numerics=f["numerics"])
    install_nvfp4(module, q, name, current.requires_grad)
