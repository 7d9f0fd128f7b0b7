"""fp4_dist as the NVFP4 backend of Megatron-Core's ``--fp4-param-gather`` path: the one hook table.

Megatron-Core 0.19.2 already runs NVFP4 param all-gathers through its DDP buffers and DistributedOptimizer
(the project's megatron-core reference notes, sections 1-3), but it reaches TransformerEngine (Blackwell-only)
for the tensor type, the storage remap, the shard cast and the post-all-gather processing, and it recomputes
the packed byte layout with its own padding, so ranks can all-gather bytes they never wrote (dp 3, 6, ...).

This module is the index of every patch fp4_dist makes to megatron-core and megatron.training: one row of `HOOKS`
per patch (target, replacement, reason, tested version). The replacements live by concern: `buffers` (the byte
path), `startup` (arguments, refusals, conversion before DDP), `checkpoint`, `layers` (the compute path),
`monitor` (checks inside the loop), `cpu_compat` (CPU ranks, gloo); `patching` is the engine. `install` /
`uninstall` are exact inverses (the original objects are put back).

Layout rule installed here:

    element layout (grads, masters, optimizer shards)   Megatron's own: params 64-aligned, buckets padded
                                                        to lcm(2*dp, 128) so every rank shard is even
    packed layout (uint8 NVFP4 param buffer)            derived: byte offset = element offset / 2

so rank r's byte shard of a bucket is exactly half its element shard and holds exactly the nibbles it cast.
"""


from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import torch

from . import buffers, checkpoint, cpu_compat, gradnorm, layers, startup
from .buffers import derive_packed_layout, resolve_cast_checks  # noqa: F401 (public through the adapter)
from .monitor import MONITOR
from .options import AdapterOptions, current_options, set_options
from .patching import (TESTED_VERSIONS, Hook, check_megatron_version, installed_megatron_version,  # noqa: F401
                       patch, python_311_shim, unpatch)
from .startup import refuse_unsupported_args  # noqa: F401

_PGB = "megatron.core.distributed.param_and_grad_buffer"
_DO = "megatron.core.optimizer.distrib_optimizer"
_OPT = "megatron.core.optimizer.optimizer"
_CLIP = "megatron.core.optimizer.clip_grads"
_FP4 = "megatron.core.fp4_utils"
_FP8 = "megatron.core.fp8_utils"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_ARGS = "megatron.training.arguments"
_ARGU = "megatron.training.argument_utils"
_TPL = "megatron.core.tensor_parallel.layers"
_TRAINING = "megatron.training.training"
_INIT = "megatron.training.initialize"
_DIST_UTILS = "megatron.training.models.dist_utils"
_DATASET_UTILS = "megatron.core.datasets.utils"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_MOE_DISPATCH = "megatron.core.transformer.moe.token_dispatcher"


_GLOO = cpu_compat.GlooCoalescing()

HOOKS: tuple[Hook, ...] = (
    Hook((_FP4, _PGB, _DO), "is_nvfp4tensor", buffers.make_is_nvfp4tensor,
         "recognise fp4_dist.NVFP4Tensor: uint8 buffer key (pgb _param_uses_quantized_storage), packed layout, "
         "no bf16 shard view / no bf16 copy in DistOpt (DO 405-412, 2852-2876), NVFP4 cast-target list (DO 2677)"),
    Hook((_FP4, _PGB), "modify_nvfp4_rowwise_storage", buffers.make_modify_storage,
         "alias the weight's packed rowwise bytes to its slice of the DDP uint8 param buffer (pgb 1262-1269)"),
    Hook((_FP4, _DO), "quantize_nvfp4_param_shard", buffers.make_shard_cast,
         "shard cast of the fp32 masters into the owned nibbles + all scales/amax via "
         "fp4_dist.cast_master_weights_to_nvfp4 instead of TE (DO 2843-2847)"),
    Hook((_FP8, _PGB), "post_all_gather_processing", buffers.make_post_all_gather,
         "after the byte all-gather, per bucket group in _post_param_sync (pgb 332-337): one launch refreshes "
         "the weights' compute copies (columnwise copies only with AdapterOptions.columnwise); non-fp4_dist "
         "params still go to the original"),
    Hook((_PGB,), "_ParamAndGradBuffer._compute_nvfp4_packed_layout", buffers.make_packed_layout,
         "packed byte layout derived as element layout / 2 (upstream re-pads in byte space: stale bytes at "
         "dp 3 with 64x64, dp 2 with 40x48; pgb 1431-1516)"),
    Hook((_DO,), "pad_bucket_end", buffers.make_pad_bucket_end,
         "bucket ends padded to lcm(2*dp, 128) so every rank's element shard is even (same as upstream unless "
         "dp is a multiple of 128; DO 542-550)"),
    Hook((_ARGS,), "validate_args", startup.make_validate_args,
         "--fp4-param-gather selects fp4_dist here, not TransformerEngine: validate_args would demand --fp4-format "
         "(TE >= 2.7); what fp4_dist does not serve is refused first (refuse_unsupported_args), then the flag is "
         "hidden from it and restored"),
    Hook((_ARGS,), "_print_args", startup.make_print_args,
         "validate_args prints its argument table inside the checks that run with --fp4-param-gather hidden (above): "
         "the table shows the flag on, as the run uses it (arguments 1904)"),
    Hook((_ARGU, _ARGS), "core_transformer_config_from_args", startup.hiding_fp4_param_gather,
         "the TransformerConfig's fp4_param would ask TE for NVFP4 model init (and refuses it without --fp4-format); "
         "fp4_dist converts the weights itself. Bound in argument_utils (its home, and gpt_config_from_args's) and "
         "re-exported by arguments, where pretrain_gpt.py and gpt_builders.py import it from"),
    Hook((_TRAINING,), "wrap_model_chunks_with_ddp",
         startup.converting_before_ddp("model_chunks", startup.training_wrapper),
         "the model_provider route (get_model): convert the linear weights to NVFP4 after .cuda() and Float16Module, "
         "before DDP and the distributed optimizer (training.py 1570, 1880)"),
    Hook((_DIST_UTILS,), "_ddp_wrap", startup.converting_before_ddp("model", startup.dist_utils_wrapper),
         "the model-builder route (GPTModelBuilder.build_distributed_models, pretrain_gpt.py's): the same moment "
         "(models/dist_utils.py 189, after _wrap_with_mp_wrapper; a pre_wrap_hook runs before .cuda() and "
         "Float16Module)"),
    Hook((_DATASET_UTILS,), "compile_helpers", startup.make_compile_helpers,
         "initialize_megatron runs `make` for the dataset helpers and exits when it fails; the wheel ships them "
         "compiled without a Makefile: skip the build when the module imports"),
    Hook((_TRAINING,), "setup_model_and_optimizer", MONITOR.wrap_setup,
         "hand the model and optimizer pretrain() builds to fp4_dist.megatron.monitor (the master digest after "
         "setup with AdapterOptions.log_json; nothing otherwise)"),
    Hook((_TRAINING,), "train_step", MONITOR.wrap_train_step,
         "after each of megatron.training's steps: the parity check every AdapterOptions.check_every iterations "
         "and the run record (both off by default); before each, the cast verdicts a captured graph cannot read"),
    Hook((_INIT, _TRAINING), "initialize_megatron", startup.make_initialize_megatron,
         "initialize.py:66 asserts torch.cuda.is_available() unless allow_no_cuda; the CPU layer covers the rest",
         cpu_only=True),
    Hook((_ARGS,), "get_device_arch_version", lambda original: (lambda: 0),
         "validate_args reads the CUDA architecture for tensor parallel performance hints; a CPU rank has none",
         cpu_only=True),
    Hook((_DDP,), "DistributedDataParallel.__init__", startup.make_ddp_init,
         "NVFP4 weights with fp4_param_gather or the distributed optimizer off would sit in the bf16 buffer and "
         "never be cast from the updated masters (they silently stop training): refused at construction"),
    Hook((_DO,), "DistributedOptimizer.__init__", startup.make_distrib_optimizer_init,
         "upstream clears a quantized weight's high-precision init value only where its rank owns a piece of it "
         "(DO 431-439): the bf16 init of a weight owned by other data-parallel ranks stayed alive all run (half the "
         "bf16 weights at dp 2, 3/4 at dp 4); every NVFP4 weight's is released once the masters are built"),
    Hook((_DO,), "DistributedOptimizer._set_main_param_and_optimizer_states", checkpoint.make_set_states,
         "loading Megatron's own dp_zero optimizer checkpoint (load_parameter_state) with the torch.optim "
         "fallback raises KeyError('step') (DO 1219-1226); keys the file lacks keep their restored value"),
    Hook((_DO,), "DistributedOptimizer.reload_model_params", checkpoint.make_reload_model_params,
         "a load without the optimizer state (--finetune, --no-load-optim) rebuilds the masters from the loaded "
         "4-bit weights (DO 3067-3127); cast the weights again from them and gather, as after a step, so they are "
         "quantize(master): a loaded -0 code would read +0 and fail the after-setup check (inherited method)"),
    Hook((_DO,), "DistributedOptimizer.load_state_dict", checkpoint.make_load_state_dict,
         "with the torch.optim fallback every param's Adam state gets one shared 'step' tensor on load (DO "
         "1024-1031), advanced once per param by the next step: resumed runs diverge; give each its own copy"),
    Hook((_OPT,), "MegatronOptimizer._filter_grads_for_norm", gradnorm.make_filter_grads_for_norm,
         "sum the gradient norm in the model's parameter order, not the per-dtype buffers' (OPT 231-278): the clip "
         "coefficient of an fp4 run then equals its bf16 and fake-quantization runs' at data-parallel size 1"),
    Hook((_CLIP,), "l2_norm_impl", gradnorm.make_l2_norm,
         "without TE or Apex the fallback l2 norm reads every gradient tensor's norm to the host (utils 1331: one "
         "device sync each; 63 per step at GPT 4096 TP 2 x DP 2 with --fp4-param-gather, 40 in bf16): the same "
         "norms read in one copy and reduced on the host as upstream does, the same bits; TE's or Apex's kernel stays"),
    Hook((_DO,), "DistributedOptimizer._is_distopt_quantized_param", buffers.make_is_distopt_quantized,
         "false for fp4_dist.NVFP4Tensor without reading `param.data` (an alias through Python dispatch, for every "
         "NVFP4 weight in every step's _copy_main_params_to_model_params; DO 1125-1127, 2868): same answer"),
    Hook((_TPL,), "ColumnParallelLinear._forward_impl", layers.make_forward_impl,
         "compute with the layer's cached plain alias of its NVFP4 weight's compute copy (fp4_dist.compute.view: "
         "one C++ autograd node to the parameter) instead of the parameter, whose every op goes through Python "
         "dispatch (~15-20 us per use); same values and gradients (layers 1094-1098)"),
    Hook((_TPL,), "RowParallelLinear._forward_impl", layers.make_forward_impl,
         "the same for the row-parallel layers (layers 1424-1428)"),
    Hook((_TPL,), "LinearWithGradAccumulationAndAsyncCommunication.forward", layers.make_linear_forward,
         "lean compute (the default; not with --fp4-compute-copy): the node of a lean use keeps how to write its copy "
         "again; it saves the layer's alias of a pool buffer, as it saves any weight (layers 548)"),
    Hook((_TPL,), "LinearWithGradAccumulationAndAsyncCommunication.backward", layers.make_linear_backward,
         "lean compute: write the copy into the saved pool buffer again before upstream reads it (layers 585); "
         "one Python call per linear that the backward makes anyway, instead of saved-tensor hooks"),
    Hook((_TPL,), "ColumnParallelLinear._apply", layers.make_apply,
         "drop the layer's cached view before nn.Module._apply (.to/.cuda/.bfloat16) swaps the NVFP4 parameter in "
         "place: the swap poisons the grad accumulator the view's autograd node leads to, so the next backward "
         "would raise (inherited method: uninstall deletes the class attribute again)"),
    Hook((_TPL,), "RowParallelLinear._apply", layers.make_apply, "the same for the row-parallel layers"),
    Hook((_PGB,), "_coalescing_manager", lambda original: _GLOO.manager,
         "gloo returns wrong bytes for coalesced all-gathers of mixed dtypes (uint8 + bf16 bucket groups); "
         "issue each collective alone, still async when Megatron asks", cpu_only=True),
    Hook((_PGB,), "dist_all_gather_func", _GLOO.wrap,
         "hand all-gather work handles to the gloo coalescing stand-in", cpu_only=True),
    Hook((_PGB,), "dist_reduce_scatter_func", _GLOO.wrap,
         "hand reduce-scatter work handles to the gloo coalescing stand-in", cpu_only=True),
    Hook((_MOE_UTILS, _MOE_DISPATCH), "maybe_move_tensor_to_cpu", cpu_compat.make_host_copy,
         "the MoE all-to-all dispatcher's split sizes reach all_to_all_single as numpy arrays only from CUDA tensors "
         "(moe_utils 1184); on a CPU rank they become numpy arrays too", cpu_only=True),
)


UPSTREAM_LAYOUT = ("_ParamAndGradBuffer._compute_nvfp4_packed_layout", "pad_bucket_end")
"""Rows that make the packed layout element layout / 2; excluding them leaves megatron-core's own layout."""

_lock = threading.Lock()
_installed: Optional[list[tuple[Any, str, Any, bool]]] = None
"""What `patching.patch` replaced, for `uninstall`; None when not installed."""


def is_installed() -> bool:
    return _installed is not None


def install(*, cpu: Optional[bool] = None, allow_untested_version: bool = False,
            exclude: Sequence[str] = (), options: AdapterOptions = AdapterOptions()) -> None:
    """Patch every row of `HOOKS` into megatron-core (idempotent).

    Args:
        cpu: install the CPU/gloo rows and `cpu_compat` (default: when CUDA is not available).
        allow_untested_version: skip the version range check (a missing target still raises).
        exclude: names of rows to leave unpatched, e.g. `UPSTREAM_LAYOUT` to reproduce megatron-core's own
            packed layout (and its stale bytes) with everything else in place.
        options: `AdapterOptions` for the run (installing again with other options needs `uninstall` first).
    Raises:
        RuntimeError for a megatron-core version not in `TESTED_VERSIONS` or a missing hook target; nothing
        is patched then. ValueError when already installed with other options.
    """
    global _installed
    with _lock:
        if _installed is not None:
            if options != current_options():
                raise ValueError(f"fp4_dist.megatron is already enabled with {current_options()}; disable() it "
                                 f"before enabling with {options}")
            return
        version = installed_megatron_version()
        if not allow_untested_version:
            check_megatron_version(version)
        python_311_shim()
        cpu = (not torch.cuda.is_available()) if cpu is None else cpu
        unknown = set(exclude) - {h.name for h in HOOKS}
        if unknown:
            raise ValueError(f"exclude names rows that are not in the hook table: {sorted(unknown)}")
        rows = [h for h in HOOKS if (cpu or not h.cpu_only) and h.name not in exclude]
        if cpu:
            cpu_compat.enable()  # raises where CUDA is available, before anything is patched
        try:
            done = patch(rows)
        except BaseException:
            if cpu:
                cpu_compat.disable()
            raise
        _installed = done
        set_options(options)
        MONITOR.reset()


def uninstall() -> None:
    """Put back every original binding and disable `cpu_compat` (idempotent)."""
    global _installed
    with _lock:
        if _installed is None:
            return
        unpatch(_installed)
        _installed = None
        set_options(AdapterOptions())
        cpu_compat.disable()


def describe() -> str:
    """The hook table as text (for --help style output and the docs)."""
    lines = []
    for h in HOOKS:
        where = ", ".join(m.rsplit(".", 1)[-1] for m in h.modules)
        flag = " [CPU only]" if h.cpu_only else ""
        lines.append(f"{h.name} in {where}{flag} (tested {', '.join(h.tested)}): {h.reason}")
    return "\n".join(lines)
