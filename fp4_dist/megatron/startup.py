"""Start-up rows: Megatron's argument checks with fp4_dist's flag, the refusals, the conversion before DDP,
and what megatron.training's initialization needs on this machine."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import threading
from typing import Callable, Optional

import torch

from .. import tensor as _tensor
from ..compute.modes import DEFAULT, MODES, prepare
from .buffers import is_any_nvfp4
from .options import current_options
from .parallel import collective_device


_hiding = threading.local()
"""``args``: the arguments whose ``--fp4-param-gather`` Megatron's checks run without right now (or None)."""


def hiding_fp4_param_gather(original):
    """Run Megatron's `original(args, ...)` with ``args.fp4_param_gather`` off: there the flag means
    TransformerEngine's NVFP4 (validate_args demands --fp4-format and TE >= 2.7; the transformer config would
    ask TE for NVFP4 model init). With fp4_dist enabled the flag selects fp4_dist's path instead, which the DDP
    config still receives (get_megatron_ddp_config reads args after this)."""

    def wrapper(args, *rest, **kwargs):
        on = getattr(args, "fp4_param_gather", False)
        outer = getattr(_hiding, "args", None)
        _hiding.args = args if on else outer
        args.fp4_param_gather = False
        try:
            return original(args, *rest, **kwargs)
        finally:
            _hiding.args = outer
            args.fp4_param_gather = on or getattr(args, "fp4_param_gather", False)

    return wrapper


def make_print_args(original):
    def _print_args(title, args):
        # validate_args prints the argument table at its end, inside the checks that run without the flag: the table
        # shows the flag as the run uses it.
        if getattr(_hiding, "args", None) is not args:
            return original(title, args)
        args.fp4_param_gather = True
        try:
            return original(title, args)
        finally:
            args.fp4_param_gather = False

    return _print_args


def make_validate_args(original):
    hidden = hiding_fp4_param_gather(original)

    def validate_args(args, *rest, **kwargs):
        # Before Megatron's own checks: the flags refused here are read as parsed, and Megatron's checks of some of
        # them fail on a CPU rank with an unrelated message (--moe-grouped-gemm asks torch for CUDA).
        refuse_unsupported_args(args)
        note_unfinished_saves(args)
        return hidden(args, *rest, **kwargs)

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
    tracker = _tracker_text(load) if load else None
    if tracker is not None and not (tracker.isdigit() or tracker == "release"):
        problems.append(
            f"--load {load}: latest_checkpointed_iteration.txt holds {tracker!r}, not an iteration: a save was "
            "killed while writing it, after every rank had written that iteration's folder (megatron-core would "
            "print an error on rank 0 and exit with status 0, having trained nothing). Write the iteration of "
            "the last save the killed run's log reports complete into the file (the newest folders: "
            f"{', '.join(_iteration_folders(load)[-3:]) or 'none'}), then restart")
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
            (bool(getattr(args, "num_experts", None)) and getattr(args, "moe_grouped_gemm", False),
             "--moe-grouped-gemm (one weight tensor for all local experts; drop it: each expert is then its own "
             "linear layers, whose weights are NVFP4)"),
            (getattr(args, "transformer_impl", "local") == "transformer_engine",
             "--transformer-impl transformer_engine (use --transformer-impl local)"),
            (getattr(args, "fp16", False), "--fp16 (loss-scaled fp16 is not tested with NVFP4 weights; use --bf16)"),
            (not getattr(args, "fp16", False) and not getattr(args, "bf16", False),
             "an fp32 model (neither --bf16 nor --fp16: NVFP4 weights compute in bf16; add --bf16)"),
            (getattr(args, "async_save", False), "--async-save (needs the torch_dist format; use --ckpt-format torch)"),
            (getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False),
             "--use-torch-fsdp2 / --use-megatron-fsdp (for FSDP2 use fp4_dist.fsdp.fully_shard_nvfp4)"),
            (not getattr(args, "use_distributed_optimizer", False), "a run without --use-distributed-optimizer"),
            (getattr(args, "data_parallel_random_init", False), "--data-parallel-random-init"),
            (getattr(args, "overlap_param_gather_with_optimizer_step", False),
             "--overlap-param-gather-with-optimizer-step"),
            # The optimizer step holds the shard cast, whose non-finite verdicts and copy bookkeeping are the host's
            (getattr(args, "optimizer_cuda_graph", False),
             "--optimizer-cuda-graph (the shard cast's checks run on the host each step; graph the forward and "
             "backward with --cuda-graph-impl local or full_iteration instead)"),
            *_graph_refusals(args),
        ]
        problems += [f"--fp4-param-gather with {what} is not supported by fp4_dist" for bad, what in unsupported
                     if bad]  # fmt: skip
    mode = MODES[current_options().compute]
    if mode.name != DEFAULT:
        if not getattr(args, "fp4_param_gather", False):
            problems.append(f"{mode.flags()} without --fp4-param-gather: the {mode.name} compute mode computes with "
                            "NVFP4 weights, and this run has none")
        elif mode.parallel_linear is not None and getattr(args, "gradient_accumulation_fusion", False):
            problems.append(f"{mode.flags()} with gradient-accumulation fusion (Megatron's default where Apex is "
                            "installed; its kernel writes main_grad itself): add --no-gradient-accumulation-fusion")
    if problems:
        raise ValueError("fp4_dist.megatron: " + "; ".join(problems))


def _graph_refusals(args) -> list:
    """(refused, what) rows of the CUDA-graph options that --fp4-param-gather does not take. Megatron's own graphs
    (``--cuda-graph-impl local`` and ``full_iteration``) run every compute mode whose row allows them
    (``cuda_graphs``) as it runs eagerly, with ``--overlap-param-gather`` too: what a replay reads is decided outside
    the captured region (`fp4_dist.compute.fp8_copy`, `pool.Buffer.graphed`), and the cast verdicts a captured
    gather's processing cannot read are read at the next step's start (`buffers.resolve_cast_checks`)."""
    flag = _cuda_graphs(args)
    if flag is None:
        return []
    import torch

    mode = MODES[current_options().compute]
    return [
        (mode.cuda_graphs is not None, f"{flag} and {mode.flags()} ({mode.cuda_graphs})"),
        (not torch.cuda.is_available(), f"{flag} on CPU ranks (CUDA graphs need CUDA; run without them)"),
        (getattr(args, "cuda_graph_impl", None) == "transformer_engine" or getattr(args, "external_cuda_graph", False),
         f"{flag} (TransformerEngine's graphs; use --cuda-graph-impl local or full_iteration)"),
    ]


def _cuda_graphs(args) -> Optional[str]:
    """How `args` turn Megatron's CUDA graphs on (the flag as spelled), or None: ``--cuda-graph-impl`` and its
    older spellings, which Megatron's own checks map onto it after these run."""
    impl = getattr(args, "cuda_graph_impl", None)
    if impl not in (None, "none"):
        return f"--cuda-graph-impl {impl}"
    for flag in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(args, flag, False):
            return "--" + flag.replace("_", "-")
    return None


def _is_distributed_checkpoint(path: str) -> bool:
    """Whether the checkpoint `--load` would read is in Megatron's distributed format (torch_dist): its iteration
    folder holds the format's metadata.json (the torch format writes mp_rank_* folders instead)."""
    import os

    iteration = _latest_iteration(path)
    return iteration is not None and os.path.isfile(os.path.join(path, f"iter_{iteration:07d}", "metadata.json"))


def note_unfinished_saves(args) -> None:
    """On rank 0, name the iteration folders under ``--load`` that the load passes over: Megatron writes
    latest_checkpointed_iteration.txt only after every rank has written an iteration's files, and loads the
    iteration it names; a newer folder is a save that did not finish (its job was killed mid-save)."""
    import os

    load = getattr(args, "load", None)
    if not load or os.environ.get("RANK", "0") != "0" or getattr(args, "ckpt_step", None) is not None:
        return
    latest = _latest_iteration(load)
    newer = [f for f in _iteration_folders(load) if latest is None or int(f[len("iter_"):]) > latest]
    if newer:
        where = f"iteration {latest}" if latest is not None else "the initial weights (no complete checkpoint)"
        print(f"fp4_dist.megatron: --load {load} resumes from {where}; skipped {', '.join(newer)}: newer than "
              "latest_checkpointed_iteration.txt, saves that did not finish", flush=True)


def _tracker_text(path: str) -> Optional[str]:
    import os

    try:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except OSError:
        return None


def _latest_iteration(path: str) -> Optional[int]:
    text = _tracker_text(path)
    return int(text) if text is not None and text.isdigit() else None


def _iteration_folders(path: str) -> list[str]:
    """The ``iter_<7 digits>`` folders under `path`, oldest first."""
    import os
    import re

    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if re.fullmatch(r"iter_\d{7}", n) and os.path.isdir(os.path.join(path, n)))


def _have_te_or_apex() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False))


def make_ddp_init(original):
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        # With several pipeline stages one stage may hold only bf16 layers; `_convert_before_ddp` refuses a model with
        # no NVFP4 weight on any stage.
        if (ddp_config.fp4_param_gather and not any(is_any_nvfp4(p) for p in module.parameters())
                and _pipeline_stages() == 1):  # fmt: skip
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



def make_distrib_optimizer_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from .model import release_init_values

        # Every parameter of the optimizer's buffers, not only those this rank owns a piece of.
        release_init_values(p for buffer in self.buffers for p in buffer.params)

    return __init__


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

    options = current_options()
    # --use-cpu-initialization leaves the model on the host until DDP moves each parameter into its device buffer;
    # NVFP4 weights are made on that device at once (their bytes alias the buffer).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    require_compute_mode(options.compute, device)  # on every rank before anything is converted
    converted = 0
    for chunk in chunks:
        converted += len(convert_to_nvfp4(chunk, get_model_config(chunk), numerics=options.numerics,
                                          compute_copy=options.compute_copy, device=device,
                                          compute=options.compute, options=options.mode_options()))  # fmt: skip
    anywhere = converted
    if torch.distributed.is_initialized() and _pipeline_stages() > 1:
        count = torch.tensor([converted], device=collective_device())
        torch.distributed.all_reduce(count)
        anywhere = int(count.item())
    if not anywhere:
        raise ValueError(
            "fp4_dist.megatron: --fp4-param-gather but the model has no NVFP4 weight on any rank: every transformer "
            "layer is kept in bf16 (e.g. by --first-last-layers-bf16); drop --fp4-param-gather")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"fp4_dist: {converted} linear weights converted to NVFP4 before DDP on rank 0 (their fp32 masters "
              f"start from the bf16 init; {options.gemms()})", flush=True)


def require_compute_mode(compute: str, device: Optional[torch.device]) -> None:
    """Run the compute mode's one-time device check (`fp4_dist.compute.modes.prepare`) on this rank's device (None:
    the CPU); a device it does not run on stops the run at start-up, with the flag to drop named."""
    mode = MODES[compute]
    why = prepare(mode, [device or torch.device("cpu")])
    if why is not None:
        raise RuntimeError(f"fp4_dist.megatron: {why}; drop {mode.flags()}")


def _pipeline_stages() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def converting_before_ddp(chunks: str, data_parallel: Callable[[dict], str]):
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


def dist_utils_wrapper(a: dict) -> str:
    return "Megatron FSDP" if a.get("use_megatron_fsdp") else "torch FSDP2" if a.get("use_torch_fsdp2") else "ddp"


def training_wrapper(a: dict) -> str:
    from megatron.core.distributed import DistributedDataParallel

    return "ddp" if a["DP"] is DistributedDataParallel else getattr(a["DP"], "__name__", str(a["DP"]))


def make_compile_helpers(original):
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


def make_initialize_megatron(original):
    def initialize_megatron(*args, **kwargs):
        # initialize_megatron asserts CUDA unless allow_no_cuda; on CPU ranks the CPU layer stands in for it.
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron

