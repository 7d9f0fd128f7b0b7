"""Megatron-Core GPTModel (local transformer implementation) with NVFP4 linear weights from init.

TransformerEngine creates NVFP4 parameters inside ``fp8_model_init`` while the layers are built; without TE,
Megatron builds plain bf16 weights. Here the same effect is reached right after construction, before DDP
wraps the model (i.e. still at model init): the four linear weights of every transformer layer
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, as in Megatron's NVFP4 recipe) become
``nn.Parameter(fp4_dist.NVFP4Tensor)`` carrying the Megatron parameter attributes of the weight they
replace. Embeddings, norms, biases and the output layer stay bf16; with ``config.first_last_layers_bf16``
the first ``num_layers_at_start_in_bf16`` and last ``num_layers_at_end_in_bf16`` layers stay bf16 too.

The bf16 init value is kept on the parameter (``get_high_precision_init_val`` /
``clear_high_precision_init_val``, the names Megatron's DistributedOptimizer probes at DO 428-441), so the
fp32 master starts from the bf16 init exactly as in a bf16 run, not from its lossy NVFP4 dequantization.

``weights="fake-nvfp4"`` builds the comparison model: bf16 weights whose forward uses
``quantize(w).dequantize()`` (straight-through gradient), i.e. what an NVFP4 param-gather run computes.
"""

from __future__ import annotations

import types
from typing import Iterable, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..compute.modes import DEFAULT, check_options, mode_named
from ..format import DEFAULT_NUMERICS, TILE
from ..quantize import quantize
from ..tensor import is_nvfp4_tensor
from .parallel import collective_device, reduce_whole_amaxes, tensor_parallel_group

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

__all__ = ["WEIGHT_MODES", "build_gpt_model", "nvfp4_weight_names", "convert_to_nvfp4",
           "apply_fake_quant", "nvfp4_parameters"]

WEIGHT_MODES = ("bf16", "nvfp4", "fake-nvfp4")


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    weights: str = "bf16",
    numerics: str = DEFAULT_NUMERICS,
    position_embedding_type: str = "learned_absolute",
    share_embeddings_and_output_weights: bool = True,
    device: Optional[torch.device] = None,
    compute_copy: bool = False,
    compute: str = DEFAULT,
    compute_options=None,
) -> nn.Module:
    """GPTModel with the local layer spec, wrapped in Megatron's Float16Module when ``config.bf16``.

    Args:
        weights: "bf16" (plain), "nvfp4" (NVFP4Tensor linear weights) or "fake-nvfp4" (bf16 weights,
            NVFP4 fake-quantized in the forward).
        device: where the model lives; it is moved there before the NVFP4 conversion (moving an NVFP4
            parameter afterwards would rebuild it without Megatron's parameter attributes).
        compute_copy: NVFP4 weights keep a model-dtype compute copy between updates (default False, lean: a copy
            around each use; `fp4_dist.NVFP4Tensor.compute_copy`).
        compute: what the NVFP4 layers' GEMMs read, a name in `fp4_dist.compute.modes.MODES` (`convert_to_nvfp4`).
        compute_options: that mode's options (`convert_to_nvfp4`'s ``options``; None: its defaults).
    Raises:
        ValueError naming every linear weight whose K (in_features) is not a multiple of 16, before any
        weight is converted.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    model: nn.Module = GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
    )
    if config.bf16 or config.fp16:
        # Before the conversion: Float16Module casts every parameter, and NVFP4 weights already have
        # their model dtype.
        model = Float16Module(config, model)
    if device is not None:
        model = model.to(device)
    if weights == "nvfp4":
        convert_to_nvfp4(model, config, numerics=numerics, compute_copy=compute_copy, compute=compute,
                         options=compute_options)
    elif weights == "fake-nvfp4":
        apply_fake_quant(model, config, numerics=numerics)
    return model


def _gpt(model: nn.Module) -> GPTModel:
    from megatron.core.distributed import DistributedDataParallel

    outer = type(model).__name__
    while not isinstance(model, GPTModel):
        if isinstance(model, DistributedDataParallel):
            raise ValueError(
                "fp4_dist.megatron: convert_to_nvfp4 got a model already wrapped in DistributedDataParallel; its "
                "buffers were laid out for bf16 weights, so NVFP4 weights put in now would never be cast from the "
                "updated masters. Convert the model before wrapping it in DDP (after Float16Module and .cuda()), "
                "or run through `python -m fp4_dist.megatron.run`, which converts at that moment")
        if not hasattr(model, "module"):
            raise TypeError(
                f"fp4_dist.megatron: --fp4-param-gather converts the transformer-layer linear weights of Megatron's "
                f"GPTModel (possibly wrapped in Float16Module); this model is a {outer}, which fp4_dist does not "
                "convert. Drop --fp4-param-gather for it")
        model = model.module
    return model


def _check_supported(gpt: GPTModel, config: TransformerConfig) -> None:
    """Refuse the model parts whose weights fp4_dist cannot make NVFP4 parameters, before any is converted."""
    for name, module in gpt.named_modules():
        kind = type(module)
        if kind.__module__.startswith("megatron.core.extensions.transformer_engine"):
            raise ValueError(
                "fp4_dist.megatron: --fp4-param-gather needs Megatron's local transformer layers (--transformer-impl "
                f"local); {name} is a TransformerEngine module ({kind.__name__}), whose own NVFP4 path needs a "
                "Blackwell GPU")
        if kind.__name__ in ("GroupedMLP", "TEGroupedMLP"):
            raise ValueError(
                f"fp4_dist.megatron: --fp4-param-gather with grouped-GEMM experts ({name}: {kind.__name__}, "
                "--moe-grouped-gemm) is not supported: their weights are one tensor for all local experts. Drop "
                "--moe-grouped-gemm: each expert is then its own linear layers (SequentialMLP), whose weights are "
                "NVFP4")
    for name, p in gpt.named_parameters():
        if hasattr(p, "main_grad"):
            raise ValueError(
                f"fp4_dist.megatron: {name} already has a DDP main_grad: the model was wrapped in "
                "DistributedDataParallel before the conversion. Convert it first (after Float16Module and .cuda(), "
                "before DDP)")


def _bf16_layer(layer_number: int, config: TransformerConfig) -> bool:
    if not config.first_last_layers_bf16:
        return False
    return (layer_number <= config.num_layers_at_start_in_bf16
            or layer_number > config.num_layers - config.num_layers_at_end_in_bf16)


def _layer_linears(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name within the layer, module) of the layer's Megatron parallel linears with a weight: attention and MLP
    projections, and in MoE layers every local expert's and the shared experts' (the router is not one: it stays
    in high precision, as do norms)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [(name, m) for name, m in layer.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and getattr(m, "weight", None) is not None]


def nvfp4_weight_names(model: nn.Module, config: TransformerConfig) -> list[str]:
    """Names (relative to the GPTModel) of the linear weights that become NVFP4, in layer order. Layers kept in bf16
    by ``--first-last-layers-bf16`` are chosen by their global layer number (``layer.layer_number``, which counts
    across pipeline stages and virtual stages), as Megatron counts them."""
    return [name for name, _ in _linear_modules(model, config)]


def _linear_modules(model: nn.Module, config: TransformerConfig) -> list[tuple[str, nn.Module]]:
    gpt = _gpt(model)
    found = []
    for i, layer in enumerate(gpt.decoder.layers):
        if _bf16_layer(layer.layer_number, config):
            continue
        found += [(f"decoder.layers.{i}.{name}.weight", m) for name, m in _layer_linears(layer)]
    return found


def _check_k(named: Iterable[tuple[str, nn.Module]]) -> None:
    named = list(named)
    bad = [f"{name} [{w.shape[0]} x {w.shape[1]}]" for name, m in named for w in [m.weight] if w.shape[1] % TILE]
    split = [f"{name} [{w.shape[0]} x {w.shape[1]}]" for name, m in named for w in [m.weight]
             if getattr(w, "partition_dim", 1) == 0 and w.shape[0] % TILE and tensor_parallel_group(w) is not None]
    if split:
        raise ValueError(
            "--fp4-param-gather with tensor parallelism: each rank's slice of a column-parallel NVFP4 weight needs "
            f"a multiple of 16 rows (a 16x16 tile must not span two tensor-parallel ranks); these do not: "
            f"{', '.join(split)}. Choose sizes whose per-rank output rows are multiples of 16")
    if bad:
        raise ValueError(
            "--fp4-param-gather: NVFP4 weights need K (in_features, the last dim) % 16 == 0; these do not: "
            + ", ".join(bad)
            + ". Choose --hidden-size / --ffn-hidden-size / --kv-channels that are multiples of 16, or keep "
            "those layers in bf16 (--first-last-layers-bf16) or drop --fp4-param-gather"
        )


def _get_init(self) -> torch.Tensor:
    return self._fp4_dist_init_value


def _clear_init(self) -> None:
    for attr in ("_fp4_dist_init_value", "get_high_precision_init_val", "clear_high_precision_init_val"):
        self.__dict__.pop(attr, None)


def release_init_values(params) -> int:
    """Drop the bf16 init value of every NVFP4 weight among `params`; returns how many held one.

    Megatron's distributed optimizer reads (and clears) the init value only of the weights its rank owns a piece
    of; a weight owned whole by other data-parallel ranks would keep its bf16 copy for the whole run (half the bf16
    weights at data-parallel size 2, three quarters at 4). Once every rank has built its masters no one reads it.
    """
    held = 0
    for p in params:
        if is_nvfp4_tensor(p) and "_fp4_dist_init_value" in p.__dict__:
            _clear_init(p)
            held += 1
    return held


def convert_to_nvfp4(model: nn.Module, config: TransformerConfig, *, numerics: str = DEFAULT_NUMERICS,
                     compute_copy: bool = False, device: Optional[torch.device] = None,
                     compute: str = DEFAULT, options=None) -> list[str]:  # fmt: skip
    """Replace the NVFP4-eligible linear weights by ``nn.Parameter(NVFP4Tensor)`` in place; returns names.

    Call it after ``.cuda()`` and Float16Module and before DistributedDataParallel (a DDP-wrapped model is
    refused); weights that are NVFP4 already are left as they are, so a second call changes nothing. Each new
    parameter keeps the old one's Python attributes and serves its bf16 value through
    ``get_high_precision_init_val``, so the distributed optimizer's fp32 master starts from the bf16 init.

    A tensor-parallel slice is quantized with the whole weight's amax (one MAX all-reduce over each tensor-parallel
    group involved: a collective, call it on every rank), the rule every cast after an optimizer step follows, so the
    weights equal the slices of quantizing each whole weight from the first step on.

    Args:
        device: where the NVFP4 weights are made (default: where each weight is). Megatron's
            ``--use-cpu-initialization`` leaves the model on the host until DDP moves every parameter into its
            device buffers; NVFP4 weights are made on that device at once.
        compute: what the converted layers' GEMMs read, a name in `fp4_dist.compute.modes.MODES`
            (`fp4_dist.megatron.mode_linear`); a layer's choice, made here, so that models of several modes can
            train in one process.
        options: the mode's options (an instance of its row's ``options`` dataclass: `AdapterOptions.mode_options`,
            from ``--compute-option``), each converted layer's ``fp4_options``; None: the mode's defaults.
    Raises for models and layers fp4_dist does not convert (not a GPTModel, grouped-GEMM experts,
    TransformerEngine linears) and for shapes NVFP4 cannot tile, before any weight is converted.
    """
    mode = mode_named(compute, "convert_to_nvfp4")
    check_options(mode, options, "convert_to_nvfp4")
    if compute_copy and not mode.kept_copies:
        raise ValueError(f"convert_to_nvfp4: the {mode.name} compute mode keeps no bf16 compute copy; leave "
                         "compute_copy False")
    _check_supported(_gpt(model), config)
    named = [(n, m) for n, m in _linear_modules(model, config) if not is_nvfp4_tensor(m.weight)]
    _check_k(named)
    olds = [m.weight for _, m in named]
    inits = [w.detach().to(device=device or w.device, dtype=config.params_dtype) for w in olds]
    amaxes = reduce_whole_amaxes(olds, _slice_amaxes(inits))
    for (name, module), old, init, amax in zip(named, olds, inits, amaxes):
        q = quantize(init, numerics=numerics, dtype=config.params_dtype, name=name,
                     amax=amax.reshape(1).to(init.device))  # fmt: skip
        q.compute_copy = compute_copy
        new = nn.Parameter(q, requires_grad=old.requires_grad)
        for attr, value in vars(old).items():  # Megatron's TP / DDP attributes (tensor_model_parallel, ...)
            if attr != "_is_param":
                setattr(new, attr, value)
        new._fp4_dist_init_value = init
        new.fp4_dist_name = name  # how fp4_dist's errors name it (the parameter's name)
        new.get_high_precision_init_val = types.MethodType(_get_init, new)
        new.clear_high_precision_init_val = types.MethodType(_clear_init, new)
        module.weight = new
        module.fp4_compute, module.fp4_options = compute, options
    return [name for name, _ in named]


def _slice_amaxes(inits: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [n]: max|x| of each weight (already in its model dtype) on the device of the first, where the
    tensor-parallel all-reduce runs (the process group's device)."""
    if not inits:
        return torch.zeros(0, dtype=torch.float32)
    return torch.stack([w.abs().max().to(device=inits[0].device, dtype=torch.float32) for w in inits])


class _FakeQuant(torch.autograd.Function):
    """y = dequantize(quantize(w)) in w's dtype; dL/dw = dL/dy (what an NVFP4 parameter's autograd gives). A
    tensor-parallel slice is quantized with the whole weight's amax (`group`: its tensor-parallel group), as an NVFP4
    weight's slice is cast, so that the reference equals the NVFP4 run under tensor parallelism too."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, numerics: str, group=None) -> torch.Tensor:
        w = weight.detach()
        amax = None
        if group is not None:
            amax = reduce_whole_amaxes([weight], _slice_amaxes([w]).to(collective_device()))[:1].to(w.device)
        return quantize(w, numerics=numerics, dtype=weight.dtype, amax=amax).dequantize(weight.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _FakeQuantParametrization(nn.Module):
    def __init__(self, numerics: str) -> None:
        super().__init__()
        self.numerics = numerics

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _FakeQuant.apply(weight, self.numerics, tensor_parallel_group(weight))


def apply_fake_quant(model: nn.Module, config: TransformerConfig, *, numerics: str = DEFAULT_NUMERICS) -> list[str]:
    """Make the NVFP4-eligible linear weights fake-quantized in the forward (bf16 storage kept)."""
    named = _linear_modules(model, config)
    _check_k(named)
    for _, module in named:
        parametrize.register_parametrization(module, "weight", _FakeQuantParametrization(numerics),
                                             unsafe=True)
    return [name for name, _ in named]


def nvfp4_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every NVFP4 parameter of ``model``, in ``named_parameters`` order."""
    return [(n, p) for n, p in model.named_parameters() if is_nvfp4_tensor(p)]
