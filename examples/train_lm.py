"""Train a small character-level language model with ZeRO-1 and a 4-bit NVFP4 parameter all-gather.

    torchrun --standalone --nproc-per-node 2 -m examples.train_lm      # 2 CPU ranks (gloo)
    mpirun -n 2 python -m examples.train_lm                          # the same, bootstrapped by MPI
    python -m examples.train_lm --steps 50                           # one process

On GPUs (one rank per GPU) the same command uses NCCL and the CUDA kernels. Data: examples/data/tiny_corpus.txt.
Every linear weight is NVFP4; each rank keeps fp32 masters and Adam state for its shard only, and after each
step casts its shard straight into the packed NVFP4 bytes that are all-gathered. The job prints the loss, the
bytes all-gathered against a bf16 gather, and ends with a parity check: every rank's NVFP4 weights must be
bit-identical to `fp4_dist.quantize` of the full fp32 master (assembled from all shards), run on the CPU oracle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional
from pathlib import Path

import torch

import fp4_dist
from examples.model import TinyLMConfig, build_model
from fp4_dist.launch import end_with_launcher, init_distributed, launch_rank, shutdown
from fp4_dist import checkpoint
from fp4_dist.checkpoint import (DamagedCheckpointError, RootLockedError, SafeReader, latest_complete_checkpoint,
                                 load_distributed_checkpoint, lock_root, release_root, step_folder,
                                 verify_folder_collective)
from fp4_dist.checkpoint import options as checkpoint_options
from fp4_dist.optim import Zero1Config, Zero1Optimizer, load_checkpoint
from fp4_dist.optim.zero1_state import sharded_state_dict
from fp4_dist.cast import CommStats
from fp4_dist.cast.collectives import all_reduce_sum_
from fp4_dist.compute.fp8_copy import fp8_copy_bytes
from fp4_dist.compute.modes import DEFAULT, MODES

DATA = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


class _Parser(argparse.ArgumentParser):
    """Every rank parses the same command line: a mistake is printed by the first rank only, and every rank exits."""

    def error(self, message):
        if launch_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _at_least(low: int):
    """An argparse type: an integer >= `low` (a 0 or negative count stopped every rank deep in the run, or ran)."""

    def integer(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    integer.__name__ = "int"  # argparse's "invalid int value" for a word
    return integer


def _backend(name: str) -> str:
    if name not in ("gloo", "nccl"):
        raise argparse.ArgumentTypeError(f"gloo or nccl, got {name!r}")
    if name == "nccl" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("nccl needs CUDA GPUs, and this machine has none: use gloo")
    return name


def parse_args(argv=None):
    # allow_abbrev=False: an option is its whole word (--step is no --steps)
    ap = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                 allow_abbrev=False)
    ap.add_argument("--steps", type=_at_least(1), default=300, help="optimizer steps")
    ap.add_argument("--batch", type=_at_least(1), default=16, help="sequences per rank per step")
    ap.add_argument("--seq", type=_at_least(1), default=64, help="tokens per sequence")
    ap.add_argument("--dim", type=_at_least(1), default=128, help="model width")
    ap.add_argument("--hidden", type=_at_least(1), default=384, help="MLP width")
    ap.add_argument("--heads", type=_at_least(1), default=4, help="attention heads")
    ap.add_argument("--layers", type=_at_least(1), default=2, help="transformer blocks")
    ap.add_argument("--lr", type=float, default=6e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=_at_least(1), default=20, help="linear warm-up steps, then cosine decay")
    ap.add_argument("--bucket-numel", type=int, default=200_000, help="elements per all-gather bucket")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    ap.add_argument("--log-every", type=_at_least(1), default=25, help="steps between log lines")
    ap.add_argument("--data", type=Path, default=DATA, help="a UTF-8 text file, one token per character")
    ap.add_argument("--backend", type=_backend, default=None,
                    help="gloo or nccl (None: nccl when CUDA is available, else gloo)")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    ap.add_argument("--save", type=Path, default=None,
                    help="checkpoint folder: a checkpoint every --save-every steps (DIR/step_<n>, committed whole), "
                         "and a run started again resumes from the newest complete one, bit for bit (one saved with "
                         "other options is refused, naming them; --steps, --save-every, paths and logging may differ)")
    checkpoint_options.add_arguments(ap)
    ap.add_argument("--save-every", type=_at_least(1), default=None,
                    help=f"steps between checkpoints (with --save; {SAVE_EVERY} when not given)")
    ap.add_argument("--fp4-compute", choices=MODES, default=DEFAULT,
                    help="what the linears' GEMMs read: bf16 values of the NVFP4 weights, or FP8 block copies of them "
                         "with FP8 activations and gradients (Hopper GPUs; emulated on CPU ranks; docs/fp8.md). The "
                         "NVFP4 bytes and their gather are the same in both")  # fmt: skip
    args = ap.parse_args(argv)
    if args.save_every is not None and args.save is None:
        ap.error("--save-every needs --save DIR (the folder the checkpoints go to)")
    if args.take_over_lock and args.save is None:
        ap.error("--take-over-lock needs --save DIR (the folder whose lock it takes)")
    args.save_every = args.save_every or SAVE_EVERY
    args.data, args.save = _callers(args.data), _callers(args.save) if args.save is not None else None
    if not args.data.is_file():
        ap.error(f"--data {args.data}: no such file (a UTF-8 text file, one token per character)")
    return args


SAVE_EVERY = 50

MAY_DIFFER = ("steps", "save_every", "save", "data", "log_every", "no_progress", "no_verify", "take_over_lock",
              "backend", "bucket_numel")
"""Options a resumed run may change: its length (the schedule follows --steps), where files are, what it prints,
how it checks and locks, the collective backend and the gather's bucket size (neither changes a value). Every other
option is recorded with each checkpoint, and a --save folder saved with other values is refused."""
OPTIONS_KEY = "train_lm_options"
"""The checkpoint entry holding the recorded options (JSON text)."""


def recorded_options(args) -> dict:
    """The options `MAY_DIFFER` leaves, as their values print on a command line."""
    return {k: str(v) for k, v in sorted(vars(args).items()) if k not in MAY_DIFFER}


def check_options(args, path: Path, verify: bool) -> None:
    """Refuse to resume from `path` (collective) when it was saved with other options than `args`, naming each one
    with both values; a checkpoint saved before options were recorded resumes with a note. `verify`: check its
    files against their digests first (DamagedCheckpointError names a damaged one), so that the load after this
    need not."""
    if verify:
        verify_folder_collective(path)
    reader = SafeReader(path)
    if OPTIONS_KEY not in reader.read_metadata().state_dict_metadata:
        if launch_rank() == 0:
            print(f"train_lm: {path} records no options (saved before they were): not compared with this run's",
                  flush=True)  # fmt: skip
        return
    box = {OPTIONS_KEY: ""}
    load_distributed_checkpoint(box, path, checked=reader)
    saved, ours = json.loads(box[OPTIONS_KEY]), recorded_options(args)
    differ = [f"--{k.replace('_', '-')} {saved.get(k, '(none)')} there, {ours.get(k, '(none)')} here"
              for k in sorted(saved.keys() | ours.keys()) if saved.get(k) != ours.get(k)]  # fmt: skip
    if differ:
        raise SystemExit(f"train_lm: --save {args.save} holds checkpoints of a run with other options "
                         f"({'; '.join(differ)}): give it those options to resume that run, or give this run "
                         "another --save folder")


def _callers(path: Path) -> Path:
    """`path` as the caller meant it: a relative one against the folder `scripts/train.sh` was started from
    (FP4_DIST_CALLER_DIR; it runs from the repository root), else against the working folder."""
    return Path(os.environ.get("FP4_DIST_CALLER_DIR", ".")) / path if not path.is_absolute() else path


# --------------------------------------------------------------------------------------------------- data
def load_corpus(path: Path):
    """(int64 token ids, vocabulary): one token per character, vocabulary = sorted distinct characters."""
    text = path.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.int64), vocab


def windows(tokens: torch.Tensor, count: int, seq: int, seed: int) -> torch.Tensor:
    """`count` random windows of seq + 1 tokens, fixed by `seed` (so every launch sees the same data)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq - 1, (count,), generator=g)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """A progress bar on rank 0 (redrawn in place on a terminal, one line per `every` steps otherwise)."""

    def __init__(self, total: int, enabled: bool, bar: bool, every: int, start: int = 0):
        self.total, self.enabled, self.bar, self.every, self.start = total, enabled, bar, every, start
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, note: str = "") -> None:
        if not self.enabled:
            return
        done = step + 1
        rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)  # of this run (a resumed one too)
        eta = (self.total - done) / rate
        width = 28
        fill = int(width * done / self.total)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {done:4d}/{self.total}  loss {loss:6.3f}  "
                f"{rate:5.1f} step/s  eta {eta:4.0f}s {note}")
        if self.bar:
            print("\r" + line, end="", flush=True)
            if done == self.total:
                print()
        elif done % self.every == 0 or done == self.total or step == self.start:
            print(line, flush=True)


# ------------------------------------------------------------------------------------------------- parity
def parity_check(model, opt: Zero1Optimizer) -> tuple[int, int, int]:
    """Compare every parameter with the full fp32 master, on the CPU oracle. Collective (every rank).

    Returns (NVFP4 weights checked, dense params checked, mismatches on this rank).
    """
    masters = opt.full_masters()
    n4 = nd = bad = 0
    for p, master in zip(opt.params, masters):
        if fp4_dist.is_nvfp4_tensor(p):
            ref = fp4_dist.quantize(master.cpu().to(torch.bfloat16))
            fields = ["rowwise_data", "rowwise_scale_inv", "amax"]
            if p.columnwise_data is not None:
                ref.make_columnwise()
                fields += ["columnwise_data", "columnwise_scale_inv"]
            bad += sum(not torch.equal(getattr(p, f).cpu(), getattr(ref, f)) for f in fields)
            n4 += 1
        else:
            bad += not torch.equal(p.detach().cpu(), master.cpu().to(p.dtype))
            nd += 1
    return n4, nd, bad


@torch.no_grad()
def sample(model, vocab, device, prompt: str = "The ", length: int = 160, seed: int = 0) -> str:
    """Text from the model (temperature 0.8), for a look at what it learned."""
    index = {c: i for i, c in enumerate(vocab)}
    ids = [index[c] for c in prompt if c in index]
    g = torch.Generator().manual_seed(seed)
    for _ in range(length):
        ctx = torch.tensor([ids[-model.cfg.seq:]], device=device)
        logits = model(ctx)[0, -1].float().cpu() / 0.8
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    return "".join(vocab[i] for i in ids)


@torch.no_grad()
def evaluate(model, batches: torch.Tensor) -> float:
    return float(model.loss(batches).item())


# --------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    end_with_launcher()  # a rank whose torchrun is killed (with its process group) ends instead of training on
    args = parse_args(argv)
    info = init_distributed(args.backend)
    rank0 = info.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    tokens, vocab = load_corpus(args.data)
    split = int(tokens.numel() * 0.9)
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    if min(train_tokens.numel(), val_tokens.numel()) <= args.seq + 1:
        raise SystemExit(f"train_lm: --seq {args.seq} is longer than the validation text ({val_tokens.numel()} of "
                         f"the {tokens.numel()} characters of {args.data}): choose a shorter --seq or more text")
    cfg = TinyLMConfig(vocab=len(vocab), dim=args.dim, hidden=args.hidden, heads=args.heads, layers=args.layers,
                       seq=args.seq)
    model, init = build_model(cfg, seed=args.seed, device=info.device)
    try:
        converted = fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16, compute=args.fp4_compute)
    except RuntimeError as e:  # --fp4-compute fp8 on a GPU without the FP8 block GEMMs: every rank says why
        raise SystemExit(f"train_lm: {e} (here: drop --fp4-compute fp8)") from None
    names = [n for n, _ in model.named_parameters()]
    stats = CommStats()
    opt = Zero1Optimizer(model.parameters(), lambda groups: torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0),
                         config=Zero1Config(bucket_numel=args.bucket_numel), master_init=[init[n] for n in names],
                         stats=stats)
    n_nvfp4 = len(opt.nvfp4_params)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"fp4_dist train_lm: {info.world_size} rank(s), backend {info.backend or 'none'}, device {info.device}, "
        f"launcher {info.launcher}")
    say(f"model: {n_params:,} parameters ({sum(p.numel() for p in opt.nvfp4_params):,} in {n_nvfp4} NVFP4 "
        f"weights, GEMMs in {args.fp4_compute}), vocab {len(vocab)}, {len(tokens):,} characters of text")
    for line in converted.compute_lines():  # which linears compute in the mode, and why the others do not
        say(line)
    if args.save is not None:  # one job per --save folder: a second one stops here, on every rank, before a step
        try:
            lock_root(args.save, take_over_other_host=args.take_over_lock)
        except RootLockedError as e:
            raise SystemExit(f"train_lm: rank {info.rank}: --save {args.save}: {e}") from None
    start = resume(args, opt, say)
    val = windows(val_tokens, 32, args.seq, seed=12345).to(info.device)
    say(f"validation loss {'before training' if not start else f'at step {start}'}: {evaluate(model, val):.3f}")

    stats.reset()
    progress = Progress(args.steps, rank0, bar=sys.stdout.isatty() and not args.no_progress, every=args.log_every,
                        start=start)  # fmt: skip
    loss_sum = torch.zeros(1, device=info.device)
    first_loss = last_loss = float("nan")
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        for g in opt.param_groups:  # linear warmup, then cosine decay (each step hands them to the inner optimizer)
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        batch = windows(train_tokens, args.batch, args.seq, seed=args.seed * 1_000_003 + step * 997 + info.rank)
        loss = model.loss(batch.to(info.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_sum.copy_(loss.detach())
        all_reduce_sum_(loss_sum)  # mean over ranks for the display (not an optimizer collective)
        last_loss = loss_sum.item() / info.world_size
        first_loss = last_loss if step == start else first_loss
        progress.update(step, last_loss)
        if args.save is not None and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            folder = step_folder(args.save, step + 1)
            # every rank; committed whole, with the options that made it
            checkpoint.save({"optimizer": sharded_state_dict(opt), OPTIONS_KEY: json.dumps(recorded_options(args))},
                            folder)  # fmt: skip
            say(f"saved step {step + 1} to {folder}")
    seconds = time.perf_counter() - t0
    if start < args.steps:
        report_step(say, opt, stats, args.steps - start, seconds, first_loss, last_loss, evaluate(model, val),
                    fp8_copy_bytes(model) or None)  # fmt: skip
    if rank0:
        print("sample:", repr(sample(model, vocab, info.device)))
    code = finish(say, model, opt, info)
    if args.save is not None:
        release_root(args.save)
    return code


def resume(args, opt: Zero1Optimizer, say) -> int:
    """The step to start from: the newest complete checkpoint under ``--save`` loaded into `opt` (masters and Adam
    state; the weights re-cast and gathered), else 0. Batches and the learning rate follow from the step, so a
    resumed run trains on as the uninterrupted one would."""
    found = latest_complete_checkpoint(args.save) if args.save is not None else None
    if found is None:
        return 0
    try:  # refuses a damaged file, other options and another model's checkpoint before loading anything
        check_options(args, found.path, verify=not args.no_verify)
        load_checkpoint(opt, found.path, verify=False)  # check_options checked its files
    except DamagedCheckpointError as e:
        raise SystemExit(f"train_lm: {e}") from None
    # The folder's name gives the step; AdamW's own count says which step the state is of (every weight steps).
    counted = {int(st["step"]) for st in opt.state.values() if "step" in st}
    if counted and counted != {found.step}:
        raise SystemExit(f"train_lm: {found.path} holds the optimizer state of step {max(counted)}, not {found.step}: "
                         "a folder copied or renamed under another step's name; restore its name or remove it")
    if found.step >= args.steps:
        say(f"resumed from {found.path}: step {found.step}, at or past --steps {args.steps}; nothing to train")
    else:
        say(f"resumed from {found.path}: step {found.step} of {args.steps}")
    return found.step


def report_step(say, opt, stats: CommStats, steps: int, seconds: float, first: float, last: float, val: float,
                fp8_bytes: Optional[int] = None):  # fmt: skip
    per_step = opt.gathered_bytes_per_step()
    gathered = stats.bytes["all_gather"] / steps
    ratio = gathered / per_step["bf16_equivalent"]
    say(f"trained {steps} steps in {seconds:.1f}s ({steps / seconds:.1f} step/s); train loss {first:.3f} -> "
        f"{last:.3f}; validation loss {val:.3f}")
    kib = {k: v / 1024 for k, v in per_step.items()}
    say(f"param all-gather per step: {gathered / 1024:.1f} KiB (NVFP4 weights {kib['nvfp4']:.1f} KiB + tile scales "
        f"{kib.get('nvfp4_scales', 0.0):.1f} KiB + dense params {kib['dense']:.1f} KiB) vs "
        f"{kib['bf16_equivalent']:.1f} KiB for a bf16 gather = {ratio:.3f}x")
    mem = {k: v / 1024 for k, v in opt.param_memory_bytes().items()}
    pool = fp4_dist.compute.pool_bytes() / 1024
    copies = (f"FP8 copies of the NVFP4 weights {fp8_bytes / 1024:.1f} KiB" if fp8_bytes is not None
              else f"bf16 copies of the NVFP4 weights: lean pool {pool:.1f} KiB, kept copies "
                   f"{mem['compute_copies']:.1f} KiB")  # fmt: skip
    say(f"param memory per rank: NVFP4 gather buffer {mem['nvfp4']:.1f} KiB + dense params {mem['dense']:.1f} KiB; "
        f"{copies}")
    calls = {k: v / steps for k, v in stats.calls.items() if k != "all_reduce"}
    say(f"collectives per step: {calls} + {stats.calls['all_reduce'] / steps:.0f} all-reduces (the gradient check "
        f"and the amaxes; {stats.bytes['all_reduce'] / steps / 1024:.2f} KiB)")


def finish(say, model, opt, info) -> int:
    n4, nd, bad = parity_check(model, opt)
    total = torch.tensor([float(bad)], device=info.device)
    all_reduce_sum_(total)
    ok = total.item() == 0
    say(f"parity check: {n4} NVFP4 weights and {nd} dense params on {info.world_size} rank(s) vs "
        f"quantize(full fp32 master) on the CPU oracle: {'PASS (bit-identical)' if ok else f'FAIL ({int(total.item())} fields differ)'}")
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
