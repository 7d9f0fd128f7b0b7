"""Megatron-Core --fp4-param-gather vs bf16 param gather: one torchrun job, one table.

    torchrun --nproc-per-node 2 bench/megatron_compare.py [--steps 200] [--rounds 2] [--paired-steps N] [--tiny]
        [--slow-link] [-- extra Megatron args, e.g. --grad-reduce-in-bf16]
    python bench/megatron_compare.py --pool OUT/p.1.json OUT/p.2.json ...   # pool --paired-only processes

Runs the same GPT (same seed, data, LR schedule, no gradient clipping) several times in this process:

    timing rounds, each  bf16, fp4, fp4, bf16 (ABBA)
              bf16   plain bf16 model (no quantization at all)  -> what NVFP4 does to the loss (information)
              fp4    --fp4-param-gather: NVFP4 weights, 4-bit all-gather, no checks between steps
              The median step of every fp4 run over that of every bf16 run, for information: whole runs take
              turns, so a slowdown lasting a run lands on one mode only (jobs of the small model read 0.99 to 1.10
              with no change to the code). Each round's own ratio is
              shown beside it.
    fp4 checked  fp4 again, its gathered bytes checked against quantize(full master) every --check-every
              steps                                      -> determinism: losses and masters bit-identical to fp4
    bf16-gather  --fp4-fake-quant: bf16 weights and bf16 param gather, the weights NVFP4-quantized in the forward
              every step. This is Megatron's "--fp4-param-gather off" run (NVFP4 compute, bf16 gather; its
              test_fp4_param.py asks for loss within 1e-2) and the per-step fake-quantization reference at once
                                                        -> fp4 loss within 1e-2 at every step, and in fact
                                                           bit-identical losses and fp32 masters
    paired       the step-time verdict: a bf16 model and an fp4 model built side by side in this process, trained
              in alternating steps (bf16, fp4, fp4, bf16, ... for --paired-steps each): whatever slows the machine
              down for seconds at a time (the lent GPU hosts' run-to-run spread is +-10%, more than the 2% this
              measures) hits both alike. The verdict is the fp4 median step over the bf16 one (limit 1.02x on
              GPUs); the median of the per-pair ratios is shown beside it. A step-time FAIL is a measurement: the
              script prints it in a verdict line and exits 0 unless --strict (a failed correctness check exits 1).
    memory       --memory-only VARIANT: one model trained alone in this process, its peak allocated and reserved
              memory per rank (run once per variant: bf16, fp4, kept, fp8).
    collectives  --collectives bf16,fp4: each model trained alone, in turn, every torch.distributed collective of
              its steps after the second counted on rank 0 (by wrapping torch.distributed's functions, as
              bench/traffic.py does): calls and bytes per step by collective, reduce op, dtype and group (its
              ranks: at TP 2 x DP 2, 0,1 is rank 0's tensor-parallel group and 0,2 its data-parallel one).
              Runs on gloo CPU ranks as on GPUs: what a mode adds to a step's collectives in a parallel layout.

Gradient clipping is off (--clip-grad 0): above data-parallel size 1 each rank sums the norm of the shards its
buffer layout gives it, so fp32 rounding can differ between runs whose buffers are laid out differently (at size 1
the adapter sums by parameter name, and fp4 equals fake quantization with clipping on too:
tests/unit/examples/test_megatron_fake_quant.py). Python's
garbage collector runs between steps only (Megatron's --manual-gc), so its pauses do not land in the step times
of whichever run happens to allocate more Python objects.
Prints a short table on rank 0 and writes it (with every loss) to --json when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
from fp4_dist.launch import shutdown  # noqa: E402
from fp4_dist.compute import pool_stats  # noqa: E402
from timing import SLOW_LINK, Span, max_over_ranks, timed  # noqa: E402 - bench/timing.py, beside this script

MODELS = {
    "gpt256": ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 "
               "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 16"),
    "gpt2048": ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16"),
    "gpt4096": ("--num-layers 6 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16384 "
                "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 8"),
    "tiny": ("--num-layers 2 --hidden-size 48 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 1 --kv-channels 12 --ffn-hidden-size 64 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8"),
}
STEP_RATIO_LIMIT = 1.02  # fp4 param gather's median step over the plain bf16 run's: the project's target
VARIANTS = {"fp4": ["--fp4-param-gather"], "kept": ["--fp4-param-gather", "--fp4-compute-copy"],
            "fp8": ["--fp4-param-gather", "--fp4-compute", "fp8"]}  # fmt: skip
"""The NVFP4 variants: the default (lean compute, a copy around each use), kept compute copies, and the FP8
compute mode (docs/fp8.md: Hopper only; emulated, and slow, on CPU ranks)."""
COMMON = ("--bf16 --use-distributed-optimizer --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine "
          "--clip-grad 0 --seed 1234 --deterministic-mode --fp4-master-digest --manual-gc")


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS),
                   help="gpt256: hidden 256 x 4 layers, seq 256; gpt2048: hidden 2048 x 8 layers, seq 1024, "
                        "micro-batch 4; tiny: a CPU smoke run")
    p.add_argument("--tiny", action="store_true", help="same as --model tiny")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds of bf16, fp4, fp4, bf16 runs")
    p.add_argument("--paired-steps", type=int, default=None,
                   help="steps of each model in the paired measurement (default: --steps)")
    p.add_argument("--paired-only", default=None, metavar="VARIANTS",
                   help="only the paired measurement, of bf16 against each of these comma-separated variants "
                        f"({', '.join(VARIANTS)}: the default lean compute, kept compute copies, the FP8 compute "
                        "mode), the order rotating "
                        "every step")
    p.add_argument("--check-every", type=int, default=20, help="parity check of the gathered NVFP4 bytes")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--json", default=None, help="write the table and all losses here (rank 0)")
    p.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                   help="no run: pool the --json outputs of several --paired-only processes into one verdict")
    p.add_argument("--phases", action="store_true",
                   help="with --paired-only: time each step's forward-backward (host, device) and the rest apart")
    p.add_argument("--lean-diagnostic", choices=("timers", "nofill"), default=None,
                   help="timers: host time per step in the lean mode's own calls (forward and backward uses) and "
                        "in the kept copies' lookup; nofill: lean's dequantize launches left out, its pool "
                        "buffers zeros (wrong values: what lean costs without them)")
    p.add_argument("--cast-diagnostic", choices=("noread",), default=None,
                   help="noread: the cast's per-step rank-agreement header is all-reduced but not read (no host "
                        "wait for the optimizer's kernels; what the read costs the step)")
    p.add_argument("--memory-only", default=None, metavar="VARIANT",
                   help="no timing: train one model (bf16 or one of the variants) for --steps steps in this process "
                        "and report its peak allocated and reserved memory per rank (max over ranks); one process "
                        "per variant, since the paired run holds every model at once")
    p.add_argument("--collectives", default=None, metavar="VARIANTS",
                   help="no timing: train each of these models (bf16 and/or variants, comma-separated) alone for "
                        "--steps steps and print the collectives per step of each (rank 0)")
    p.add_argument("--memory-sites", type=int, default=0, metavar="N",
                   help="with --memory-only on CUDA: also list the N allocating sites holding the most live memory "
                        "after the run (torch's memory history)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a verdict is FAIL (default: print the verdict and exit 0; under torchrun an "
                        "exit status of 1 reads like a crash)")
    p.add_argument("--slow-link", action="store_true",
                   help="NCCL over sockets only (timing.SLOW_LINK): a proxy for data parallelism across nodes; add "
                        "-- --grad-reduce-in-bf16 to see the gradient reduce-scatter at half the bytes")
    args, extra = p.parse_known_args()
    if args.slow_link:  # read by NCCL when the first communicator is made, after this
        os.environ.update(SLOW_LINK)
    return args, [a for a in extra if a != "--"]


def run(name: str, argv: list[str], what: str) -> pretrain_gpt.RunResult:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"\n=== {name}: {what}", flush=True)
    return pretrain_gpt.main(argv)


WARMUP = 5  # steps left out of every median (compilation, allocator warm-up)


def after_warmup(ms: list[float]) -> list[float]:
    """Step times after the first WARMUP (all of them when that is all there are)."""
    return ms[WARMUP:] or ms


def step_times(result: pretrain_gpt.RunResult) -> list[float]:
    return after_warmup([r.step_ms for r in result.records])


def median_ms(*results: pretrain_gpt.RunResult) -> float:
    return statistics.median([t for r in results for t in step_times(r)])


class Paired(NamedTuple):
    bf16_ms: list[float]
    fp4_ms: list[float]

    def _timed(self) -> tuple[list[float], list[float]]:
        return after_warmup(self.fp4_ms), after_warmup(self.bf16_ms)

    def medians(self) -> tuple[float, float]:
        fp4, bf16 = self._timed()
        return statistics.median(fp4), statistics.median(bf16)

    def pair_ratio(self) -> float:
        return statistics.median(f / b for f, b in zip(*self._timed()))



def paired(base: list[str], fp4: list[str], steps: int, variants: dict | None = None,
           phases: dict | None = None) -> dict[str, list[float]]:  # fmt: skip
    """Build a bf16 model and the fp4 models (`fp4`'s argv, or each of `variants` {name: argv}) side by side and
    train them in alternating steps, the order rotating every step; each step timed as the runs time theirs (host
    wall clock, device drained). Returns {name: step times}, "bf16" included. With `phases` (a dict), also fills
    {name: [(host ms until the forward-backward is issued, device ms until it is done), ...]} per step."""
    variants = variants or {"fp4": fp4}
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"\n=== paired: {', '.join(['bf16', *variants])} models in alternating steps, {steps} steps each",
              flush=True)
    # the schedule of the steps this runs (the base's warm-up was sized for --steps: past a short run's end otherwise)
    argv = ["--train-iters", str(steps), "--lr-warmup-iters", str(max(1, steps // 10))]
    sessions = {"bf16": pretrain_gpt.setup(base + argv)}
    sessions.update({name: pretrain_gpt.setup(v + argv) for name, v in variants.items()})
    times = {k: [] for k in sessions}
    s = sessions["bf16"]
    tokens, _ = pretrain_gpt.data_streams(s.args)
    plan = pretrain_gpt.BatchPlan(s.args.seq_length, s.args.micro_batch_size, s.args.global_batch_size,
                                  *pretrain_gpt._dp(), s.args.seed)  # fmt: skip
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    names = list(sessions)
    gc.collect()
    gc.disable()  # as --manual-gc: collections between steps only
    try:
        for it in range(1, steps + 1):
            r = (it - 1) % len(names)
            order = names[r:] + names[:r]
            for kind in order if it % 2 else order[::-1]:
                s = sessions[kind]
                mark = _PhaseMark() if phases is not None else None
                sync()
                t0 = time.perf_counter()
                if mark:
                    mark.start(t0)
                pretrain_gpt.train_step(s.args, it, tokens, plan, s.model, s.optimizer, s.scheduler, s.device,
                                        after_forward_backward=mark)  # fmt: skip
                sync()
                times[kind].append(1e3 * (time.perf_counter() - t0))
                if mark:
                    phases.setdefault(kind, []).append(mark.result())
            if it % 10 == 0:
                gc.collect()
    finally:
        gc.enable()
    for s in sessions.values():  # as pretrain_gpt.train: no overlapped param all-gather left in flight
        if s.model.ddp_config.overlap_param_gather:
            s.model.disable_forward_pre_hook(param_sync=True)
            s.model.enable_forward_pre_hook()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("done: median step " + ", ".join(f"{k} {statistics.median(after_warmup(v)):.1f} ms"
                                               for k, v in times.items()), flush=True)
    return times


class _PhaseMark:
    """Where one step's forward-backward ends: on the host (wall clock when it has been issued) and on the device
    (an event behind its work); a device time well past the host's means the GPU, not the host, set the pace."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def start(self, t0: float) -> None:
        self.t0 = t0
        if self.cuda:
            self.span = Span().start()

    def __call__(self) -> None:
        self.host = 1e3 * (time.perf_counter() - self.t0)
        if self.cuda:
            self.span.stop()

    def result(self) -> tuple[float, float]:
        """(host ms, device ms) to the end of the forward-backward; call after the step's device drain."""
        return self.host, (self.span.ms() if self.cuda else float("nan"))


def phase_table(times: dict[str, list[float]], phases: dict[str, list[tuple]]) -> list[tuple[str, str, str]]:
    """Per model: medians of the forward-backward's host and device end and of the rest of the step (optimizer,
    cast, all-gather), and each phase's median per-pair ratio against bf16's in the same step pairs."""
    rows = []
    split = {k: [(h, d, t - h) for (h, d), t in zip(after_warmup(v), after_warmup(times[k]))]
             for k, v in phases.items()}  # fmt: skip
    for name, per in split.items():
        host, dev, rest = (statistics.median(x[i] for x in per) for i in range(3))
        value = f"fwd-bwd issued {host:.1f} ms, done on the device {dev:.1f} ms; rest of the step {rest:.1f} ms"
        if name != "bf16":
            b = split["bf16"]
            ratios = [statistics.median(p[i] / q[i] for p, q in zip(per, b)) for i in (0, 2)]
            value += f"; per pair vs bf16: fwd-bwd issued {ratios[0]:.3f}, rest {ratios[1]:.3f}"
        rows.append((f"(diagnostic) phases, {name}", value, ""))
    return rows


def paired_table(times: dict[str, list[float]]) -> list[tuple[str, str, str]]:
    """A row per fp4 variant: its median step over bf16's, and the median per-step ratio, against the limit."""
    rows, base = [], after_warmup(times["bf16"])
    for name, ms in times.items():
        if name == "bf16":
            continue
        pair = Paired(times["bf16"], ms)
        f, b = pair.medians()
        value = (f"{f:.1f} / {b:.1f} ms = {f / b:.3f}; median per-pair ratio {pair.pair_ratio():.3f} "
                 f"({len(base)} alternating steps each)")
        verdict = ("PASS" if f / b <= STEP_RATIO_LIMIT else "FAIL") if torch.cuda.is_available() else ""
        rows.append((f"{name} vs plain bf16, paired (limit {STEP_RATIO_LIMIT})", value, verdict))
    return rows


def table(rounds: list[dict[str, list]], fp4b, gather, pair: Paired) -> tuple[list[tuple[str, str, str]], bool]:
    """`rounds`: each round's {"bf16": [two results], "fp4": [two results]}; `fp4b`: the checked fp4 run;
    `gather`: the fake-quant (bf16-gather) run."""
    fp4, bf16 = rounds[0]["fp4"][0], rounds[0]["bf16"][0]
    all_fp4 = [r for rnd in rounds for r in rnd["fp4"]]
    all_bf16 = [r for rnd in rounds for r in rnd["bf16"]]

    def max_diff(a, b):
        diff = [abs(x - y) for x, y in zip(a.losses, b.losses)]
        worst = max(range(len(diff)), key=diff.__getitem__)
        return diff[worst], worst + 1

    d_gather, at_gather = max_diff(fp4, gather)
    d_bf16, at_bf16 = max_diff(fp4, bf16)
    unequal = sum(a != b for a, b in zip(fp4.losses, gather.losses))
    reruns = all_fp4[1:] + [fp4b]
    unequal_rerun = sum(a != b for r in reruns for a, b in zip(fp4.losses, r.losses))
    same_masters = all(r.master_digest == fp4.master_digest for r in reruns)
    checks = [r.parity for r in fp4b.records if r.parity]
    rows = [
        ("fp4 vs bf16 param gather: max |loss diff|", f"{d_gather:.2e} at step {at_gather} (limit 1e-2)",
         "PASS" if d_gather <= 1e-2 else "FAIL"),
        ("fp4 vs fake-quant (bf16 gather): unequal losses", f"{unequal}/{len(fp4.losses)} steps",
         "PASS" if unequal == 0 else "FAIL"),
        ("fp4 vs fake-quant (bf16 gather): fp32 masters",
         "identical" if fp4.master_digest == gather.master_digest else "differ",
         "PASS" if fp4.master_digest == gather.master_digest else "FAIL"),
        (f"fp4 run {len(reruns) + 1} times: unequal losses / masters",
         f"{unequal_rerun} / {'identical' if same_masters else 'differ'}",
         "PASS" if unequal_rerun == 0 and same_masters else "FAIL"),
        ("gathered NVFP4 == quantize(full master)", f"{sum(c.startswith('ok') for c in checks)}/{len(checks)} checks",
         "PASS" if checks and all(c.startswith("ok") for c in checks) else "FAIL"),
        ("(info) fp4 vs unquantized bf16 model: max |loss diff|", f"{d_bf16:.2e} at step {at_bf16}; final "
         f"{fp4.losses[-1]:.4f} vs {bf16.losses[-1]:.4f}", ""),
    ]
    ok = all(r[2] != "FAIL" for r in rows)
    for i, rnd in enumerate(rounds, 1):
        order = [rnd["bf16"][0], rnd["fp4"][0], rnd["fp4"][1], rnd["bf16"][1]]
        rows.append((f"round {i}: median step bf16, fp4, fp4, bf16 (fp4 / bf16)",
                     ", ".join(f"{median_ms(r):.1f}" for r in order) + " ms "
                     f"({median_ms(*rnd['fp4']) / median_ms(*rnd['bf16']):.3f})", ""))
    for name, res in (("fp4 checked", fp4b), ("bf16-gather", gather)):
        rows.append((f"{name}: median step", f"{median_ms(res):.1f} ms", ""))
    for name, res in (("bf16", bf16), ("fp4", fp4), ("bf16-gather", gather)):
        mib = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(res.buffer_bytes.items()))
        rows.append((f"{name}: DDP buffers", mib, ""))
    gather_fp4 = fp4.buffer_bytes.get("param_uint8", 0) + fp4.buffer_bytes.get("param_bfloat16", 0)
    gather_bf16 = gather.buffer_bytes.get("param_bfloat16", 0)
    rows.append(("param all-gather bytes per step, fp4 / bf16 gather",
                 f"{gather_fp4 / 2**20:.3f} / {gather_bf16 / 2**20:.3f} MiB "
                 f"({gather_bf16 / max(gather_fp4, 1):.2f}x less)", ""))
    rows.append(("fp4 NVFP4 compute copies (bf16, next to the param buffers)",
                 f"{fp4.compute_copy_bytes / 2**20:.2f} MiB", ""))
    abba = median_ms(*all_fp4) / median_ms(*all_bf16)
    rows.append((f"(info) median step of {len(all_fp4)} fp4 / {len(all_bf16)} bf16 runs (ABBA rounds)",
                 f"{median_ms(*all_fp4):.1f} / {median_ms(*all_bf16):.1f} ms = {abba:.3f}", ""))
    f, b = pair.medians()
    ratio = f / b
    what = (f"fp4 param gather vs plain bf16: median step, paired ({len(pair._timed()[0])} alternating steps each)")
    value = f"{f:.1f} / {b:.1f} ms = {ratio:.3f}; median per-pair ratio {pair.pair_ratio():.3f}"
    if torch.cuda.is_available():
        step_ok = ratio <= STEP_RATIO_LIMIT
        rows.append((what, f"{value} (limit {STEP_RATIO_LIMIT})", "PASS" if step_ok else "FAIL"))
    else:  # CPU ranks: a smoke run, its step times say nothing about a GPU's
        step_ok = True
        rows.append(("(info, CPU ranks) " + what, value, ""))
    return rows, ok, step_ok


def _lean_diagnostic(kind) -> tuple[dict, dict]:
    """Patch the lean mode for `--lean-diagnostic` (see its help); returns ({name: seconds}, {name: calls}),
    filled as the patched calls run."""
    from fp4_dist.compute import lean, lean_order
    from fp4_dist.megatron import layers, lean_claim

    seconds, calls = {}, {}
    if kind == "timers":  # layers.py calls compute_view by the name it imported
        for owner, name, label in ((lean.LeanView, "value", "lean forward uses (LeanView.value)"),
                                   (lean_claim.Use, "refill", "lean backward uses (Use.refill)"),
                                   (layers, "compute_view", "kept copies' lookup (compute_view)")):  # fmt: skip
            setattr(owner, name, timed(seconds, calls, label, getattr(owner, name)))
    elif kind == "nofill":
        class NoFill:
            @staticmethod
            def bind_dequantize(datas, scales, amaxes, outs):
                for out in outs:
                    out.zero_()
                return lambda: None

        lean.kernels = lean_order.kernels = NoFill  # one weight's fill, and a batch's
    return seconds, calls


def _cast_diagnostic(kind) -> None:
    """Patch the TE-signature cast for `--cast-diagnostic` (see its help)."""
    if kind == "noread":
        from fp4_dist.cast import master_weights_check as mwc

        def check(self, group, stats, device):
            if self.size > 1:
                mwc.all_reduce_max_(self.header.to(device, copy=True), group, stats)

        mwc.CallAgreement.check = check


def memory_only(base: list[str], args) -> int:
    """Train one model and report its peak memory per rank (`--memory-only`)."""
    name = args.memory_only
    if name != "bf16" and name not in VARIANTS:
        raise SystemExit(f"megatron_compare: unknown --memory-only variant {name!r}; "
                         f"known: bf16, {', '.join(VARIANTS)}")
    argv = base + ([] if name == "bf16" else VARIANTS[name])
    cuda = torch.cuda.is_available()
    if cuda and args.memory_sites:
        torch.cuda.memory._record_memory_history(max_entries=1)  # stacks of live blocks, no trace
    result = run(name, argv, f"peak memory, {args.steps} steps")
    sizes = max_over_ranks([result.peak_allocated_bytes, torch.cuda.max_memory_reserved() if cuda else 0,
                            result.start_allocated_bytes, torch.cuda.memory_allocated() if cuda else 0])
    allocated, reserved, start, end = (x / 2**20 for x in sizes)
    median = statistics.median(step_times(result))
    row = {"variant": name, "peak_allocated_mib": allocated, "peak_reserved_mib": reserved, "median_step_ms": median,
           "start_allocated_mib": start, "end_allocated_mib": end,
           "compute_copy_mib": result.compute_copy_bytes / 2**20, "pool_mib": pool_stats()["bytes"] / 2**20}
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"\nmemory {name}: peak allocated {allocated:,.0f} MiB, reserved {reserved:,.0f} MiB; allocated at the "
              f"first step {start:,.0f} MiB, after the last {end:,.0f} MiB (max over ranks); compute copies "
              f"{row['compute_copy_mib']:,.0f} MiB, lean pool {row['pool_mib']:,.0f} MiB; median step {median:.1f} ms "
              "(not a timing verdict: unpaired)", flush=True)
        if cuda and args.memory_sites:
            print(live_memory_by_site(args.memory_sites), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
    shutdown()
    return 0


COUNTED_AFTER = 2  # steps left out of --collectives' counts: the first ones build buffers and bindings


def collectives(base: list[str], args) -> int:
    """Collectives per step of each model trained alone (`--collectives`), counted on rank 0 after its first steps."""
    from traffic import counted  # bench/traffic.py, beside this script

    names = args.collectives.split(",")
    unknown = [n for n in names if n != "bf16" and n not in VARIANTS]
    if unknown or len(set(names)) != len(names) or args.steps <= COUNTED_AFTER:
        raise SystemExit(f"megatron_compare: --collectives takes bf16 and/or {', '.join(VARIANTS)}, each once (got "
                         f"{args.collectives}) and --steps over {COUNTED_AFTER} (got {args.steps})")
    inner = pretrain_gpt.train_step
    per_variant = {}
    for name in names:
        calls, nbytes = Counter(), Counter()

        def step(run_args, iteration, *rest, **kwargs):
            if iteration <= COUNTED_AFTER:
                return inner(run_args, iteration, *rest, **kwargs)
            with counted(detail=True) as (c, b):
                out = inner(run_args, iteration, *rest, **kwargs)
            calls.update(c)
            nbytes.update(b)
            return out

        pretrain_gpt.train_step = step
        try:
            run(name, base + ([] if name == "bf16" else VARIANTS[name]), f"collectives, {args.steps} steps")
        finally:
            pretrain_gpt.train_step = inner
        per_variant[name] = (calls, nbytes)
    if dist.get_rank() == 0:
        steps = args.steps - COUNTED_AFTER
        keys = sorted({k for calls, _ in per_variant.values() for k in calls})
        print(f"\ncollectives per step on rank 0 (steps {COUNTED_AFTER + 1}-{args.steps}): calls, bytes (the largest "
              "tensor of each call)")
        print("| collective | op | dtype | group (ranks) | " + " | ".join(names) + " |")
        print("|---|---|---|---|" + "---|" * len(names))
        for key in keys:
            cells = [f"{calls[key] / steps:g}, {nbytes[key] / steps:,.0f}"
                     for calls, nbytes in per_variant.values()]
            print(f"| {' | '.join(map(str, key))} | " + " | ".join(cells) + " |", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({name: [[*k, c[k] / steps, b[k] / steps] for k in c]
                                                   for name, (c, b) in per_variant.items()}, indent=1))
    shutdown()
    return 0


def live_memory_by_site(top: int) -> str:
    """The live CUDA allocations of this rank grouped by the first frame in fp4_dist, Megatron or the example
    trainer that made them (torch's memory history), largest first: where resident memory sits."""
    sites: dict[str, int] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or []
            where = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
                          if any(k in f["filename"] for k in ("fp4_dist/", "megatron/", "examples/"))),
                         "(no frame of ours)")  # fmt: skip
            sites[where] = sites.get(where, 0) + block["size"]
    rows = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return "live memory by allocating site (rank 0):\n" + "\n".join(f"  {b / 2**20:10,.1f} MiB  {w}" for w, b in rows)


def exit_status(rows, strict: bool) -> int:
    """0 unless `strict` and a row's verdict is FAIL; the verdict line says which (a FAIL is a measurement, not a
    crash: under torchrun a non-zero exit prints a ChildFailedError)."""
    failed = [r[0] for r in rows if r[2] == "FAIL"]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"\nverdict: {'FAIL: ' + '; '.join(failed) if failed else 'PASS'}"
              + (" (exit 1: --strict)" if failed and strict else ""), flush=True)
    return 1 if failed and strict else 0


def paired_only(base: list[str], args) -> int:
    unknown = set(args.paired_only.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"megatron_compare: unknown --paired-only variants {sorted(unknown)}; known: {list(VARIANTS)}")
    variants = {v: base + VARIANTS[v] for v in args.paired_only.split(",")}
    seconds, calls = _lean_diagnostic(args.lean_diagnostic)
    phases = {} if args.phases else None
    times = paired(base, [], args.paired_steps or args.steps, variants, phases)
    rows = paired_table(times) + (phase_table(times, phases) if phases else [])
    steps = len(times["bf16"])
    for name, s in seconds.items():
        rows.append((f"(diagnostic) host in {name}", f"{1e3 * s / steps:.2f} ms per step, "
                     f"{calls[name] / steps:.0f} calls", ""))  # fmt: skip
    lean = pool_stats()
    if lean["uses"]:
        rows.append(("(info) lean: launches / copies / uses, pool", f"{lean['launches']} / {lean['copies']} / "
                     f"{lean['uses']}, {lean['bytes'] / 2**20:.0f} MiB ({lean['depth']} layers deep), replaced "
                     f"{lean['replaced']}", ""))  # fmt: skip
    if dist.get_rank() == 0:
        width, label = max(len(r[0]) for r in rows), "model " + ("tiny" if args.tiny else args.model)
        print(f"\n{label:<{width}} | result | verdict\n{'-' * (width + 30)}")
        for name, value, verdict in rows:
            print(f"{name:<{width}} | {value} | {verdict}")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "step_ms": times, "phases": phases}, indent=1))
    status = exit_status(rows, args.strict)
    shutdown()
    return status


def pair_ratios(step_ms: dict, name: str) -> list[float]:
    return [v / b for v, b in zip(after_warmup(step_ms[name]), after_warmup(step_ms["bf16"]))]


def pool(files: list[str], strict: bool = False) -> int:
    """Pool the paired measurements of several processes (`--paired-only ... --json F`, run again for each F): one
    process's per-pair ratio moves by several percent between processes on the lent hosts, more than the effects
    being measured, so a verdict wants several. Prints, per variant, each process's median per-pair ratio to bf16,
    their median and the median over all pairs; the verdict (the processes' median against the step limit) for GPU
    runs only."""
    outputs = [json.loads(Path(f).read_text()) for f in files]
    runs = [o["step_ms"] for o in outputs]
    judged = all(any(row[2] for row in o["rows"]) for o in outputs)  # CPU runs carry no verdict: nor does this
    names = [n for n in runs[0] if n != "bf16"]
    print(f"| variant | per-pair ratio of each of {len(runs)} processes | median of those | median of all pairs "
          f"| verdict (<= {STEP_RATIO_LIMIT}) |\n|---|---|---|---|---|")
    ok = True
    for name in names:
        each = [statistics.median(pair_ratios(r, name)) for r in runs if name in r]
        pooled = statistics.median([x for r in runs if name in r for x in pair_ratios(r, name)])
        verdict = statistics.median(each) <= STEP_RATIO_LIMIT or not judged
        ok &= verdict
        print(f"| {name} | {', '.join(f'{x:.3f}' for x in each)} | {statistics.median(each):.3f} | {pooled:.3f} "
              f"| {('PASS' if verdict else 'FAIL') if judged else '(CPU ranks: none)'} |")
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}" + (" (exit 1: --strict)" if not ok and strict else ""))
    return 1 if not ok and strict else 0


def main() -> int:
    args, extra = parse()
    if args.pool:
        return pool(args.pool, args.strict)
    if args.rounds < 1:
        raise SystemExit("megatron_compare: --rounds must be >= 1")
    if args.paired_steps is not None and args.paired_steps < 1:
        raise SystemExit("megatron_compare: --paired-steps must be >= 1")
    model = MODELS["tiny" if args.tiny else args.model].split()
    base = model + COMMON.split() + ["--train-iters", str(args.steps), "--log-interval", str(args.log_interval),
                                     "--lr-warmup-iters", str(max(1, args.steps // 10))]
    base += extra
    fp4 = base + ["--fp4-param-gather"]
    _cast_diagnostic(args.cast_diagnostic)
    if args.memory_only:
        return memory_only(base, args)
    if args.collectives:
        return collectives(base, args)
    if args.paired_only:
        return paired_only(base, args)
    rounds = []
    for i in range(1, args.rounds + 1):
        rnd = {"bf16": [], "fp4": []}
        for j, kind in enumerate(("bf16", "fp4", "fp4", "bf16")):
            what = "plain bf16 model, no quantization" if kind == "bf16" else "NVFP4 weights, 4-bit param all-gather"
            rnd[kind].append(run(f"round {i}/{args.rounds}, run {j + 1}/4: {kind}", fp4 if kind == "fp4" else base,
                                 what))
        rounds.append(rnd)
    fp4b = run("fp4 checked", fp4 + ["--fp4-check-every", str(args.check_every)],
               "the same as fp4, gathered bytes checked (determinism, parity)")
    gather = run("bf16-gather", base + ["--fp4-fake-quant"],
                 "bf16 weights and gather, NVFP4-quantized forward (fake quant)")
    times = paired(base, fp4, args.paired_steps or args.steps)
    pair = Paired(times["bf16"], times["fp4"])
    rows, ok, step_ok = table(rounds, fp4b, gather, pair)
    if dist.get_rank() == 0:
        width = max(len(r[0]) for r in rows)
        print(f"\n{'check':<{width}} | result | verdict\n{'-' * (width + 30)}")
        for name, value, verdict in rows:
            print(f"{name:<{width}} | {value} | {verdict}")
        print(f"\nOVERALL: {'PASS' if ok and step_ok else 'FAIL'} ({fp4b.world_size} ranks, {args.steps} steps)"
              + ("" if ok else ": a correctness check failed (exit 1)")
              + ("" if step_ok else ": the step time is over its limit"
                 + (" (exit 1: --strict)" if args.strict else " (a measurement: exit 0 without --strict)")),
              flush=True)
        if args.json:
            losses = {"fp4": rounds[0]["fp4"][0].losses, "bf16": rounds[0]["bf16"][0].losses,
                      "fp4 checked": fp4b.losses, "bf16-gather": gather.losses}
            steps = {f"round {i} {k} {j}": [r.step_ms for r in res.records]
                     for i, rnd in enumerate(rounds, 1) for k, rs in rnd.items() for j, res in enumerate(rs, 1)}
            steps.update({"paired bf16": pair.bf16_ms, "paired fp4": pair.fp4_ms})
            record = {"rows": rows, "ok": ok and step_ok, "losses": losses, "step_ms": steps}
            Path(args.json).write_text(json.dumps(record, indent=1))
    shutdown()
    return 0 if ok and (step_ok or not args.strict) else 1


if __name__ == "__main__":
    sys.exit(main())
