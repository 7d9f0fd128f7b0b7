"""Where a Megatron step's host time goes: cProfile of the same steps with and without --fp4-param-gather.

    torchrun --nproc-per-node 2 bench/megatron_profile.py [--model gpt256] [--steps 30]
        [--gpu | --syncs | --phases] [--compute fp8]
        [-- extra Megatron args, e.g. --overlap-param-gather --overlap-grad-reduce]

Host-bound steps (small models) show every extra Python call of the NVFP4 path; rank 0 prints, for each mode,
the median step time and the functions with the largest own time, then the fp4_dist functions by cumulative
time.

--gpu profiles the device instead (torch.profiler, steps 6 to --steps): the GPU time per step of every kernel in
each mode, the kernels only one mode runs, the GPU's busy time against the wall time of those steps, and each
collective's device and exposed time (run under the NCCL environment of timing.SLOW_LINK in bench/timing.py, with or
without -- --grad-reduce-in-bf16, for what a slow link leaves exposed). It tells extra device work of the NVFP4 path
apart from host time and from the machine's run-to-run noise.
--syncs counts the calls that make the host wait for the GPU (torch's sync debug mode), per step, by caller.
--compute fp8 runs the NVFP4 side in the FP8 compute mode (Hopper) instead of the default lean mode.
--phases times the host (wall clock around the calls, nothing traced, no synchronisation added) per step and
phase: Megatron's forward-backward and optimizer step, and inside the step the NVFP4 path's cast, its
non-finite check, the post-all-gather refresh and the ops that still reach NVFP4Tensor's Python dispatch (by op),
in runs bf16, fp4, bf16, fp4: the host cost fp4 adds, phase by phase, against the spread between runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.device_trace import counting_waits, exposed_collectives, short, summarize  # noqa: E402
from bench.megatron_compare import COMMON, MODELS  # noqa: E402
from bench.timing import patched, timed  # noqa: E402
from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
from fp4_dist.launch import shutdown  # noqa: E402

WARMUP_STEPS = 5


def profile(argv: list[str]) -> tuple[float, str]:
    s = pretrain_gpt.setup(argv)
    prof = cProfile.Profile()
    prof.enable()
    result = pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(r"fp4_dist", 18)
    return statistics.median(r.step_ms for r in result.records[5:]), out.getvalue()


class GpuRun(NamedTuple):
    mode: str
    step_ms: float
    """median wall time of the profiled steps"""
    kernels: dict
    """{kernel: GPU ms per step}"""
    calls: dict
    """{CUDA runtime/driver call (host side): calls per step}"""
    busy_ms: float
    """GPU busy time per step (union of kernel intervals: streams may overlap)"""
    gaps: dict
    """{(kernel before, kernel after): GPU idle ms per step}"""
    steps: int
    collectives: dict = {}
    """{collective: (device ms, exposed ms) per step} (`device_trace.exposed_collectives`)"""


@contextmanager
def _after_each_step(hook):
    """`hook(iteration number from 1)` right after each training step of `pretrain_gpt.train` inside the block."""
    step, n = pretrain_gpt._train_iteration, [0]

    def step_then_hook(*a, **k):
        go_on = step(*a, **k)
        n[0] += 1
        hook(n[0])
        return go_on

    pretrain_gpt._train_iteration = step_then_hook
    try:
        yield
    finally:
        pretrain_gpt._train_iteration = step


def profile_gpu(mode: str, argv: list[str]) -> GpuRun:
    """One run with steps WARMUP_STEPS + 1 .. --steps traced. Only the device is traced (CUPTI), so the host runs
    at nearly its own speed and the idle gaps are the ones an untraced run has."""
    from torch.profiler import ProfilerActivity, schedule

    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    if active < 1:
        raise SystemExit(f"megatron_profile: --gpu needs --steps > {WARMUP_STEPS}")
    on_gpu = torch.cuda.is_available()  # (CPU ranks: a smoke run of this script, nothing to trace on a device)
    prof = torch.profiler.profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU],
                                  schedule=schedule(wait=WARMUP_STEPS - 1, warmup=1, active=active))
    with prof, _after_each_step(lambda _: prof.step()):  # the schedule advances once per training step
        result = pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    events = prof.events()
    d = summarize(events, active)
    step_ms = statistics.median(r.step_ms for r in result.records[WARMUP_STEPS:])
    return GpuRun(mode, step_ms, d.kernels, d.calls, d.busy_ms, d.gaps, active, exposed_collectives(events, active))


@contextmanager
def _timing(optimizer, phases: dict, calls: dict):
    """Wall time and call count per phase (`phases`, `calls`) of the wrapped functions inside the block."""
    import megatron.core.pipeline_parallel as pipeline
    import fp4_dist.cast
    from fp4_dist.cast import master_weights as cast
    from fp4_dist.tensor import NVFP4Tensor

    # fp4_dist.megatron.buffers imports fp4_dist.cast's post_all_gather_processing when it calls it
    targets = [(optimizer, "step", "optimizer step"),
               (cast.BoundCast, "run", "cast (host, launches, its non-finite check)"),
               (fp4_dist.cast, "post_all_gather_processing", "post-all-gather refresh")]  # fmt: skip
    get_fb = pipeline.get_forward_backward_func
    pipeline.get_forward_backward_func = lambda: timed(phases, calls, "forward-backward", get_fb())
    dispatch = NVFP4Tensor.__dict__["__torch_dispatch__"]
    NVFP4Tensor.__torch_dispatch__ = classmethod(timed(phases, calls, "NVFP4Tensor dispatch", dispatch.__func__,
                                                        per_op=True))  # fmt: skip
    try:
        with patched(targets, phases, calls):
            yield
    finally:
        pipeline.get_forward_backward_func = get_fb
        NVFP4Tensor.__torch_dispatch__ = dispatch


def time_phases(argv: list[str]) -> tuple[float, dict, dict]:
    """(median step ms, {phase: host ms per step}, {phase or op: calls per step}) over steps WARMUP_STEPS + 1 ..
    --steps of one run."""
    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    phases, calls = {}, {}

    def start(n: int) -> None:
        if n == WARMUP_STEPS:
            phases.clear()
            calls.clear()

    with _timing(s.optimizer, phases, calls), _after_each_step(start):
        result = pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    step_ms = statistics.median(r.step_ms for r in result.records[WARMUP_STEPS:])
    return step_ms, {k: 1e3 * v / active for k, v in phases.items()}, {k: v / active for k, v in calls.items()}


def find_syncs(argv: list[str]) -> dict:
    """{(where in the code): synchronising CUDA calls per step} over steps WARMUP_STEPS + 1 .. --steps of one run,
    from torch's sync debug mode (each synchronising call warns; the innermost frames outside torch name the
    caller)."""
    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    where: dict = {}

    def start_counting(n: int) -> None:
        if n == WARMUP_STEPS:
            torch.cuda.set_sync_debug_mode("warn")

    with counting_waits(where, active), _after_each_step(start_counting):
        pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    return where


def report_gpu(runs: list[GpuRun]) -> None:
    base, fp4 = runs[0], runs[1]
    kb, kf = base.kernels, fp4.kernels
    print(f"\nGPU per step over {base.steps} steps (torch.profiler, device only): median wall step {base.mode} "
          f"{base.step_ms:.1f} ms, {fp4.mode} {fp4.step_ms:.1f} ms; GPU busy {base.busy_ms:.1f} ms vs "
          f"{fp4.busy_ms:.1f} ms; kernel time {sum(kb.values()):.1f} ms vs {sum(kf.values()):.1f} ms")
    print(f"\n| CUDA API call (host) | {base.mode} calls/step | {fp4.mode} calls/step |\n|---|---|---|")
    cb, cf = base.calls, fp4.calls
    for k in sorted(set(cb) | set(cf), key=lambda k: -abs(cf.get(k, 0.0) - cb.get(k, 0.0)))[:12]:
        print(f"| {k} | {cb.get(k, 0.0):.1f} | {cf.get(k, 0.0):.1f} |")
    names = sorted(set(kb) | set(kf), key=lambda k: -max(kb.get(k, 0.0), kf.get(k, 0.0)))
    print(f"\n| kernel | {base.mode} ms/step | {fp4.mode} ms/step | difference |\n|---|---|---|---|")
    shown = [k for k in names if abs(kb.get(k, 0.0) - kf.get(k, 0.0)) > 0.05 or k in names[:15]]
    for k in shown[:40]:
        print(f"| {short(k)} | {kb.get(k, 0.0):.3f} | {kf.get(k, 0.0):.3f} | {kf.get(k, 0.0) - kb.get(k, 0.0):+.3f} |")
    for run in (base, fp4):
        print(f"\n{run.mode}: largest GPU idle gaps (between the kernels traced, per step; the last ones of a step "
              "include the step's own synchronisation)\n| after | before | idle ms/step |\n|---|---|---|")
        for (a, b), ms in sorted(run.gaps.items(), key=lambda kv: -kv[1])[:12]:
            print(f"| {a} | {b} | {ms:.3f} |")
        print(f"| (all gaps) | | {sum(run.gaps.values()):.3f} |")
    kinds = sorted({k for r in runs for k in r.collectives})
    if kinds:
        print("\n| collective | " + " | ".join(f"{r.mode}: device / exposed ms per step" for r in (base, fp4))
              + " |\n|---|---|---|")
        for k in kinds:
            cells = [r.collectives.get(k, (0.0, 0.0)) for r in (base, fp4)]
            print(f"| {k} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells) + " |")
    print("all runs: " + ", ".join(f"{r.mode}: step {r.step_ms:.1f} ms, GPU busy {r.busy_ms:.1f} ms" for r in runs),
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gpu", action="store_true", help="profile the device's kernels instead of the host")
    p.add_argument("--syncs", action="store_true", help="count the synchronising CUDA calls per step, by caller")
    p.add_argument("--phases", action="store_true", help="host time per step by phase (Megatron's and fp4_dist's)")
    p.add_argument("--compute", choices=("lean", "fp8"), default="lean",
                   help="the NVFP4 run's compute mode: lean (the default mode) or fp8 (the FP8 compute mode, Hopper)")
    args, extra_args = p.parse_known_args()
    base = MODELS[args.model].split() + COMMON.replace("--fp4-master-digest", "").split()
    base += [a for a in extra_args if a != "--"]  # Megatron's own flags, e.g. -- --overlap-param-gather
    base += ["--train-iters", str(args.steps), "--log-interval", str(10 * args.steps), "--lr-warmup-iters", "1"]
    nvfp4 = ["--fp4-param-gather"] + (["--fp4-compute", "fp8"] if args.compute == "fp8" else [])
    name = "fp8" if args.compute == "fp8" else "fp4"
    modes = (("bf16", []), (name, nvfp4), ("bf16 #2", []), (f"{name} #2", nvfp4))
    if args.syncs and not torch.cuda.is_available():
        raise SystemExit("megatron_profile: --syncs counts waits for a GPU and needs a CUDA device")
    if args.syncs:
        for mode, extra in modes[:2]:
            where = find_syncs(base + extra)
            if dist.get_rank() == 0:
                print(f"\n{mode}: synchronising CUDA calls per step ({sum(where.values()):.1f}), by caller")
                for k, v in sorted(where.items(), key=lambda kv: -kv[1])[:25]:
                    print(f"  {v:6.1f}  {k}")
        shutdown()
        return
    if args.phases:
        runs = [(mode, *time_phases(base + extra)) for mode, extra in modes]
        if dist.get_rank() == 0:
            names = sorted({k for r in runs for k in r[2]}, key=lambda k: -max(r[2].get(k, 0.0) for r in runs))
            print("\nhost ms per step by phase (wall clock around the calls; nested phases are inside the ones "
                  "above them)\n| phase | " + " | ".join(r[0] for r in runs) + " |\n|---|" + "---|" * len(runs))
            print("| median step | " + " | ".join(f"{r[1]:.1f}" for r in runs) + " |")
            for k in names:
                print(f"| {k} | " + " | ".join(f"{r[2].get(k, 0.0):.2f}" for r in runs) + " |")
            print("\nops reaching NVFP4Tensor's dispatch per step: " + "; ".join(
                f"{r[0]} {sum(v for k, v in r[3].items() if k.startswith('NVFP4Tensor dispatch')):.1f}" for r in runs))
            print("calls per step: " + "; ".join(f"{r[0]}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r[3].items()))
                                                  for r in runs if r[3]))  # fmt: skip
        shutdown()
        return
    if args.gpu:
        runs = [profile_gpu(mode, base + extra) for mode, extra in modes]
        if dist.get_rank() == 0:
            report_gpu(runs)
        shutdown()
        return
    report = []
    for mode, extra in modes:
        ms, text = profile(base + extra)
        report.append((mode, ms, text))
    if dist.get_rank() == 0:
        for mode, ms, text in report[:2]:
            print(f"\n########## {mode}: median step {ms:.1f} ms\n{text}")
        print("median step ms: " + ", ".join(f"{m} {ms:.1f}" for m, ms, _ in report), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
