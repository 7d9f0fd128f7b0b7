"""Train a small GPT with megatron-core on the embedded corpus, with NVFP4 param all-gather from fp4_dist.

    torchrun --nproc-per-node 2 -m fp4_dist.megatron.pretrain_gpt \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \\
        --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \\
        --lr 1e-3 --bf16 --use-distributed-optimizer --fp4-param-gather

Arguments are Megatron's own (``megatron.training.arguments``: model shape, batch, optimizer, LR schedule,
``--use-distributed-optimizer``, ``--overlap-grad-reduce``, ``--overlap-param-gather``,
``--fp4-param-gather``, ``--first-last-layers-bf16``, ``--save``/``--load``/``--save-interval``, ...) plus a
few ``--fp4-*`` ones (``--help`` lists them). Platform defaults are filled in unless given: the local
transformer implementation, a byte-level vocabulary (256), no apex-only fusions, and on CPU ranks gloo and
CPU initialization. One rank per GPU with NCCL when CUDA is present, CPU ranks with gloo otherwise; a plain
``python -m`` run is one rank.

``--fp4-param-gather`` needs ``--use-distributed-optimizer``; it makes the linear weights of every
transformer layer NVFP4 parameters and routes Megatron's NVFP4 path through fp4_dist (no TransformerEngine
and no ``--fp4-format``). ``--fp4-fake-quant`` instead keeps bf16 weights and fake-quantizes them in the
forward: the reference an NVFP4 run must match bit for bit.

`main(argv)` returns the run's `RunResult` and may be called several times in one process (the test suite
and bench/megatron_compare.py do), each call building a fresh model and optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parametrize

from fp4_dist.checkpoint import atomic
from fp4_dist.checkpoint import options as checkpoint_options
from fp4_dist.launch import end_with_launcher, export_mpi_env, shutdown
from fp4_dist.megatron import adapter, defaults
from fp4_dist.megatron.defaults import Default
from fp4_dist.megatron.options import AdapterOptions, current_options, set_options
from .megatron_data import VOCAB_SIZE, BatchPlan, load_indexed, load_tokens, microbatches, split_stream

UNSUPPORTED_BACKEND_FLAGS = ("--fp4-format", "--fp4-recipe")

# Megatron arguments (by dest) this entry point implements; any other Megatron flag given on the command line is
# refused at start-up, naming it, instead of being parsed and silently ignored (MoE, pipeline parallel, other
# tokenizers, W&B, ...). Value rules (bf16 only, local transformer, PP = 1) are in check_fp4_args.
SUPPORTED = frozenset("""
    num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups kv_channels
    seq_length max_position_embeddings position_embedding_type rotary_base rotary_percent normalization norm_epsilon
    swiglu add_bias_linear add_qkv_bias qk_layernorm hidden_dropout attention_dropout init_method_std
    untie_embeddings_and_output_weights apply_residual_connection_post_layernorm attention_softmax_in_fp32
    micro_batch_size global_batch_size train_iters
    lr min_lr lr_decay_style lr_decay_iters lr_warmup_iters lr_warmup_fraction lr_warmup_init weight_decay
    start_weight_decay end_weight_decay weight_decay_incr_style adam_beta1 adam_beta2 adam_eps sgd_momentum
    optimizer clip_grad
    use_distributed_optimizer overlap_grad_reduce overlap_param_gather ddp_bucket_size fp4_param_gather
    first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 check_for_nan_in_loss_and_grad
    accumulate_allreduce_grads_in_fp32 grad_reduce_in_bf16
    save load save_interval exit_interval
    data_path split eval_interval eval_iters tensorboard_dir tensorboard_log_interval log_interval logging_level
    seed bf16 deterministic_mode manual_gc manual_gc_interval distributed_backend use_cpu_initialization
    transformer_impl tokenizer_type vocab_size gradient_accumulation_fusion masked_softmax_fusion persist_layer_norm
    bias_gelu_fusion bias_swiglu_fusion bias_dropout_fusion apply_rope_fusion
    tensor_model_parallel_size pipeline_model_parallel_size fp4 fp4_recipe fp8_param_gather
""".split())


def _megatron_training():
    """Import megatron.training's argument parser and helpers (Python 3.11: after `adapter.python_311_shim`)."""
    adapter.python_311_shim()
    from megatron.training import arguments, argument_utils, global_vars, training

    return arguments, argument_utils, global_vars, training


# --------------------------------------------------------------------------------------------- arguments
FLAG_PREFIX = "fp4-"
"""The adapter's options are the launcher's flags behind this prefix here (``--fp4-check-every`` for its
``--check-every``), beside Megatron's own."""


def add_fp4_dist_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("fp4_dist")
    # The adapter's options, spelled as the launcher's behind the prefix (fp4_dist.megatron.AdapterOptions).
    AdapterOptions.add_arguments(group, prefix=FLAG_PREFIX)
    group.add_argument("--fp4-fake-quant", action="store_true",
                       help="bf16 weights and bf16 param gather, NVFP4 fake-quantized in the forward (the "
                            "reference an --fp4-param-gather run matches bit for bit)")
    group.add_argument("--fp4-upstream-layout", action="store_true",
                       help="diagnostic: keep megatron-core's own packed NVFP4 layout (reproduces its stale "
                            "bytes at some data-parallel sizes; use with --fp4-check-every)")
    group.add_argument("--fp4-corpus", default=None, metavar="PATH",
                       help="text file or folder of *.txt (default: the corpus embedded in examples/data)")
    group.add_argument("--fp4-master-digest", action="store_true",
                       help="at the end, hash every full fp32 master (compares runs bit for bit)")
    group.add_argument("--fp4-print-args", action="store_true", help="print Megatron's full argument table")
    group.add_argument("--trust-checkpoint", action="store_true",
                       help="unpickle --load's files in full, which runs any code stored in them: only for a "
                            "checkpoint you made or whose source you trust (default: read weights-only, and refuse a "
                            "file that holds anything but tensors, plain values and NumPy's RNG state)")
    checkpoint_options.add_arguments(group)
    return parser


def _platform_defaults(argv: Sequence[str]) -> list[str]:
    """Flags this entry point needs unless the user set them: what the machine needs (the launcher's
    `fp4_dist.megatron.defaults.PLATFORM_DEFAULTS`, one definition), and its own: a byte vocabulary, and on CPU the
    whole-weight initialization on the host.

    The bias-activation / bias-dropout / RoPE fusions are Megatron's ``jit_fuser`` (``torch.compile``): they
    would compile at the first step (tens of seconds per process, and a Triton/C toolchain on the machine);
    their unfused paths compute the same expressions eagerly.
    """
    on = lambda m: True  # noqa: E731
    own = (Default("--tokenizer-type", ("NullTokenizer",), on, "token ids are bytes"),
           Default("--vocab-size", (str(VOCAB_SIZE),), on, "token ids are bytes"),
           *(Default(flag, (), on, "torch.compile at the first step") for flag in (
               "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion")),
           Default("--use-cpu-initialization", (), lambda m: not m.cuda, "CPU ranks"))  # fmt: skip
    return defaults.as_arguments(defaults.missing(argv, defaults.probe(), defaults.PLATFORM_DEFAULTS + own))


def check_fp4_args(args: argparse.Namespace) -> None:
    """The fp4_dist rules, checked before anything is built (ValueError names the rule and the remedy)."""
    if args.fp4_param_gather and not args.use_distributed_optimizer:
        raise ValueError(
            "--fp4-param-gather needs --use-distributed-optimizer: NVFP4 weights are cast shard by shard from the "
            "distributed optimizer's fp32 masters and all-gathered as packed bytes; add --use-distributed-optimizer"
        )
    if args.fp4_param_gather and args.fp4_fake_quant:
        raise ValueError("--fp4-fake-quant is the bf16 reference for an --fp4-param-gather run; use one of them")
    if args.fp8_param_gather and args.fp4_param_gather:
        raise ValueError("--fp8-param-gather and --fp4-param-gather cannot be combined (one uint8 param buffer)")
    if args.fp4 is not None or args.fp4_recipe not in (None, "nvfp4"):
        raise ValueError("--fp4-format/--fp4-recipe select TransformerEngine's NVFP4; fp4_dist replaces it: use "
                         "--fp4-param-gather alone")
    if args.transformer_impl != "local":
        raise ValueError(f"--transformer-impl {args.transformer_impl}: TransformerEngine is not used here (it is what "
                         "fp4_dist replaces); the local implementation is the only one: drop the flag")
    if args.tokenizer_type != "NullTokenizer":
        raise ValueError(f"--tokenizer-type {args.tokenizer_type}: this entry point reads token ids (the embedded "
                         "byte corpus, or --data-path indexed datasets) and needs no tokenizer: use NullTokenizer")
    if args.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ValueError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from e
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("fp4_dist.megatron.pretrain_gpt runs data and tensor parallel; pipeline parallel is not "
                         f"implemented here (--pipeline-model-parallel-size {args.pipeline_model_parallel_size})")
    if args.vocab_size != VOCAB_SIZE and not args.data_path:
        raise ValueError(f"the embedded data is byte-level: --vocab-size must be {VOCAB_SIZE} (or give --data-path)")
    if args.data_path and args.fp4_corpus:
        raise ValueError("--data-path and --fp4-corpus both name the training data: give one")
    if args.data_path and any(_is_number(x) for x in args.data_path):
        raise ValueError(f"--data-path {' '.join(args.data_path)}: weighted blends are not implemented here; give "
                         "one or more dataset prefixes (concatenated)")
    if not args.bf16:
        raise ValueError("fp4_dist.megatron.pretrain_gpt trains in bf16: add --bf16")
    if (args.save or args.load) and not args.use_distributed_optimizer:
        raise ValueError("--save/--load here store the DistributedOptimizer's parameter state: add "
                         "--use-distributed-optimizer")
    if args.train_iters is None:
        raise ValueError("--train-iters is required (sample-based training is not supported here)")


def _given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset:
    """Dests of the options on the command line (``--flag value`` and ``--flag=value`` alike)."""
    options = parser._option_string_actions
    return frozenset(options[a.split("=")[0]].dest for a in argv if a.startswith("-") and a.split("=")[0] in options)


def _refuse_unimplemented(given: frozenset, parser: argparse.ArgumentParser) -> None:
    fp4_dist_group = {a.dest for g in parser._action_groups if g.title == "fp4_dist" for a in g._group_actions}
    ignored = sorted(given - SUPPORTED - fp4_dist_group - {"help"})
    if ignored:
        flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
        raise ValueError(
            "these Megatron arguments are not implemented by fp4_dist.megatron.pretrain_gpt and would be ignored: "
            + ", ".join(flags[d] for d in ignored) + ". Remove them, or call fp4_dist.megatron.enable() in your own "
            "Megatron training script (docs/megatron.md lists what this entry point implements)")


def _is_number(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


def _escape_stray_percent(parser: argparse.ArgumentParser) -> None:
    """megatron-core 0.19.2 has a help string ending in "10%)." that makes ``--help`` crash in argparse's
    %-formatting; escape any help that does not format."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Megatron's parser + the fp4_dist group; Megatron's validate_args; the fp4_dist rules."""
    arguments, _, _, _ = _megatron_training()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m fp4_dist.megatron.pretrain_gpt", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser = add_fp4_dist_args(arguments.add_megatron_arguments(parser))
    _escape_stray_percent(parser)
    args = parser.parse_args(argv + _platform_defaults(argv))
    args.fp4_given = _given_dests(parser, argv)
    _refuse_unimplemented(args.fp4_given, parser)
    # Importing megatron.training.training sets the root logger to INFO (its line 36); Megatron's own
    # --logging-level decides here, WARNING by default.
    logging.getLogger().setLevel(args.logging_level if args.logging_level is not None else logging.WARNING)
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    export_mpi_env()  # mpirun/mpiexec: one job of N ranks, as under torchrun
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    if not options_of(args).allow_untested_version:
        adapter.check_megatron_version(adapter.installed_megatron_version())
    check_fp4_args(args)
    if args.tensor_model_parallel_size > 1:  # what Megatron asks of a TP launch (before CUDA starts)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # The hook table lets validate_args accept --fp4-param-gather without TransformerEngine; parsing leaves
    # megatron-core as it found it (setup installs the table for the run).
    installed_here = not adapter.is_installed()
    if installed_here:
        _install_adapter(args)
    # validated under this run's options, not those of an earlier run in this process (a bench's bf16 run after
    # its FP8 one) whose adapter is still installed
    earlier = current_options()
    set_options(options_of(args))
    table = io.StringIO()
    try:
        with contextlib.redirect_stdout(table):
            arguments.validate_args(args)
    except AssertionError as e:  # Megatron's checks are mostly bare asserts: name the failing condition
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"Megatron's validate_args rejected the arguments: {str(e) or where.line} "
                         f"({os.path.basename(where.filename)}:{where.lineno})") from e
    finally:
        set_options(earlier)
        if installed_here:
            adapter.uninstall()
    if args.fp4_print_args and args.rank == 0:
        print(table.getvalue(), end="")
    return args


def _install_adapter(args: argparse.Namespace) -> None:
    exclude = adapter.UPSTREAM_LAYOUT if args.fp4_upstream_layout else ()
    if adapter.is_installed():
        adapter.uninstall()  # a previous run in this process may have used other rows
    options = options_of(args)
    adapter.install(allow_untested_version=options.allow_untested_version, exclude=exclude, options=options)


def options_of(args: argparse.Namespace) -> AdapterOptions:
    """The adapter's options this run's flags give (``--fp4-numerics``, ``--fp4-compute-copy``, ...)."""
    return AdapterOptions.from_args(args, prefix=FLAG_PREFIX)


# --------------------------------------------------------------------------------------------- setup
def initialize(args: argparse.Namespace) -> torch.device:
    """torch.distributed (NCCL on GPUs, gloo on CPU), model-parallel groups, seeds. Idempotent."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.getenv("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = args.distributed_backend if cuda else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:  # plain `python -m`: a job of one rank (a file store needs no port)
            store = os.path.join(tempfile.mkdtemp(prefix="fp4_megatron_"), "store")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        tp = args.tensor_model_parallel_size
        if dist.get_world_size() % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the {dist.get_world_size()} ranks")
        parallel_state.initialize_model_parallel(tp, 1)
    from megatron.core import rerun_state_machine

    if rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None:  # Megatron's default (disabled), said explicitly
        rerun_state_machine.initialize_rerun_state_machine()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _dp() -> tuple[int, int]:
    """(data-parallel rank, size): the ranks that split the batch (tensor-parallel ranks share theirs)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def weight_mode(args: argparse.Namespace) -> str:
    return "nvfp4" if args.fp4_param_gather else "fake-nvfp4" if args.fp4_fake_quant else "bf16"


def build(args: argparse.Namespace, device: torch.device):
    """(DDP model, optimizer, LR scheduler, TransformerConfig) from Megatron's arguments."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from fp4_dist.megatron.model import build_gpt_model

    _, argument_utils, global_vars, training = _megatron_training()
    global_vars.set_args(args)  # Megatron's scheduler/config helpers read the global args
    config = argument_utils.core_transformer_config_from_args(args)
    options = options_of(args)
    from fp4_dist.megatron.startup import require_compute_mode

    require_compute_mode(options.compute, device)  # before the model: a device the mode does not run on stops here
    model = build_gpt_model(
        config, vocab_size=VOCAB_SIZE, max_sequence_length=args.max_position_embeddings, weights=weight_mode(args),
        numerics=options.numerics, position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, device=device,
        compute_copy=options.compute_copy, compute=options.compute, compute_options=options.mode_options(),
    )
    ddp_config = training.get_megatron_ddp_config(args)  # fp4_param_gather flows in by field name
    layout = None
    if ddp_config.use_distributed_optimizer:  # what Megatron's own get_model does (DDP warns otherwise)
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        params = [p for p in model.parameters() if p.requires_grad]
        layout = DistributedOptimizer.compute_full_param_layout(
            params, ddp_config.bucket_size, _dp()[1], ddp_config)
    model = DistributedDataParallel(config, ddp_config, model, full_param_layout=layout)
    opt_config, overrides = training.get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, [model], overrides)
    scheduler = training.get_optimizer_param_scheduler(optimizer)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler, config


def param_buffer_bytes(model) -> dict[str, int]:
    """Bytes of the DDP param buffers by dtype (the all-gather payload of one step) and of the grad buffers."""
    out: dict[str, int] = {}
    for buf in model.buffers + model.expert_parallel_buffers:
        if buf.param_data is not None:
            key = f"param_{str(buf.param_dtype).replace('torch.', '')}"
            out[key] = out.get(key, 0) + buf.param_data.numel() * buf.param_data.element_size()
        out["grad"] = out.get("grad", 0) + buf.grad_data.numel() * buf.grad_data.element_size()
    return out


# --------------------------------------------------------------------------------------------- training
def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output: torch.Tensor):
        # (sum, tokens, report): Megatron divides by tokens and microbatches; the report is summed for logs.
        total = output.float().sum()
        tokens = torch.full((), output.numel(), dtype=torch.int, device=output.device)  # no host-to-device copy
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}

    return per_token, loss_func


@dataclass
class StepRecord:
    iteration: int
    loss: float
    grad_norm: float
    lr: float
    step_ms: float
    parity: Optional[str] = None  # "ok" / "FAIL: ..." when --fp4-check-every ran this step


@dataclass
class RunResult:
    """What one `main` call did (rank-local, identical on every rank except step times)."""

    mode: str
    world_size: int
    start_iteration: int
    records: list[StepRecord] = field(default_factory=list)
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    nvfp4_weights: int = 0
    compute_copy_bytes: int = 0
    """Bytes of the NVFP4 weights' compute copies at the end of the run (next to the param buffers)."""
    peak_allocated_bytes: int = 0
    """CUDA: the most memory torch had allocated on this rank's device during the iterations (0 on CPU)."""
    start_allocated_bytes: int = 0
    """CUDA: memory torch had allocated when the first iteration began (model, buffers, optimizer state made at
    setup; 0 on CPU)."""
    checkpoints: list[str] = field(default_factory=list)
    master_digest: Optional[str] = None
    validation: list = field(default_factory=list)
    """(iteration, mean validation token loss) of every evaluation (--eval-interval)."""

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


def train_step(args, iteration, tokens, plan, model, optimizer, scheduler, device,
               after_forward_backward=None) -> tuple[float, float]:  # fmt: skip
    """One optimizer step over the global batch of ``iteration``; returns (mean token loss, grad norm).
    `after_forward_backward()`, if given, is called when the forward-backward of every microbatch has been issued
    (benchmarks time the phases with it)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    # --fp4-fake-quant: each weight quantized once per step, as an --fp4-param-gather run casts it once (without the
    # cache every read of `module.weight` quantizes again: several per microbatch); the weights do not change
    # until the optimizer step below.
    with parametrize.cached() if args.fp4_fake_quant else contextlib.nullcontext():
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=microbatches(tokens, plan, iteration, device),
            model=[model], num_microbatches=plan.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )
    if after_forward_backward is not None:
        after_forward_backward()
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError(f"iteration {iteration}: optimizer step skipped (non-finite gradients)")
    scheduler.step(increment=args.global_batch_size)
    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    dist.all_reduce(total)
    return float(total[0] / total[1]), float(grad_norm or 0.0)


def _run_config(args) -> dict:
    """The settings a checkpoint must agree with to resume bit for bit."""
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "seq_length", "global_batch_size", "micro_batch_size", "seed", "fp4_param_gather",
            "fp4_fake_quant", "fp4_numerics", "first_last_layers_bf16", "use_distributed_optimizer",
            "tensor_model_parallel_size")  # each tensor-parallel rank saves its own slices
    return {k: getattr(args, k) for k in keys}


def _check_parity(model, optimizer) -> str:
    from fp4_dist.megatron.parity import all_ranks_ok, check_nvfp4_weights

    report = check_nvfp4_weights(model.module, optimizer)
    if all_ranks_ok(report):
        return f"ok ({report.weights} weights, {report.bytes_checked} bytes per rank)"
    mine = "; ".join(report.mismatches[:3]) or "this rank matched; see the others"
    return f"FAIL on rank {dist.get_rank()}: {mine}"


def _log(args, result: RunResult, rec: StepRecord) -> None:
    if dist.get_rank() != 0:
        return
    done = rec.iteration - result.start_iteration
    total = args.train_iters - result.start_iteration
    bar = "#" * int(20 * done / max(total, 1))
    line = (f"[{bar:<20}] iter {rec.iteration:>5}/{args.train_iters} | loss {rec.loss:.4f} | "
            f"grad norm {rec.grad_norm:.3f} | lr {rec.lr:.2e} | {rec.step_ms:7.1f} ms/step")
    if rec.parity:
        line += f" | NVFP4 gather == quantize(master): {rec.parity}"
    print(line, flush=True)


def data_streams(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) token streams: --data-path indexed datasets or the embedded/--fp4-corpus text, split by
    --split when it is given or validation is asked for (the whole text trains otherwise)."""
    evaluating = args.eval_interval is not None
    split = args.split or ("969,30,1" if evaluating or args.data_path else None)
    if args.data_path:
        train_, valid, _ = load_indexed(args.data_path, split)
        top = int(max(train_.max() if train_.numel() else 0, valid.max() if valid.numel() else 0))
        if top >= args.vocab_size:
            raise ValueError(f"--data-path holds token id {top} but --vocab-size is {args.vocab_size}")
    else:
        text = load_tokens(args.fp4_corpus)
        train_, valid = (split_stream(text, split)[:2] if split else (text, text[:0]))
    if evaluating and valid.numel() <= args.seq_length + 1:
        raise ValueError(f"--eval-interval: the validation split ({valid.numel()} tokens, --split {split}) is "
                         f"shorter than one sequence of {args.seq_length + 1}; give more data or a larger valid share")
    return train_, valid


def evaluate(args, valid: torch.Tensor, model, device, iteration: int) -> float:
    """Mean token loss over --eval-iters global batches of the validation stream (forward only, no grad)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plan = BatchPlan(args.seq_length, args.micro_batch_size, args.global_batch_size, *_dp(),
                     args.seed + 7919)  # fmt: skip
    total = torch.zeros(2, device=device)
    model.eval()
    with torch.no_grad():
        for i in range(args.eval_iters):
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=microbatches(valid, plan, i, device), model=[model],
                num_microbatches=plan.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            total += torch.stack([r["lm loss"] for r in reports]).sum(0)
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def train(args, model, optimizer, scheduler, device, start_iteration: int) -> RunResult:
    from fp4_dist.megatron.model import nvfp4_parameters

    tokens, valid = data_streams(args)
    writer = None
    if args.tensorboard_dir and dist.get_rank() == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=args.tensorboard_dir)
    plan = BatchPlan(args.seq_length, args.micro_batch_size, args.global_batch_size, *_dp(), args.seed)
    result = RunResult(weight_mode(args), dist.get_world_size(), start_iteration,
                       buffer_bytes=param_buffer_bytes(model), nvfp4_weights=len(nvfp4_parameters(model.module)))
    if args.manual_gc:  # Megatron's --manual-gc: no threshold-triggered collections inside steps, on any rank
        if args.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
        gc.disable()
        gc.collect()
    iteration = start_iteration
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        result.start_allocated_bytes = torch.cuda.memory_allocated(device)
    try:
        for iteration in range(start_iteration + 1, args.train_iters + 1):
            go_on = _train_iteration(args, iteration, tokens, plan, model, optimizer, scheduler, device, result)
            _log_scalars(writer, args, result.records[-1])
            if args.eval_interval and (iteration % args.eval_interval == 0 or not go_on
                                       or iteration == args.train_iters):
                _validate(args, valid, model, device, iteration, result, writer)
                if args.fp4_log_json and dist.get_rank() == 0:  # a run stopped later keeps what it did so far
                    write_record(args.fp4_log_json, result, complete=False)
            if not go_on:
                break
            if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
                gc.collect()
    finally:
        if args.manual_gc:
            gc.enable()
        if writer is not None:
            writer.close()
    if model.ddp_config.overlap_param_gather:
        # The last step dispatched the next step's param all-gather asynchronously: finish it, so that no
        # collective is in flight when the caller tears the process group down (or checks the weights).
        model.disable_forward_pre_hook(param_sync=True)
        model.enable_forward_pre_hook()
    if args.fp4_master_digest:
        from fp4_dist.megatron.parity import master_digest

        result.master_digest = master_digest(model.module, optimizer)
    from fp4_dist.tensor.copy import compute_copy_bytes

    result.compute_copy_bytes = compute_copy_bytes(model.module)
    if device.type == "cuda":
        result.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
    return result


def _log_scalars(writer, args, rec: StepRecord) -> None:
    """TensorBoard scalars under Megatron's names, every --tensorboard-log-interval steps (rank 0)."""
    if writer is None or rec.iteration % max(1, args.tensorboard_log_interval):
        return
    writer.add_scalar("lm loss", rec.loss, rec.iteration)
    writer.add_scalar("learning-rate", rec.lr, rec.iteration)
    writer.add_scalar("grad-norm", rec.grad_norm, rec.iteration)
    writer.add_scalar("iteration-time", rec.step_ms / 1e3, rec.iteration)


def _validate(args, valid, model, device, iteration: int, result: RunResult, writer) -> None:
    loss = evaluate(args, valid, model, device, iteration)
    result.validation.append((iteration, loss))
    if dist.get_rank() == 0:
        ppl = math.exp(min(loss, 50))
        print(f"validation loss at iteration {iteration}: lm loss {loss:.4f} | lm loss PPL {ppl:.3f}", flush=True)
        if writer is not None:
            writer.add_scalar("lm loss validation", loss, iteration)
            writer.add_scalar("lm loss validation ppl", ppl, iteration)


def _train_iteration(args, iteration, tokens, plan, model, optimizer, scheduler, device, result) -> bool:
    """One step, its checks, checkpoint and log line; False when Megatron's --exit-interval says stop."""
    from .megatron_checkpoint import save_checkpoint

    t0 = time.perf_counter()
    loss, grad_norm = train_step(args, iteration, tokens, plan, model, optimizer, scheduler, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec = StepRecord(iteration, loss, grad_norm, optimizer.param_groups[0]["lr"], 1e3 * (time.perf_counter() - t0))
    check = args.fp4_check_every and iteration % args.fp4_check_every == 0 and result.nvfp4_weights
    exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0  # Megatron's --exit-interval
    saving = bool(args.save) and (exiting or iteration == args.train_iters
                                  or bool(args.save_interval) and iteration % args.save_interval == 0)
    overlap = model.ddp_config.overlap_param_gather
    if check or saving:
        if overlap:  # finish the in-flight all-gather so the weights are this step's
            model.disable_forward_pre_hook(param_sync=True)
        if check:
            rec.parity = _check_parity(model, optimizer)
        if saving:
            path = save_checkpoint(args.save, iteration, model, optimizer, scheduler, _run_config(args))
            result.checkpoints.append(str(path))
        if overlap:
            model.enable_forward_pre_hook()
    result.records.append(rec)
    failed_check = (rec.parity or "").startswith("F")
    if iteration % args.log_interval == 0 or iteration == args.train_iters or exiting or failed_check:
        _log(args, result, rec)
    if rec.parity and not rec.parity.startswith("ok"):
        raise RuntimeError(f"iteration {iteration}: gathered NVFP4 weights differ from quantize(master): " + rec.parity)
    return not exiting


def _summary(args, result: RunResult) -> str:
    losses = result.losses
    mib = {k: f"{v / 2**20:.3f} MiB" for k, v in result.buffer_bytes.items()}
    mib["nvfp4 compute copies"] = f"{result.compute_copy_bytes / 2**20:.3f} MiB"
    from fp4_dist.compute import pool_stats

    lean = pool_stats()
    if lean["bytes"]:  # the lean copies' buffers (per weight shape, `depth` layers' worth), and copies per use
        mib["lean pool"] = (f"{lean['bytes'] / 2**20:.3f} MiB ({lean['depth']} layers deep), {lean['launches']} "
                            f"dequantize launches writing {lean['copies']} copies for {lean['uses']} uses")
    times = sorted(r.step_ms for r in result.records[1:]) or [r.step_ms for r in result.records]
    median = times[len(times) // 2] if times else float("nan")
    gemms = f", {options_of(args).gemms()}" if result.nvfp4_weights else ""
    return (f"done: {result.mode} weights ({result.nvfp4_weights} NVFP4{gemms}), "
            f"{result.world_size} ranks, "
            f"iterations {result.start_iteration + 1}..{args.train_iters}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"median step {median:.1f} ms, DDP buffers and compute copies {mib}"
            + (f", peak allocated {result.peak_allocated_bytes / 2**20:.0f} MiB" if result.peak_allocated_bytes else "")
            if losses else "done: nothing to train")


@dataclass
class Session:
    """Everything `setup` builds; `train` runs on it."""

    args: argparse.Namespace
    device: torch.device
    model: Any
    optimizer: Any
    scheduler: Any
    start_iteration: int = 0


def setup(argv: Optional[Sequence[str]] = None) -> Session:
    """Parse, install the hook table, initialise, build, and load ``--load`` if given. Start-up errors raise
    here, before any training step."""
    args = parse_args(argv)
    _install_adapter(args)
    device = initialize(args)
    model, optimizer, scheduler, _ = build(args, device)
    if args.fp4_param_gather and args.tensor_model_parallel_size > 1:
        from .megatron_checkpoint import recast_model_params

        # Each rank quantized its slice of the init with the slice's amax; cast again from the fp32 masters, as
        # after every step, so the scales use the whole weight's amax from the first forward on.
        recast_model_params(model, optimizer)
    session = Session(args, device, model, optimizer, scheduler)
    if args.save:  # one job per --save folder: a second one is refused here, before it trains a step
        from fp4_dist.checkpoint import lock_root

        lock_root(args.save, take_over_other_host=args.take_over_lock)
    if args.load:
        from .megatron_checkpoint import load_checkpoint

        session.start_iteration = load_checkpoint(args.load, model, optimizer, scheduler, _run_config(args),
                                                  trusted=args.trust_checkpoint, verify=not args.no_verify)
        if dist.get_rank() == 0:
            print(f"resumed from {args.load} at iteration {session.start_iteration}", flush=True)
    return session


def main(argv: Optional[Sequence[str]] = None) -> RunResult:
    """Set up, (resume,) train, summarise; returns the run's records."""
    s = setup(argv)
    result = train(s.args, s.model, s.optimizer, s.scheduler, s.device, s.start_iteration)
    if dist.get_rank() == 0:
        print(_summary(s.args, result), flush=True)
        if s.args.fp4_log_json:
            write_record(s.args.fp4_log_json, result, complete=True)
    return result


def write_record(path: str, result: RunResult, *, complete: bool) -> None:
    """The run's record as JSON, ``complete`` false while it trains (written after each evaluation, so that a run
    stopped before its end, by a time limit say, keeps its steps and validation losses so far). Written to a
    temporary file, flushed and renamed (`fp4_dist.checkpoint.atomic.write_file_atomically`): a reader never sees half a
    record, also after the process is killed."""
    atomic.write_file_atomically(path, json.dumps(dict(asdict(result), complete=complete), indent=1))


def _cli() -> int:
    # Import-time notices of megatron-core without TransformerEngine/apex, and torch's deprecation notes on
    # the collectives Megatron calls: not actionable for a user of this command.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\.")
    end_with_launcher()  # an orphaned rank (its torchrun killed) ends instead of training on
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - every rank says why it stops, then stops now
        _fail(e)
    shutdown()
    return 0


def _fail(e: BaseException) -> None:
    """Print this rank's error (its cause, rank-prefixed: a user error in one line, anything else with its
    traceback) and exit with status 2 at once. No collective and no process-group teardown: the other ranks
    may be waiting in one, and the launcher (torchrun, mpiexec) stops them when this process exits."""
    rank = os.getenv("RANK", "0")
    if isinstance(e, SystemExit):  # argparse's usage error (already printed) or --help
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 2)
    if isinstance(e, (ValueError, FileNotFoundError, NotImplementedError)) or isinstance(e, RuntimeError) and \
            str(e).startswith(("iteration", "fp4_dist", "--")):
        text = f"pretrain_gpt: error: {e}"
    elif isinstance(e, KeyboardInterrupt):
        text = "pretrain_gpt: interrupted"
    else:
        text = "pretrain_gpt: error:\n" + "".join(traceback.format_exception(e))
    print("\n".join(f"[rank {rank}] {line}" for line in text.splitlines()), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


if __name__ == "__main__":
    sys.exit(_cli())
