"""How one Megatron GPT trains with NVFP4 weights against bf16: several variants x seeds of the project's Megatron
trainer (`examples.megatron_pretrain_gpt`), one run per GPU side by side (in turns when there are more runs than
GPUs), every run's per-iteration record kept, the figures drawn, and any two runs compared step by step.

    python bench/convergence.py run --out DIR [--variants bf16,fp4,fake,fp4-fl] [--seeds 1234,4321]
        [--lr 6e-4] [--model gpt12x1024] [--iters 5000] [--gpus N] [--per-gpu K] [--corpus PATH]
        [--stop-at N] [-- extra Megatron args]
    python bench/convergence.py plot DIR [DIR ...] [--out FIGDIR] [--at 1000,2500,5000]   # figures and tables
    python bench/convergence.py compare A.json B.json                # the first iteration where two runs differ

Variants: ``bf16`` (plain bf16 weights), ``fp4`` (``--fp4-param-gather``: NVFP4 weights, 4-bit gather, lean
compute), ``fake`` (``--fp4-fake-quant``: bf16 weights, the NVFP4 forward of every step; bitwise fp4's reference),
``fp4-fl`` (fp4 with the first and the last layer in bf16), ``kept`` (fp4 with kept compute copies,
``--fp4-compute-copy``), ``fp8`` (fp4 in the FP8 compute mode, ``--fp4-compute fp8``: Hopper GPUs), ``nvfp4`` (the
whole NVFP4 recipe emulated, ``--fp4-compute nvfp4``), ``nvfp4-plain`` (the recipe without its random Hadamard
transform and stochastic rounding: the paper's ablation). Every run
writes DIR/<variant>-lr<lr>-s<seed>.json (the trainer's record: loss, grad norm and lr of every iteration,
validation losses; written after each evaluation and at the end) and .log, and DIR/runs.json says how they
were made; a run stopped before its end (a time limit) is plotted as far as its record, or without one its log,
goes. The plots read those files and draw with matplotlib: ``scripts/bootstrap.sh`` installs it into ``.venv``,
``pip install '.[bench]'`` into another environment.

Runs longer than one sitting (a device call's time limit): ``--stop-at N`` has every run save a checkpoint under
DIR/checkpoints/<run> and exit after iteration N (and 2N, 3N, ...: Megatron's ``--exit-interval``); ``run`` again
with the same DIR and arguments, with or without ``--stop-at``, resumes each unfinished run from its checkpoint (the
trainer resumes bit for bit) and skips the finished ones. The record then holds every iteration of every sitting.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {
    "bf16": [],
    "fp4": ["--fp4-param-gather"],
    "fake": ["--fp4-fake-quant"],
    "fp4-fl": ["--fp4-param-gather", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1",
               "--num-layers-at-end-in-bf16", "1"],
    "kept": ["--fp4-param-gather", "--fp4-compute-copy"],
    "fp8": ["--fp4-param-gather", "--fp4-compute", "fp8"],
    # the whole NVFP4 recipe (4-bit activations and gradients too; docs/nvfp4_recipe.md), and its ablation without
    # the random Hadamard transform and without stochastic rounding (every E2M1 value rounded to nearest even)
    "nvfp4": ["--fp4-param-gather", "--fp4-compute", "nvfp4"],
    "nvfp4-plain": ["--fp4-param-gather", "--fp4-compute", "nvfp4", "--fp4-compute-option", "rht=false",
                    "--fp4-compute-option", "stochastic_rounding=false"],
}  # fmt: skip
MODELS = {
    "gpt12x1024": "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
                  "--max-position-embeddings 512 --micro-batch-size 16 --global-batch-size 16",
    "gpt4x256": "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 --seq-length 256 "
                "--max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 16",
    "tiny": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--micro-batch-size 2 --global-batch-size 4",
}  # fmt: skip
COMMON = ("--bf16 --use-distributed-optimizer --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 "
          "--split 98,2,0 --eval-iters 20 --no-gradient-accumulation-fusion")


def run_name(variant: str, lr: float, seed: int) -> str:
    return f"{variant}-lr{lr:g}-s{seed}"


def checkpoints(out: Path, name: str) -> Path:
    """Where a run's checkpoints go (``--stop-at``) and where a later ``run`` resumes it from."""
    return out / "checkpoints" / name


def resumable(out: Path, name: str) -> bool:
    """Whether the run has a checkpoint to resume from (the trainer's latest-iteration file, written last)."""
    return (checkpoints(out, name) / "latest_checkpointed_iteration.txt").exists()


def recorded(out: Path, name: str) -> int:
    """The last iteration the run's record holds (0: no record, or an empty one)."""
    try:
        records = json.loads((out / f"{name}.json").read_text())["records"]
    except (OSError, ValueError, KeyError):
        return 0
    return records[-1]["iteration"] if records else 0


def finished(out: Path, name: str, iters: int) -> bool:
    """Whether the run's record holds every iteration up to `iters` (nothing left to train)."""
    return recorded(out, name) >= iters


def command(args, variant: str, seed: int, out: Path) -> list[str]:
    warmup = args.warmup if args.warmup is not None else max(1, args.iters // 25)
    train = [*MODELS[args.model].split(), *COMMON.split(), "--lr", f"{args.lr:g}", "--min-lr", f"{args.lr / 10:g}",
             "--lr-warmup-iters", str(warmup), "--train-iters", str(args.iters), "--seed", str(seed),
             "--eval-interval", str(args.eval_interval or max(1, args.iters // 10)), "--log-interval",
             str(args.log_interval), "--fp4-log-json", str(out / f"{run_name(variant, args.lr, seed)}.json"),
             "--fp4-master-digest"]  # fmt: skip
    if args.corpus:
        train += ["--fp4-corpus", args.corpus]
    name = run_name(variant, args.lr, seed)
    if args.stop_at:
        train += ["--save", str(checkpoints(out, name)), "--save-interval", str(args.stop_at), "--exit-interval",
                  str(args.stop_at)]
    if resumable(out, name):
        train += ["--load", str(checkpoints(out, name))]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "examples.megatron_pretrain_gpt", *train, *VARIANTS[variant], *args.extra]  # fmt: skip


def gpus_available() -> int:
    import torch

    return torch.cuda.device_count()


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"convergence: unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    evaluation = args.eval_interval or max(1, args.iters // 10)
    if args.stop_at is not None and (not 0 < args.stop_at < args.iters or args.stop_at % evaluation):
        raise SystemExit(f"convergence: --stop-at is an iteration before --iters ({args.iters}) and a multiple of the "
                         f"evaluation interval ({evaluation}, so that the sittings evaluate where one whole run "
                         f"does), got {args.stop_at}")
    gpus = args.gpus if args.gpus is not None else gpus_available()
    slots = max(1, gpus) * args.per_gpu
    todo = [(v, s) for s in args.seeds for v in args.variants]
    meta = dict(experiment(args), seeds=args.seeds, variants={v: VARIANTS[v] for v in args.variants},
                tokens_per_iteration=_tokens_per_iteration(args.model), stop_at=args.stop_at,
                commands=_earlier_commands(out, args))
    meta["commands"].update({run_name(v, args.lr, s): command(args, v, s, out) for v, s in todo})
    failed = []
    for v, s in todo:  # one record per run, of every sitting so far; a run that cannot resume is not run
        name = run_name(v, args.lr, s)
        _settle(out, name, args.iters)
        gap = _gap(out, name) if resumable(out, name) else None
        if gap:
            print(f"convergence: {name} cannot resume: {gap}", flush=True)
            failed.append(name)
    done = [run_name(v, args.lr, s) for v, s in todo if finished(out, run_name(v, args.lr, s), args.iters)]
    if done:
        print(f"convergence: finished already, not run again: {', '.join(done)}", flush=True)
    _write(out / "runs.json", meta)
    todo = [(v, s) for v, s in todo if run_name(v, args.lr, s) not in done + failed]
    names = [run_name(v, args.lr, s) for v, s in todo]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # fmt: skip
    # Each run sees one GPU; under an outer CUDA_VISIBLE_DEVICES the runs take its devices, not the first ones.
    outer = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = outer if len(outer) >= gpus else [str(i) for i in range(gpus)]
    running: dict = {}
    start, last_note = time.time(), 0.0
    print(f"convergence: {len(todo)} runs of {args.model}, {args.iters} iterations, {slots} at a time -> {out}",
          flush=True)
    while todo or running:
        free = [g for g in range(slots) if g not in running]
        while todo and free:
            (variant, seed), gpu = todo.pop(0), free.pop(0)
            name = run_name(variant, args.lr, seed)
            if resumable(out, name):  # the record of the sittings so far, merged with this one's when it ends
                _keep_earlier(out, name)
            log = open(out / f"{name}.log", "a" if resumable(out, name) else "w")
            where = dict(env, CUDA_VISIBLE_DEVICES=visible[gpu % gpus]) if gpus else env  # no GPU: CPU ranks
            proc = subprocess.Popen(command(args, variant, seed, out), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=where)
            running[gpu] = (name, proc, log, time.time())
        time.sleep(1)
        for gpu, (name, proc, log, t0) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                ok = proc.returncode == 0 and (out / f"{name}.json").exists()
                state = f"FAILED (exit {proc.returncode})"
                if ok:
                    _settle(out, name, args.iters)
                    state = "done" if finished(out, name, args.iters) else f"stopped at {recorded(out, name)}"
                print(f"convergence: {name} {state} in {time.time() - t0:.0f} s", flush=True)
                if not ok:
                    failed.append(name)
                del running[gpu]
        if time.time() - last_note > 60 and running:
            last_note = time.time()
            print(f"convergence: {time.time() - start:.0f} s: " + ", ".join(
                f"{name} at iteration {_last_iteration(out / f'{name}.log')}" for name, *_ in running.values()),
                flush=True)  # fmt: skip
    paused = [n for n in names if n not in failed and not finished(out, n, args.iters)]
    print(f"convergence: {len(failed)} failed {failed}" if failed else
          f"convergence: {len(paused)} of {len(names)} runs stopped before iteration {args.iters}; the same command "
          "again resumes them" if paused else "convergence: every run finished", flush=True)  # fmt: skip
    return 1 if failed else 0


def _earlier(out: Path, name: str) -> Path:
    return out / f"{name}.earlier.json"


def _keep_earlier(out: Path, name: str) -> None:
    """Before a sitting resumes a run: its record so far (`_settle`d) waits as DIR/<run>.earlier.json."""
    record = out / f"{name}.json"
    if record.exists():
        record.rename(_earlier(out, name))


def _settle(out: Path, name: str, iters: int) -> None:
    """One record of every sitting of a run, DIR/<run>.json (iterations and evaluations by iteration, the later
    sitting's where both have one), complete when it reaches `iters`: after a sitting, and before the next call
    decides what to run (a sitting stopped before this could leave the earlier record beside its own, or alone)."""
    record, earlier = out / f"{name}.json", _earlier(out, name)
    if not earlier.exists():
        return
    now = json.loads(earlier.read_text())
    if record.exists():
        now = _combined(now, json.loads(record.read_text()))
    now["complete"] = bool(now["records"]) and now["records"][-1]["iteration"] >= iters
    _write(record, now)
    earlier.unlink()


def _write(path: Path, data: dict) -> None:
    """A file of DIR that later calls read (runs.json, a run's merged record), written whole or not at all: a call
    killed while writing leaves the earlier version, as the trainer's own records do."""
    from fp4_dist.checkpoint.atomic import write_file_atomically  # imports torch: only `run` writes

    write_file_atomically(path, json.dumps(data, indent=1))


def _gap(out: Path, name: str) -> Optional[str]:
    """Why a run cannot resume from its checkpoint (None: it can): its record lacks iterations the checkpoint has
    trained (a sitting stopped between saving and recording them), which no later sitting would record."""
    latest = int((checkpoints(out, name) / "latest_checkpointed_iteration.txt").read_text())
    try:
        have = {r["iteration"] for r in json.loads((out / f"{name}.json").read_text())["records"]}
    except OSError:
        have = set()
    missing = [i for i in range(1, latest + 1) if i not in have]
    if not missing:
        return None
    return (f"its checkpoint is at iteration {latest}, but its record lacks iterations {missing[0]}-{missing[-1]}; "
            f"remove {checkpoints(out, name)} and {out / (name + '.json')} to train it again from the start")


def experiment(args) -> dict:
    """What the runs of one DIR share: a later call that resumes or skips runs there must be the same experiment."""
    return {"model": args.model, "model_args": MODELS[args.model], "common": COMMON, "lr": args.lr,
            "iters": args.iters, "warmup": args.warmup, "eval_interval": args.eval_interval, "extra": args.extra,
            "corpus": args.corpus, "corpus_sha256": corpus_digest(args.corpus)}  # fmt: skip


@functools.lru_cache(maxsize=None)
def corpus_digest(corpus: Optional[str]) -> Optional[str]:
    """sha256 of the text the trainer reads (`examples.megatron_data.corpus_files`: a file, or a folder's *.txt
    files in name order, each after its name), so that runs of different days can show they read the same text;
    None for the trainer's embedded corpus. A path with no text raises, naming it, as the trainer would."""
    if corpus is None:
        return None
    from examples.megatron_data import corpus_files

    try:
        files = corpus_files(corpus)
    except FileNotFoundError as e:
        raise SystemExit(f"convergence: --corpus: {e}") from None
    digest = hashlib.sha256()
    for path in files:
        if path != Path(corpus):
            digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def _earlier_commands(out: Path, args) -> dict:
    """The commands of the runs an earlier call of the same experiment made in DIR (kept in runs.json, so that the
    plots find them); a DIR holding another experiment's records or checkpoints is refused."""
    try:
        meta = json.loads((out / "runs.json").read_text())
    except OSError:
        return {}
    # A folder from before the corpus's digest was recorded: the digest is unknown there, not different.
    differ = sorted(k for k, v in experiment(args).items() if meta.get(k, v if k == "corpus_sha256" else None) != v)
    names = list(meta.get("commands", {}))
    if differ and any((out / f"{n}.json").exists() or _earlier(out, n).exists() or resumable(out, n) for n in names):
        raise SystemExit(f"convergence: {out} holds runs of another experiment (runs.json differs in "
                         f"{', '.join(differ)}); choose another --out")
    return dict(meta.get("commands", {})) if not differ else {}


def _combined(before: dict, now: dict) -> dict:
    """The record of two sittings of one run: iterations and evaluations by iteration, `now`'s where both have one."""
    steps = {r["iteration"]: r for r in before["records"] + now["records"]}
    evals = dict(map(tuple, before["validation"] + now["validation"]))
    return dict(now, records=[steps[i] for i in sorted(steps)], validation=[[i, evals[i]] for i in sorted(evals)],
                start_iteration=before.get("start_iteration", 0),
                checkpoints=before.get("checkpoints", []) + now.get("checkpoints", []))


def _tokens_per_iteration(model: str) -> int:
    words = MODELS[model].split()
    return int(words[words.index("--seq-length") + 1]) * int(words[words.index("--global-batch-size") + 1])


def _last_iteration(log: Path) -> str:
    """The last iteration the trainer's log reports (its lines read ``iter N/M | ...``)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "?"
    found = _LOG_STEP.findall(text)
    return found[-1][0] if found else "0"


# ---------------------------------------------------------------------------------------------------- reading
def load_runs(folders) -> list[dict]:
    """Every run of the folders: {name, variant, lr, seed, tokens, loss, grad_norm, iterations, validation,
    stopped}. ``stopped`` is the last iteration of a run that did not finish (a time limit): its record as of its
    last evaluation, or without a record its log (every --log-interval iterations)."""
    runs = []
    for folder in map(Path, folders):
        meta = json.loads((folder / "runs.json").read_text())
        per_iteration = meta["tokens_per_iteration"]
        for name in meta["commands"]:
            path, log, earlier = folder / f"{name}.json", folder / f"{name}.log", _earlier(folder, name)
            if path.exists() or earlier.exists():  # complete: false while a run trains (written at each evaluation)
                record = json.loads((path if path.exists() else earlier).read_text())
                if path.exists() and earlier.exists():  # a resumed run stopped inside a sitting
                    record = _combined(json.loads(earlier.read_text()), record)
                if earlier.exists():
                    record["complete"] = False
                records, validation, digest = record["records"], record["validation"], record.get("master_digest")
                complete = record.get("complete", True)
            elif log.exists():
                (records, validation), digest, complete = _read_log(log), None, False
                if not records:
                    continue
            else:
                continue
            stopped = None if complete else (records[-1]["iteration"] if records else 0)
            variant, lr, seed = name.rsplit("-lr", 1)[0], meta["lr"], int(name.rsplit("-s", 1)[1])
            its = [r["iteration"] for r in records]
            runs.append(dict(name=name, variant=variant, lr=lr, seed=seed, iterations=its,
                             per_iteration=per_iteration, tokens=[i * per_iteration for i in its],
                             loss=[r["loss"] for r in records], grad_norm=[r["grad_norm"] for r in records],
                             validation=[(i * per_iteration, v) for i, v in validation], stopped=stopped,
                             digest=digest))  # fmt: skip
    return runs


_LOG_STEP = re.compile(r"\biter\s+(\d+)\s*/\s*\d+\s*\|\s*loss\s+([-\d.eE+naif]+)\s*\|\s*grad norm\s+([-\d.eE+naif]+)")
_LOG_VALIDATION = re.compile(r"validation loss at iteration (\d+): lm loss ([-\d.eE+naif]+)")


def _read_log(log: Path) -> tuple[list[dict], list[tuple[int, float]]]:
    """The trainer's progress lines: ``iter N/M | loss L | grad norm G | ...`` and ``validation loss at iteration
    N: lm loss V``."""
    text = log.read_text(errors="replace")
    records = [dict(iteration=int(i), loss=float(l), grad_norm=float(g)) for i, l, g in _LOG_STEP.findall(text)]
    return records, [(int(i), float(v)) for i, v in _LOG_VALIDATION.findall(text)]


def smooth(values: list[float], iterations: list[int], weight: float = 0.98) -> list[float]:
    """Exponential moving average over iterations (weight per iteration, so that a run read from its log, one loss
    every --log-interval iterations, is smoothed like one recorded every iteration), with the bias correction of
    Adam's moments (the first values are not pulled to 0)."""
    out, avg, norm, last = [], 0.0, 0.0, 0
    for v, i in zip(values, iterations):
        w = weight ** max(1, i - last)
        avg, norm, last = w * avg + (1 - w) * v, w * norm + (1 - w), i
        out.append(avg / norm)
    return out


def table(runs: list[dict]) -> str:
    """Final validation loss per variant and learning rate: each seed, the mean and the spread, and the change
    against bf16's mean. Runs stopped before their end are named below it, not averaged."""
    groups: dict = {}
    for r in runs:
        if r["validation"] and r["stopped"] is None:
            groups.setdefault((r["lr"], r["variant"]), []).append((r["seed"], r["validation"][-1][1]))
    lines = ["| lr | variant | final validation loss per seed | mean | spread (max - min) | vs bf16 |",
             "|---|---|---|---|---|---|"]
    for (lr, variant), seeds in sorted(groups.items(), key=lambda kv: (kv[0][0], _variant_order(kv[0][1]))):
        mean = sum(v for _, v in seeds) / len(seeds)
        base = groups.get((lr, "bf16"))
        rel = f"{100 * (mean / (sum(v for _, v in base) / len(base)) - 1):+.2f}%" if base else "-"
        lines.append(f"| {lr:g} | {variant} | " + ", ".join(f"{v:.4f} (seed {s})" for s, v in sorted(seeds))
                     + f" | {mean:.4f} | {max(v for _, v in seeds) - min(v for _, v in seeds):.4f} | {rel} |")
    stopped = [r for r in runs if r["stopped"] is not None]
    if stopped:
        lines.append("\nstopped before the end (not averaged above; in the table by iteration): "
                     + ", ".join(f"{r['name']} at iteration {r['stopped']}" for r in stopped))
    return "\n".join(lines)


def trajectory(runs: list[dict], at: list[int]) -> str:
    """Validation loss of every run at the given iterations (all its evaluations when ``at`` is empty)."""
    columns = at or sorted({t // r["per_iteration"] for r in runs for t, _ in r["validation"]})
    lines = ["| lr | variant | seed | " + " | ".join(str(i) for i in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for r in sorted(runs, key=lambda r: (r["lr"], _variant_order(r["variant"]), r["seed"])):
        seen = {t // r["per_iteration"]: v for t, v in r["validation"]}
        lines.append(f"| {r['lr']:g} | {r['variant']} | {r['seed']} | "
                     + " | ".join(f"{seen[i]:.4f}" if i in seen else "-" for i in columns) + " |")
    return "\n".join(lines)


def _variant_order(variant: str) -> int:
    return list(VARIANTS).index(variant) if variant in VARIANTS else len(VARIANTS)


def plot(args) -> int:
    runs = load_runs(args.folders)
    if not runs:
        raise SystemExit("convergence plot: no run (DIR/<run>.json or .log) in " + " ".join(args.folders))
    print(table(runs))
    print("\nvalidation loss by iteration\n" + trajectory(runs, args.at))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("convergence plot: the figures need matplotlib, which this Python lacks: run it with .venv/bin/python "
              "(bash scripts/bootstrap.sh makes it) or pip install '.[bench]'; tables only", file=sys.stderr)
        return 1
    out = Path(args.out or args.folders[0])
    out.mkdir(parents=True, exist_ok=True)
    colors = {"bf16": "tab:blue", "fp4": "tab:red", "fake": "tab:green", "fp4-fl": "tab:purple", "kept": "tab:orange",
              "fp8": "tab:brown"}
    for lr in sorted({r["lr"] for r in runs}):
        at = [r for r in runs if r["lr"] == lr]
        seeds = sorted({r["seed"] for r in at})
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        smoothed = [smooth(r["loss"], r["iterations"]) for r in at]  # runs of two folders may share a name
        for r, loss in zip(at, smoothed):
            shade = 1.0 - 0.45 * seeds.index(r["seed"]) / max(1, len(seeds) - 1)
            style = dict(color=colors.get(r["variant"], "black"), alpha=shade, linewidth=1.2,
                         label=f"{r['variant']}, seed {r['seed']}"
                               + (f" (stopped at {r['stopped']})" if r["stopped"] is not None else ""))  # fmt: skip
            mt = [t / 1e6 for t in r["tokens"]]
            axes[0].plot(mt, loss, **style)
            if r["validation"]:
                axes[1].plot([t / 1e6 for t, _ in r["validation"]], [v for _, v in r["validation"]], marker="o",
                             markersize=3, **style)  # fmt: skip
            axes[2].plot(mt, r["grad_norm"], **dict(style, linewidth=0.6))
        for ax, title in zip(axes, ("training loss (smoothed)", "validation loss", "gradient norm (before clipping)")):
            ax.set_title(title)
            ax.set_xlabel("tokens (millions)")
            ax.grid(alpha=0.3)
        shown = sorted(v for values in smoothed for v in values if math.isfinite(v))
        if shown:  # the first steps' losses (the top 5%) off the scale, so that the differences show
            axes[0].set_ylim(shown[0] * 0.97, shown[int(0.95 * (len(shown) - 1))] * 1.02)
        axes[2].set_yscale("log")
        axes[1].legend(fontsize=8)
        fig.suptitle(f"{len(at)} runs at lr {lr:g}")
        fig.tight_layout()
        path = out / f"convergence_lr{lr:g}.png"
        fig.savefig(path, dpi=110)
        print(f"wrote {path}")
    return 0


def compare(args) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    ra, rb = a["records"], b["records"]
    first = {}
    for key in ("loss", "grad_norm"):
        first[key] = next((x["iteration"] for x, y in zip(ra, rb) if x[key] != y[key]), None)
    n = min(len(ra), len(rb))
    digests = "equal" if a.get("master_digest") == b.get("master_digest") else "differ"
    print(f"{n} iterations in both: losses first differ at iteration {first['loss']}, grad norms at "
          f"{first['grad_norm']}; final master digests {digests}")
    at = min((i for i in first.values() if i is not None), default=None)
    if at is not None:
        print("| iteration | loss A | loss B | grad norm A | grad norm B |\n|---|---|---|---|---|")
        for x, y in zip(ra, rb):
            if at - 2 <= x["iteration"] <= at + 2:
                print(f"| {x['iteration']} | {x['loss']!r} | {y['loss']!r} | {x['grad_norm']!r} | {y['grad_norm']!r} |")
    return 0 if at is None else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", "fp4", "fake", "fp4-fl"])
    r.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1234, 4321])
    r.add_argument("--lr", type=float, default=6e-4)
    r.add_argument("--model", choices=sorted(MODELS), default="gpt12x1024")
    r.add_argument("--iters", type=int, default=5000)
    r.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: iters / 25)")
    r.add_argument("--eval-interval", type=int, default=None, help="default: iters / 10")
    r.add_argument("--log-interval", type=int, default=50)
    r.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every GPU this machine has)")
    r.add_argument("--per-gpu", type=int, default=1, help="runs at a time on each GPU (small models)")
    r.add_argument("--corpus", default=None, help="text file or folder (--fp4-corpus; default: the embedded one)")
    r.add_argument("--stop-at", type=int, default=None, metavar="N",
                   help="every run saves a checkpoint and exits after iteration N (2N, ...); run again to resume")
    q = sub.add_parser("plot")
    q.add_argument("folders", nargs="+")
    q.add_argument("--out", default=None, help="where the PNGs go (default: the first folder)")
    q.add_argument("--at", type=lambda s: [int(x) for x in s.split(",")], default=[],
                   help="iterations of the validation-loss table (default: every evaluation)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    if getattr(args, "corpus", None):  # the caller's path: the trainer runs in the repository's folder
        args.corpus = os.path.abspath(args.corpus)
    return {"run": run, "plot": plot, "compare": compare}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())
