"""fp4_dist as the NVFP4 backend of Megatron-Core's ``--fp4-param-gather`` path: the one hook table.

Megatron-Core 0.19.2 already runs NVFP4 param all-gathers through its DDP buffers and DistributedOptimizer
(notes: /work/shared/notes/megatron-core.md sections 1-3), but it reaches TransformerEngine (Blackwell-only)
for the tensor type, the storage remap, the shard cast and the post-all-gather processing, and it recomputes
the packed byte layout with its own padding, so ranks can all-gather bytes they never wrote (dp 3, 6, ...).

This module is the only place that patches megatron-core and megatron.training. Every patch is one row of `HOOKS`
(target, replacement, reason, tested version). A name bound by ``from x import name`` lives in every
importing module's globals, so a row lists every module that binds it and all of them are patched.
`install` / `uninstall` are exact inverses (the original objects are put back).

Layout rule installed here:

    element layout (grads, masters, optimizer shards)   Megatron's own: params 64-aligned, buckets padded
                                                        to lcm(2*dp, 128) so every rank shard is even
    packed layout (uint8 NVFP4 param buffer)            derived: byte offset = element offset / 2

so rank r's byte shard of a bucket is exactly half its element shard and holds exactly the nibbles it cast.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .. import tensor as _tensor
from ..compute_view import compute_view, forget
from ..lean import claim, is_lean, lean_call_refilled
from ..buffers.layout import packed_layout_of
from . import cpu_compat
from .monitor import MONITOR

TESTED_VERSIONS = ("0.19.1", "0.19.2")
"""megatron-core versions whose hook-table tests pass: the 0.19.2 wheel (CI) and a Megatron-LM ``core_r0.19.0``
source checkout, which reports 0.19.1 and carries the same ``megatron/training`` and hooked modules."""
_PGB = "megatron.core.distributed.param_and_grad_buffer"
_DO = "megatron.core.optimizer.distrib_optimizer"
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


@dataclass(frozen=True)
class Hook:
    """One patch: ``modules[i].<name>`` becomes ``make(original)`` for every module listed.

    ``name`` may be ``Class.attr`` to patch a class attribute. ``cpu_only`` rows are installed only when the
    run has no CUDA device (they work around gloo, see `cpu_compat`).
    """

    modules: tuple[str, ...]
    name: str
    make: Callable[[Any], Any]
    reason: str
    tested: tuple[str, ...] = TESTED_VERSIONS
    cpu_only: bool = False


# ------------------------------------------------------------------------------------------ replacements
def _make_is_nvfp4tensor(original):
    def is_nvfp4tensor(tensor) -> bool:
        return _tensor.is_nvfp4_tensor(tensor) or original(tensor)

    return is_nvfp4tensor


def _is_any_nvfp4(tensor) -> bool:
    """An fp4_dist weight or one of TransformerEngine's (Megatron's own test, through the patched binding)."""
    from megatron.core import fp4_utils

    return fp4_utils.is_nvfp4tensor(tensor)


def _make_modify_storage(original):
    def modify_nvfp4_rowwise_storage(param, new_rowwise_data) -> None:
        if not _tensor.is_nvfp4_tensor(param):
            return original(param, new_rowwise_data)
        param.set_rowwise_storage(new_rowwise_data)

    return modify_nvfp4_rowwise_storage


def _make_shard_cast(original):
    def quantize_nvfp4_param_shard(
        model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params=None
    ) -> None:
        ours = [_tensor.is_nvfp4_tensor(p) for p in model_params]
        if ours and not all(ours):
            raise TypeError(
                "fp4_dist.megatron: the NVFP4 param list mixes fp4_dist NVFP4Tensor weights with other NVFP4 "
                "types; build every NVFP4 weight with fp4_dist (fp4_dist.megatron.model) or none"
            )
        if not any(ours):
            return original(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params)
        from ..optim import cast_master_weights_to_nvfp4

        check = cast_master_weights_to_nvfp4(
            model_params,
            main_params,
            start_offsets,
            data_parallel_group,
            fsdp_shard_model_weights=fsdp_shard_model_params,
            manual_post_all_gather_processing=True,
            amax_group=_tensor_parallel_group(model_params),
            defer_check=True,
        )
        if check is not None:
            # A cast resolves its previous verdict itself: keep only the unread ones (bounded without a gather).
            _DEFERRED_CHECKS[:] = [c for c in _DEFERRED_CHECKS if c.ok is None] + [check]

    return quantize_nvfp4_param_shard


# The non-finite verdicts of the casts whose weights no post-all-gather processing has seen yet. Megatron calls
# the cast in the middle of its optimizer step, with the optimizer's device work still queued; waiting there for
# the verdict would leave the rest of the step's host work (its copy loop over every parameter, the param sync)
# to run on an idle device. The verdicts are read where the weights are next handed on instead: the first
# post-all-gather processing (in the step, or in the next forward's pre-hook with --overlap-param-gather), before
# any layer reads a weight, on every rank (the verdict is the all-reduced one).
_DEFERRED_CHECKS: list = []


def resolve_cast_checks() -> None:
    """Read the verdicts of the casts since the last call; raises ValueError naming the weight, on every rank,
    if a cast read a non-finite fp32 master (the weights were written from it: resume from a checkpoint)."""
    while _DEFERRED_CHECKS:
        _DEFERRED_CHECKS.pop(0).resolve(" in the fp32 master after the optimizer step, on some rank")


def _tensor_parallel_group(params):
    """The tensor-parallel group when these weights are TP slices (Megatron's column/row-parallel linears):
    their scales then use the whole weight's amax, as if the whole weight were quantized and then split."""
    from megatron.core import parallel_state

    if not any(getattr(p, "tensor_model_parallel", False) for p in params):
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _make_post_all_gather(original):
    def post_all_gather_processing(model_params) -> None:
        resolve_cast_checks()
        ours = [p for p in model_params if _tensor.is_nvfp4_tensor(p)]
        others = [p for p in model_params if not _tensor.is_nvfp4_tensor(p)]
        if ours:
            from ..optim import post_all_gather_processing as ours_post

            ours_post(ours, columnwise=_options.columnwise)
        if others:
            original(others)

    return post_all_gather_processing


@dataclass(frozen=True, kw_only=True)
class AdapterOptions:
    """Choices `install` makes for the whole Megatron run."""

    columnwise: bool = False
    """Build the columnwise NVFP4 copies after every param all-gather, as TransformerEngine does. Nothing in
    Megatron's compute path through fp4_dist reads them (linears run on each weight's compute copy), so by
    default they are not built: ``columnwise_data`` stays None and ``make_columnwise()`` builds it on demand."""
    numerics: str = "te"
    """Block-scale formula of the weights converted when Megatron wraps the model in DDP ("te" or "te-2.14")."""
    compute_copy: bool = True
    """Converted weights keep a bf16 compute copy between updates (False: dequantize on every use)."""
    check_every: int = 0
    """Every N training iterations of ``megatron.training``'s loop, check on every rank that the gathered NVFP4
    weights equal ``quantize(full fp32 master)`` and stop with an error if not (0: off)."""
    log_json: Optional[str] = None
    """Rank 0 writes the run's record here (per-iteration loss, checks, master digests; `monitor`)."""


_options = AdapterOptions()


def _make_pad_bucket_end(original):
    def pad_bucket_end(bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
        # Upstream pads to lcm(dp, 128[, 2**16]); its shard (end/dp) is odd when dp is a multiple of 128
        # (or 2**16), which would split a packed byte between two ranks. lcm(2*dp, ...) keeps every shard
        # even and equals upstream's divisor for every other dp.
        base = [2 * data_parallel_world_size, 128] + ([2**16] if pad_for_high_nccl_busbw else [])
        divisor = math.lcm(*base)
        return -(-bucket_end_index // divisor) * divisor

    return pad_bucket_end


def _make_packed_layout(original):
    def _compute_nvfp4_packed_layout(self, params_with_names) -> None:
        ours = [p for p, _ in params_with_names if _tensor.is_nvfp4_tensor(p)]
        if not ours:
            return original(self, params_with_names)
        self.nvfp4_packed_param_index_map, self.nvfp4_packed_bucket_indices, unpadded = derive_packed_layout(
            self.param_index_map, self.bucket_indices, dict((p, n) for p, n in params_with_names),
            self.data_parallel_world_size,
        )
        self.nvfp4_packed_numel_unpadded = unpadded

    return _compute_nvfp4_packed_layout


def derive_packed_layout(param_index_map, bucket_indices, names, dp_size: int):
    """Packed (byte) layout of a uint8 NVFP4 buffer = its element layout / 2.

    Args:
        param_index_map: {param: (start, end, bucket_id)} in elements (Megatron's layout).
        bucket_indices: [(start, end)] per bucket, in elements.
        names: {param: name} for error messages.
        dp_size: data-parallel size; every bucket's rank shard must be an even element count.
    Returns:
        (packed_param_index_map, packed_bucket_indices, packed_numel_unpadded).
    Raises:
        TypeError if a non-fp4_dist param shares the buffer (1 byte/element would break the halving);
        ValueError naming the param or bucket if any boundary is odd.
    """
    for param in param_index_map:
        if not _tensor.is_nvfp4_tensor(param):
            raise TypeError(
                f"fp4_dist.megatron: param {names.get(param, '<unnamed>')} ({type(param).__name__}, {param.dtype}) "
                "shares the uint8 NVFP4 buffer with fp4_dist NVFP4 weights; its bytes are not 2 elements per byte, so "
                "the packed layout cannot be element layout / 2. Do not combine --fp8-param-gather weights with "
                "--fp4-param-gather"
            )
    labels = {param: f"fp4_dist.megatron: param {names.get(param, '<unnamed>')}" for param in param_index_map}
    return packed_layout_of(param_index_map, bucket_indices, dp_size, labels)


def _hiding_fp4_param_gather(original):
    """Run Megatron's `original(args, ...)` with ``args.fp4_param_gather`` off: there the flag means
    TransformerEngine's NVFP4 (validate_args demands --fp4-format and TE >= 2.7; the transformer config would
    ask TE for NVFP4 model init). With fp4_dist enabled the flag selects fp4_dist's path instead, which the DDP
    config still receives (get_megatron_ddp_config reads args after this)."""

    def wrapper(args, *rest, **kwargs):
        on = getattr(args, "fp4_param_gather", False)
        args.fp4_param_gather = False
        try:
            return original(args, *rest, **kwargs)
        finally:
            args.fp4_param_gather = on or getattr(args, "fp4_param_gather", False)

    return wrapper


def _make_validate_args(original):
    hidden = _hiding_fp4_param_gather(original)

    def validate_args(args, *rest, **kwargs):
        out = hidden(args, *rest, **kwargs)
        refuse_unsupported_args(args)
        return out

    return validate_args


def refuse_unsupported_args(args) -> None:
    """Refuse, at start-up and on every rank, what fp4_dist's --fp4-param-gather path does not serve (each would
    otherwise fail deep inside a step, or train on without a word), and a checkpoint load that fails upstream."""
    problems = []
    load = getattr(args, "load", None)
    if load and _is_distributed_checkpoint(load) and not _have_te_or_apex():
        problems.append(
            f"--load {load}, a torch_dist checkpoint: megatron-core without TransformerEngine or apex "
            "cannot load a torch_dist distributed-optimizer checkpoint (distrib_optimizer.py asserts on the "
            "torch.optim fallback's missing state, bf16 runs too); save and load with --ckpt-format torch")
    step = getattr(args, "ckpt_step", None)
    latest = _latest_iteration(load) if load else None
    if (step is not None and latest not in (None, step) and getattr(args, "ckpt_format", None) == "torch"
            and getattr(args, "use_distributed_optimizer", False)):  # fmt: skip
        problems.append(
            f"--ckpt-step {step} with --ckpt-format torch: megatron-core loads the model from iteration {step} but "
            f"the distributed optimizer's fp32 masters from the latest iteration ({latest}, "
            "checkpointing.py reads the tracker file), so the run would silently continue from mismatched "
            f"weights; copy iter_{step:07d} into a folder of its own (with latest_checkpointed_iteration.txt "
            f"saying {step}) and --load that")
    if getattr(args, "fp4_param_gather", False):
        unsupported = [
            (getattr(args, "pipeline_model_parallel_size", 1) > 1, "--pipeline-model-parallel-size > 1"),
            (bool(getattr(args, "num_experts", None)), "--num-experts (MoE)"),
            (getattr(args, "transformer_impl", "local") == "transformer_engine",
             "--transformer-impl transformer_engine (use --transformer-impl local)"),
            (getattr(args, "fp16", False), "--fp16 (loss-scaled fp16 is not tested with NVFP4 weights; use --bf16)"),
            (getattr(args, "async_save", False), "--async-save (needs the torch_dist format; use --ckpt-format torch)"),
            (getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False),
             "--use-torch-fsdp2 / --use-megatron-fsdp (for FSDP2 use fp4_dist.fsdp.fully_shard_nvfp4)"),
            (not getattr(args, "use_distributed_optimizer", False), "a run without --use-distributed-optimizer"),
            (getattr(args, "data_parallel_random_init", False), "--data-parallel-random-init"),
            (getattr(args, "overlap_param_gather_with_optimizer_step", False),
             "--overlap-param-gather-with-optimizer-step"),
        ]
        problems += [f"--fp4-param-gather with {what} is not supported by fp4_dist" for bad, what in unsupported
                     if bad]  # fmt: skip
    if problems:
        raise ValueError("fp4_dist.megatron: " + "; ".join(problems))


def _is_distributed_checkpoint(path: str) -> bool:
    """Whether the checkpoint `--load` would read is in Megatron's distributed format (torch_dist): its iteration
    folder holds the format's metadata.json (the torch format writes mp_rank_* folders instead)."""
    import os

    iteration = _latest_iteration(path)
    return iteration is not None and os.path.isfile(os.path.join(path, f"iter_{iteration:07d}", "metadata.json"))


def _latest_iteration(path: str) -> Optional[int]:
    import os

    try:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _have_te_or_apex() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False))


def _make_ddp_init(original):
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        if ddp_config.fp4_param_gather and not any(_is_any_nvfp4(p) for p in module.parameters()):
            raise ValueError(
                "fp4_dist.megatron: the DDP config asks for fp4_param_gather but the model has no NVFP4 weight, so "
                "the distributed optimizer would fail at its first step asking for TransformerEngine. Either no "
                "layer was eligible (every transformer layer kept in bf16, e.g. by --first-last-layers-bf16: drop "
                "--fp4-param-gather), or the script wraps DDP itself without converting: call "
                "fp4_dist.megatron.model.convert_to_nvfp4(model, config) before DDP (megatron.training's pretrain() "
                "converts on its own once fp4_dist.megatron is enabled)")
        ours = [n for n, p in module.named_parameters() if _tensor.is_nvfp4_tensor(p)]
        if ours and not (ddp_config.fp4_param_gather and ddp_config.use_distributed_optimizer):
            raise ValueError(
                f"fp4_dist.megatron: the model has {len(ours)} fp4_dist NVFP4 weights ({ours[0]}, ...) but the DDP "
                f"config has fp4_param_gather={ddp_config.fp4_param_gather}, use_distributed_optimizer="
                f"{ddp_config.use_distributed_optimizer}: Megatron would put them in the bf16 buffer and never cast "
                "its updated masters into them, so they would not train. Set both to True (--fp4-param-gather "
                "--use-distributed-optimizer), or build the model without NVFP4 weights")
        original(self, config, ddp_config, module, *args, **kwargs)

    return __init__


def _make_set_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # With the torch.optim fallback (no TE / apex), Adam's state holds a "step" tensor that the dp_zero
        # checkpoint does not carry (load_state_dict restores it); upstream then raises KeyError('step').
        # Keys the checkpoint lacks keep their current value.
        current = self._get_main_param_and_optimizer_states(model_param)
        missing = {k: v for k, v in current.items() if k not in tensors}
        return original(self, model_param, {**tensors, **missing} if missing else tensors)

    return _set_main_param_and_optimizer_states


def _make_load_state_dict(original):
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        # With the torch.optim fallback, upstream hands every param's state the *same* "step" tensor
        # (DO 1024-1031); torch's Adam increments steps in place, so one step would advance it once per
        # param and resumed runs diverge. Each state gets its own copy.
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()

    return load_state_dict


def _make_is_distopt_quantized(original):
    def _is_distopt_quantized_param(cls, tensor) -> bool:
        # fp4_dist's weights are neither TE Float8Tensors nor grouped quantized tensors, which is all the original
        # tests; it finds that out through `param.data`, an alias built by NVFP4Tensor's Python dispatch.
        if type(tensor) is _tensor.NVFP4Tensor:
            return False
        return original(cls, tensor)

    return _is_distopt_quantized_param


def _make_forward_impl(original):
    def _forward_impl(self, input, weight, *args, **kwargs):
        # Megatron's linear function reads `weight.main_grad` with gradient_accumulation_fusion and calls the
        # weight's own gather with gtp_remat_size > 1: the parameter itself is passed then (the dispatch path).
        if (type(weight) is _tensor.NVFP4Tensor and not kwargs.get("gradient_accumulation_fusion")
                and kwargs.get("gtp_remat_size", 1) <= 1):  # fmt: skip
            if is_lean(weight):  # no kept copy: one made for this use, re-made in backward (fp4_dist.lean)
                return lean_call_refilled(self, weight, lambda value: original(self, input, value, *args, **kwargs))
            weight = compute_view(self, weight)
        return original(self, input, weight, *args, **kwargs)

    return _forward_impl


def _make_linear_forward(original):
    def forward(ctx, input, weight, *args):
        # A lean use's copy (fp4_dist.lean.lean_call_refilled): the node keeps how to write it again, and saves
        # the layer's alias of the pool buffer as upstream saves any weight.
        use = claim(weight)
        if use is not None:
            ctx.fp4_lean = use
        return original(ctx, input, weight, *args)

    return forward


def _make_linear_backward(original):
    def backward(ctx, *grads):
        use = getattr(ctx, "fp4_lean", None)
        if use is not None:
            use.refill()  # the pool buffer holds another weight's copy since the forward: write this one again
        return original(ctx, *grads)

    return backward


def _make_apply(original):
    def _apply(self, fn, *args, **kwargs):
        forget(self)  # the cached view leads to the grad accumulator that torch's in-place swap poisons
        return original(self, fn, *args, **kwargs)

    return _apply


def _convert_before_ddp(chunks, ddp_config, data_parallel: str) -> None:
    """Make the linear weights of every model chunk NVFP4 parameters when the run asks for
    ``--fp4-param-gather``: the moment is Megatron's own, after ``.cuda()`` / Float16Module (which would swap the
    parameters) and before DDP lays out its buffers and the distributed optimizer makes fp32 masters from each
    weight's ``get_high_precision_init_val`` (the bf16 init)."""
    if not getattr(ddp_config, "fp4_param_gather", False):
        return
    if data_parallel != "ddp":
        raise ValueError(
            f"fp4_dist.megatron: --fp4-param-gather through fp4_dist needs Megatron's DistributedDataParallel with "
            f"the distributed optimizer; this run wraps the model in {data_parallel}. Drop --use-torch-fsdp2 / "
            "--use-megatron-fsdp (or --fp4-param-gather); for PyTorch FSDP2 use fp4_dist.fsdp.fully_shard_nvfp4")
    from megatron.core.utils import get_model_config

    from .model import convert_to_nvfp4

    converted = 0
    for chunk in chunks:
        converted += len(convert_to_nvfp4(chunk, get_model_config(chunk), numerics=_options.numerics,
                                          compute_copy=_options.compute_copy))  # fmt: skip
    if converted and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(f"fp4_dist: {converted} linear weights converted to NVFP4 before DDP (their fp32 masters start "
              "from the bf16 init)", flush=True)


def _converting_before_ddp(chunks: str, data_parallel: Callable[[dict], str]):
    """A row factory for the functions that wrap model chunks in DDP: convert the chunks (the argument named
    `chunks`) first. `data_parallel(arguments)` names the wrapper the call builds ("ddp" for Megatron's DDP)."""

    def make(original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            _convert_before_ddp(a[chunks], a["ddp_config"], data_parallel(a))
            return original(*args, **kwargs)

        return wrapper

    return make


def _dist_utils_wrapper(a: dict) -> str:
    return "Megatron FSDP" if a.get("use_megatron_fsdp") else "torch FSDP2" if a.get("use_torch_fsdp2") else "ddp"


def _training_wrapper(a: dict) -> str:
    from megatron.core.distributed import DistributedDataParallel

    return "ddp" if a["DP"] is DistributedDataParallel else getattr(a["DP"], "__name__", str(a["DP"]))


def _make_compile_helpers(original):
    def compile_helpers():
        # megatron.training's initialize runs `make` in megatron/core/datasets and exits the job when it fails;
        # the megatron-core wheel ships the compiled module but no Makefile. A module that imports needs no build.
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
            return None
        except ImportError:
            pass
        if importlib.util.find_spec("pybind11") is None:  # the Makefile's build needs it; upstream would exit(1)
            raise RuntimeError(
                "fp4_dist.megatron: Megatron's dataset helpers (megatron/core/datasets/helpers_cpp) are not built "
                "and cannot be: pybind11 is not installed. `pip install pybind11` (a Megatron-LM source checkout "
                "builds them at start-up), or install the megatron-core wheel, which ships them compiled")
        # The Makefile asks `python3` (from PATH) for pybind11's includes and the extension suffix: this
        # interpreter's, also when its environment is not activated.
        import os
        import sys

        path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), path])
        try:
            return original()
        finally:
            os.environ["PATH"] = path

    return compile_helpers


def _make_initialize_megatron(original):
    def initialize_megatron(*args, **kwargs):
        # initialize_megatron asserts CUDA unless allow_no_cuda; on CPU ranks the CPU layer stands in for it.
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def current_options() -> AdapterOptions:
    """The options of the installed adapter (defaults when it is not installed)."""
    return _options


_GLOO = cpu_compat.GlooCoalescing()

HOOKS: tuple[Hook, ...] = (
    Hook((_FP4, _PGB, _DO), "is_nvfp4tensor", _make_is_nvfp4tensor,
         "recognise fp4_dist.NVFP4Tensor: uint8 buffer key (pgb _param_uses_quantized_storage), packed layout, "
         "no bf16 shard view / no bf16 copy in DistOpt (DO 405-412, 2852-2876), NVFP4 cast-target list (DO 2677)"),
    Hook((_FP4, _PGB), "modify_nvfp4_rowwise_storage", _make_modify_storage,
         "alias the weight's packed rowwise bytes to its slice of the DDP uint8 param buffer (pgb 1262-1269)"),
    Hook((_FP4, _DO), "quantize_nvfp4_param_shard", _make_shard_cast,
         "shard cast of the fp32 masters into the owned nibbles + all scales/amax via "
         "fp4_dist.optim.cast_master_weights_to_nvfp4 instead of TE (DO 2843-2847)"),
    Hook((_FP8, _PGB), "post_all_gather_processing", _make_post_all_gather,
         "after the byte all-gather, per bucket group in _post_param_sync (pgb 332-337): one launch refreshes "
         "the weights' compute copies (columnwise copies only with AdapterOptions.columnwise); non-fp4_dist "
         "params still go to the original"),
    Hook((_PGB,), "_ParamAndGradBuffer._compute_nvfp4_packed_layout", _make_packed_layout,
         "packed byte layout derived as element layout / 2 (upstream re-pads in byte space: stale bytes at "
         "dp 3 with 64x64, dp 2 with 40x48; pgb 1431-1516)"),
    Hook((_DO,), "pad_bucket_end", _make_pad_bucket_end,
         "bucket ends padded to lcm(2*dp, 128) so every rank's element shard is even (same as upstream unless "
         "dp is a multiple of 128; DO 542-550)"),
    Hook((_ARGS,), "validate_args", _make_validate_args,
         "--fp4-param-gather selects fp4_dist here, not TransformerEngine: validate_args would demand --fp4-format "
         "(TE >= 2.7); the flag is hidden from it and restored, then what fp4_dist does not serve is refused at "
         "start-up (refuse_unsupported_args)"),
    Hook((_ARGU, _ARGS), "core_transformer_config_from_args", _hiding_fp4_param_gather,
         "the TransformerConfig's fp4_param would ask TE for NVFP4 model init (and refuses it without --fp4-format); "
         "fp4_dist converts the weights itself. Bound in argument_utils (its home, and gpt_config_from_args's) and "
         "re-exported by arguments, where pretrain_gpt.py and gpt_builders.py import it from"),
    Hook((_TRAINING,), "wrap_model_chunks_with_ddp", _converting_before_ddp("model_chunks", _training_wrapper),
         "the model_provider route (get_model): convert the linear weights to NVFP4 after .cuda() and Float16Module, "
         "before DDP and the distributed optimizer (training.py 1570, 1880)"),
    Hook((_DIST_UTILS,), "_ddp_wrap", _converting_before_ddp("model", _dist_utils_wrapper),
         "the model-builder route (GPTModelBuilder.build_distributed_models, pretrain_gpt.py's): the same moment "
         "(models/dist_utils.py 189, after _wrap_with_mp_wrapper; a pre_wrap_hook runs before .cuda() and "
         "Float16Module)"),
    Hook((_DATASET_UTILS,), "compile_helpers", _make_compile_helpers,
         "initialize_megatron runs `make` for the dataset helpers and exits when it fails; the wheel ships them "
         "compiled without a Makefile: skip the build when the module imports"),
    Hook((_TRAINING,), "setup_model_and_optimizer", MONITOR.wrap_setup,
         "hand the model and optimizer pretrain() builds to fp4_dist.megatron.monitor (the master digest after "
         "setup with AdapterOptions.log_json; nothing otherwise)"),
    Hook((_TRAINING,), "train_step", MONITOR.wrap_train_step,
         "after each of megatron.training's steps: the parity check every AdapterOptions.check_every iterations "
         "and the run record (both off by default: the step is passed through)"),
    Hook((_INIT, _TRAINING), "initialize_megatron", _make_initialize_megatron,
         "initialize.py:66 asserts torch.cuda.is_available() unless allow_no_cuda; the CPU layer covers the rest",
         cpu_only=True),
    Hook((_ARGS,), "get_device_arch_version", lambda original: (lambda: 0),
         "validate_args reads the CUDA architecture for tensor parallel performance hints; a CPU rank has none",
         cpu_only=True),
    Hook((_DDP,), "DistributedDataParallel.__init__", _make_ddp_init,
         "NVFP4 weights with fp4_param_gather or the distributed optimizer off would sit in the bf16 buffer and "
         "never be cast from the updated masters (they silently stop training): refused at construction"),
    Hook((_DO,), "DistributedOptimizer._set_main_param_and_optimizer_states", _make_set_states,
         "loading Megatron's own dp_zero optimizer checkpoint (load_parameter_state) with the torch.optim "
         "fallback raises KeyError('step') (DO 1219-1226); keys the file lacks keep their restored value"),
    Hook((_DO,), "DistributedOptimizer.load_state_dict", _make_load_state_dict,
         "with the torch.optim fallback every param's Adam state gets one shared 'step' tensor on load (DO "
         "1024-1031), advanced once per param by the next step: resumed runs diverge; give each its own copy"),
    Hook((_DO,), "DistributedOptimizer._is_distopt_quantized_param", _make_is_distopt_quantized,
         "false for fp4_dist.NVFP4Tensor without reading `param.data` (an alias through Python dispatch, for every "
         "NVFP4 weight in every step's _copy_main_params_to_model_params; DO 1125-1127, 2868): same answer"),
    Hook((_TPL,), "ColumnParallelLinear._forward_impl", _make_forward_impl,
         "compute with the layer's cached plain alias of its NVFP4 weight's compute copy (fp4_dist.compute_view: "
         "one C++ autograd node to the parameter) instead of the parameter, whose every op goes through Python "
         "dispatch (~15-20 us per use); same values and gradients (layers 1094-1098)"),
    Hook((_TPL,), "RowParallelLinear._forward_impl", _make_forward_impl,
         "the same for the row-parallel layers (layers 1424-1428)"),
    Hook((_TPL,), "LinearWithGradAccumulationAndAsyncCommunication.forward", _make_linear_forward,
         "lean compute (--fp4-no-compute-copy): the node of a lean use keeps how to write its copy again; it saves "
         "the layer's alias of a pool buffer, as it saves any weight (layers 548)"),
    Hook((_TPL,), "LinearWithGradAccumulationAndAsyncCommunication.backward", _make_linear_backward,
         "lean compute: write the copy into the saved pool buffer again before upstream reads it (layers 585); "
         "one Python call per linear that the backward makes anyway, instead of saved-tensor hooks"),
    Hook((_TPL,), "ColumnParallelLinear._apply", _make_apply,
         "drop the layer's cached view before nn.Module._apply (.to/.cuda/.bfloat16) swaps the NVFP4 parameter in "
         "place: the swap poisons the grad accumulator the view's autograd node leads to, so the next backward "
         "would raise (inherited method: uninstall deletes the class attribute again)"),
    Hook((_TPL,), "RowParallelLinear._apply", _make_apply, "the same for the row-parallel layers"),
    Hook((_PGB,), "_coalescing_manager", lambda original: _GLOO.manager,
         "gloo returns wrong bytes for coalesced all-gathers of mixed dtypes (uint8 + bf16 bucket groups); "
         "issue each collective alone, still async when Megatron asks", cpu_only=True),
    Hook((_PGB,), "dist_all_gather_func", _GLOO.wrap,
         "hand all-gather work handles to the gloo coalescing stand-in", cpu_only=True),
    Hook((_PGB,), "dist_reduce_scatter_func", _GLOO.wrap,
         "hand reduce-scatter work handles to the gloo coalescing stand-in", cpu_only=True),
)


UPSTREAM_LAYOUT = ("_ParamAndGradBuffer._compute_nvfp4_packed_layout", "pad_bucket_end")
"""Rows that make the packed layout element layout / 2; excluding them leaves megatron-core's own layout."""


# ------------------------------------------------------------------------------------------ version check
def _parse_version(version: str) -> tuple[int, int, int]:
    from packaging.version import Version  # a megatron-core dependency

    release = Version(version).release
    return tuple((list(release) + [0, 0, 0])[:3])  # type: ignore[return-value]


def check_megatron_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` is one of `TESTED_VERSIONS` (the hook table names line-level facts of
    exactly those; a later patch release is accepted once the tests pass against it and it is added there)."""
    if _parse_version(version) in {_parse_version(v) for v in TESTED_VERSIONS}:
        return
    raise RuntimeError(
        f"fp4_dist.megatron is tested with megatron-core {' and '.join(TESTED_VERSIONS)} (a Megatron-LM core_r0.19.0 "
        f"checkout reports 0.19.1); found {version}. Its hooks patch named internals of DistributedOptimizer, "
        "_ParamAndGradBuffer and megatron.training that other releases may lay out differently. Install "
        f"megatron-core=={TESTED_VERSIONS[-1]} (or check out Megatron-LM's core_r0.19.0 branch), or try anyway with "
        "`python -m fp4_dist.megatron.run --allow-untested-megatron ...` (the example trainer: "
        "--fp4-allow-untested-megatron; your own script: enable(allow_untested_version=True))")


def installed_megatron_version() -> str:
    try:
        from megatron.core import package_info
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "fp4_dist.megatron needs megatron-core 0.19.x: pip install 'fp4_dist[megatron]' (Python 3.12+); on "
            "Python 3.11 first pip install --ignore-requires-python --no-binary megatron-core "
            f"'megatron-core=={TESTED_VERSIONS[-1]}'. Import failed: {e}"
        ) from e
    return package_info.__version__


# ------------------------------------------------------------------------------------------ install
_lock = threading.Lock()
_installed: Optional[list[tuple[Any, str, Any, bool]]] = None
"""(owner object, attribute, original, whether the owner held it itself) for every patched binding, in install order."""


def python_311_shim() -> None:
    """megatron.training (0.19) imports ``typing.override`` (Python 3.12); megatron-core runs on 3.11, so there
    the same decorator is provided from typing_extensions before anything imports megatron.training."""
    import sys
    import typing

    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _resolve(module_name: str, name: str) -> tuple[Any, str]:
    python_311_shim()
    owner: Any = importlib.import_module(module_name)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, attr):
        raise RuntimeError(
            f"fp4_dist.megatron: hook target {module_name}.{name} does not exist in this megatron-core; "
            "the hook table was written for " + ", ".join(TESTED_VERSIONS)
        )
    return owner, attr


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
    global _installed, _options
    with _lock:
        if _installed is not None:
            if options != _options:
                raise ValueError(f"fp4_dist.megatron is already enabled with {_options}; disable() it before "
                                 f"enabling with {options}")
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
        targets = [(h, _resolve(m, h.name)) for h in rows for m in h.modules]  # all resolved before any patch
        if cpu:
            cpu_compat.enable()
        done = []
        originals: dict[tuple[str, str], Any] = {}
        for hook, (owner, attr) in targets:
            original = _raw_attr(owner, attr)
            owned = not isinstance(owner, type) or attr in owner.__dict__
            key = (hook.name, id(hook))
            # One replacement object per row, built from the first binding's original, so identity checks
            # (`a is b`) across modules keep holding.
            if key not in originals:
                originals[key] = _wrap_like(original, hook.make(_unwrap(original)))
            setattr(owner, attr, originals[key])
            done.append((owner, attr, original, owned))
        _installed, _options = done, options
        MONITOR.reset()


def uninstall() -> None:
    """Put back every original binding and disable `cpu_compat` (idempotent)."""
    global _installed, _options
    with _lock:
        if _installed is None:
            return
        for owner, attr, original, owned in reversed(_installed):
            if owned:
                setattr(owner, attr, original)
            else:  # an inherited method: the class gets its base's back, not a copy of it
                delattr(owner, attr)
        _installed = None
        _options = AdapterOptions()
        cpu_compat.disable()


def _raw_attr(owner, attr):
    # Class attributes: keep staticmethod/classmethod wrappers so uninstall restores them exactly.
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _unwrap(original):
    return original.__func__ if isinstance(original, (staticmethod, classmethod)) else original


def _wrap_like(original, replacement):
    if isinstance(original, staticmethod):
        return staticmethod(replacement)
    if isinstance(original, classmethod):
        return classmethod(replacement)
    return replacement


def describe() -> str:
    """The hook table as text (for --help style output and the docs)."""
    lines = []
    for h in HOOKS:
        where = ", ".join(m.rsplit(".", 1)[-1] for m in h.modules)
        flag = " [CPU only]" if h.cpu_only else ""
        lines.append(f"{h.name} in {where}{flag} (tested {', '.join(h.tested)}): {h.reason}")
    return "\n".join(lines)
