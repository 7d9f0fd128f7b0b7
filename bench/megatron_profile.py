"""Where a Megatron step's host time goes: cProfile of the same steps with and without --fp4-param-gather.

    torchrun --nproc-per-node 2 bench/megatron_profile.py [--model gpt256] [--steps 30] [--no-sync-check] [--gpu]

Host-bound steps (small models) show every extra Python call of the NVFP4 path; rank 0 prints, for each mode,
the median step time and the functions with the largest own time, then the fp4_dist functions by cumulative
time. --no-sync-check replaces the cast's one device-to-host read (the non-finite check) by nothing, to measure
what that wait costs (diagnostic only: a non-finite master then goes unnoticed).

--gpu profiles the device instead (torch.profiler, steps 6 to --steps): the GPU time per step of every kernel in
each mode, the kernels only one mode runs, and the GPU's busy time against the wall time of those steps. It
tells extra device work of the NVFP4 path apart from host time and from the machine's run-to-run noise.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.megatron_compare import COMMON, MODELS  # noqa: E402
from fp4_dist.examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
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


def profile_gpu(argv: list[str]) -> tuple[float, dict, float, int]:
    """(median step ms, {kernel: GPU ms per step}, GPU busy ms per step, profiled steps) of one run."""
    import torch
    from torch.profiler import ProfilerActivity, schedule

    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    if active < 1:
        raise SystemExit(f"megatron_profile: --gpu needs --steps > {WARMUP_STEPS}")
    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                  schedule=schedule(wait=WARMUP_STEPS - 1, warmup=1, active=active))
    step = pretrain_gpt._train_iteration

    def step_then_tick(*a, **k):  # the profiler's schedule advances once per training step
        go_on = step(*a, **k)
        prof.step()
        return go_on

    pretrain_gpt._train_iteration = step_then_tick
    try:
        with prof:
            result = pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    finally:
        pretrain_gpt._train_iteration = step
    kernels = {}
    intervals = []
    for e in prof.events():
        # GPU-side user annotations (ProfilerStep#, Optimizer.step#...) span whole phases: not device work.
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith("ProfilerStep"):
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / active
            intervals.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, float("-inf")  # union of kernel intervals (streams may overlap)
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return statistics.median(r.step_ms for r in result.records[WARMUP_STEPS:]), kernels, busy / 1e3 / active, active


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report_gpu(runs: list[tuple[str, float, dict, float, int]]) -> None:
    (mb, sb, kb, bb, n), (mf, sf, kf, bf, _) = runs[0], runs[1]
    print(f"\nGPU per step over {n} steps (torch.profiler): median wall step {mb} {sb:.1f} ms, {mf} {sf:.1f} ms; "
          f"GPU busy {bb:.1f} ms vs {bf:.1f} ms; kernel time {sum(kb.values()):.1f} ms vs {sum(kf.values()):.1f} ms")
    names = sorted(set(kb) | set(kf), key=lambda k: -max(kb.get(k, 0.0), kf.get(k, 0.0)))
    print(f"\n| kernel | {mb} ms/step | {mf} ms/step | difference |\n|---|---|---|---|")
    shown = [k for k in names if abs(kb.get(k, 0.0) - kf.get(k, 0.0)) > 0.05 or k in names[:15]]
    for k in shown[:40]:
        print(f"| {_short(k)} | {kb.get(k, 0.0):.3f} | {kf.get(k, 0.0):.3f} | {kf.get(k, 0.0) - kb.get(k, 0.0):+.3f} |")
    print("all runs: " + ", ".join(f"{m}: step {ms:.1f} ms, GPU busy {busy:.1f} ms" for m, ms, _, busy, _ in runs),
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-sync-check", action="store_true")
    p.add_argument("--gpu", action="store_true", help="profile the device's kernels instead of the host")
    args = p.parse_args()
    base = MODELS[args.model].split() + COMMON.replace("--fp4-master-digest", "").split()
    base += ["--train-iters", str(args.steps), "--log-interval", str(10 * args.steps), "--lr-warmup-iters", "1"]
    if args.no_sync_check:
        from fp4_dist.optim import cast

        cast._raise_if_bad = lambda *a, **k: None
    modes = (("bf16", []), ("fp4", ["--fp4-param-gather"]), ("bf16 #2", []), ("fp4 #2", ["--fp4-param-gather"]))
    if args.gpu:
        runs = [(mode, *profile_gpu(base + extra)) for mode, extra in modes]
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
