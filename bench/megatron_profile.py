"""Where a Megatron step's host time goes: cProfile of the same steps with and without --fp4-param-gather.

    torchrun --nproc-per-node 2 bench/megatron_profile.py [--model gpt256] [--steps 30] [--no-sync-check] [--gpu | --syncs]

Host-bound steps (small models) show every extra Python call of the NVFP4 path; rank 0 prints, for each mode,
the median step time and the functions with the largest own time, then the fp4_dist functions by cumulative
time. --no-sync-check replaces the cast's one device-to-host read (the non-finite check) by nothing, to measure
what that wait costs (diagnostic only: a non-finite master then goes unnoticed).

--gpu profiles the device instead (torch.profiler, steps 6 to --steps): the GPU time per step of every kernel in
each mode, the kernels only one mode runs, and the GPU's busy time against the wall time of those steps. It
tells extra device work of the NVFP4 path apart from host time and from the machine's run-to-run noise.
--syncs counts the calls that make the host wait for the GPU (torch's sync debug mode), per step, by caller.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch
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


def profile_gpu(argv: list[str]) -> tuple[float, dict, float, int, dict]:
    """(median step ms, {kernel: GPU ms per step}, GPU busy ms per step, profiled steps, {(kernel before,
    kernel after): GPU idle ms per step}) of one run. Only the device is traced (CUPTI), so the host runs at
    nearly its own speed and the idle gaps are the ones an untraced run has."""
    from torch.profiler import ProfilerActivity, schedule

    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    if active < 1:
        raise SystemExit(f"megatron_profile: --gpu needs --steps > {WARMUP_STEPS}")
    on_gpu = torch.cuda.is_available()  # (CPU ranks: a smoke run of this script, nothing to trace on a device)
    prof = torch.profiler.profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU],
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
    kernels, api = {}, {}
    intervals = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:  # host-side records: CUDA runtime/driver calls
            api[e.name] = api.get(e.name, 0) + 1 / active
        # GPU-side user annotations (ProfilerStep#, Optimizer.step#...) span whole phases: not device work.
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith("ProfilerStep"):
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / active
            intervals.append((e.time_range.start, e.time_range.end, e.name))
    busy, end, last, gaps = 0.0, float("-inf"), None, {}  # union of kernel intervals (streams may overlap)
    for a, b, name in sorted(intervals):
        if last is not None and a > end:
            key = (_short(last, 60), _short(name, 60))
            gaps[key] = gaps.get(key, 0.0) + (a - end) / 1e3 / active
        if b > end:
            busy += b - max(a, end)
            end, last = b, name
    kernels.update({f"(host call) {k}": v for k, v in api.items()})  # counts per step, not ms
    return (statistics.median(r.step_ms for r in result.records[WARMUP_STEPS:]), kernels, busy / 1e3 / active,
            active, gaps)


def find_syncs(argv: list[str]) -> dict:
    """{(where in the code): synchronising CUDA calls per step} over steps 6 to --steps of one run, from torch's
    sync debug mode (each synchronising call warns; the innermost frames outside torch name the caller)."""
    import traceback
    import warnings

    s = pretrain_gpt.setup(argv)
    active = s.args.train_iters - WARMUP_STEPS
    where: dict = {}
    step = pretrain_gpt._train_iteration
    state = {"n": 0}

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # other warnings (Megatron's deprecations) pass through
            return old_show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "site-packages/torch/" not in f.filename and "warnings" not in f.filename]
        key = " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in frames[-4:][::-1])
        where[key] = where.get(key, 0) + 1 / active

    def counted_step(*a, **k):
        state["n"] += 1
        if state["n"] == WARMUP_STEPS + 1:
            torch.cuda.set_sync_debug_mode("warn")
        return step(*a, **k)

    pretrain_gpt._train_iteration = counted_step
    old_show = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        pretrain_gpt._train_iteration = step
        warnings.showwarning = old_show
    return where


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report_gpu(runs: list[tuple[str, float, dict, float, int, dict]]) -> None:
    (mb, sb, kb, bb, n, _), (mf, sf, kf, bf, _, _) = runs[0], runs[1]
    is_call = lambda k: k.startswith("(host call) ")  # noqa: E731
    calls = sorted((k for k in set(kb) | set(kf) if is_call(k)), key=lambda k: -abs(kf.get(k, 0.0) - kb.get(k, 0.0)))
    kb = {k: v for k, v in kb.items() if not is_call(k)}
    kf_calls, kf = kf, {k: v for k, v in kf.items() if not is_call(k)}
    print(f"\nGPU per step over {n} steps (torch.profiler, device only): median wall step {mb} {sb:.1f} ms, {mf} "
          f"{sf:.1f} ms; GPU busy {bb:.1f} ms vs {bf:.1f} ms; kernel time {sum(kb.values()):.1f} ms vs "
          f"{sum(kf.values()):.1f} ms")
    print(f"\n| CUDA API call (host) | {mb} calls/step | {mf} calls/step |\n|---|---|---|")
    base_calls = dict(runs[0][2])
    for k in calls[:12]:
        print(f"| {k[12:]} | {base_calls.get(k, 0.0):.1f} | {kf_calls.get(k, 0.0):.1f} |")
    names = sorted(set(kb) | set(kf), key=lambda k: -max(kb.get(k, 0.0), kf.get(k, 0.0)))
    print(f"\n| kernel | {mb} ms/step | {mf} ms/step | difference |\n|---|---|---|---|")
    shown = [k for k in names if abs(kb.get(k, 0.0) - kf.get(k, 0.0)) > 0.05 or k in names[:15]]
    for k in shown[:40]:
        print(f"| {_short(k)} | {kb.get(k, 0.0):.3f} | {kf.get(k, 0.0):.3f} | {kf.get(k, 0.0) - kb.get(k, 0.0):+.3f} |")
    for mode, _, _, _, _, gaps in runs[:2]:
        print(f"\n{mode}: largest GPU idle gaps (between the kernels traced, per step; the last ones of a step "
              "include the step's own synchronisation)\n| after | before | idle ms/step |\n|---|---|---|")
        for (a, b), ms in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]:
            print(f"| {a} | {b} | {ms:.3f} |")
        print(f"| (all gaps) | | {sum(gaps.values()):.3f} |")
    print("all runs: " + ", ".join(f"{m}: step {ms:.1f} ms, GPU busy {busy:.1f} ms" for m, ms, _, busy, _, _ in runs),
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-sync-check", action="store_true")
    p.add_argument("--gpu", action="store_true", help="profile the device's kernels instead of the host")
    p.add_argument("--syncs", action="store_true", help="count the synchronising CUDA calls per step, by caller")
    args = p.parse_args()
    base = MODELS[args.model].split() + COMMON.replace("--fp4-master-digest", "").split()
    base += ["--train-iters", str(args.steps), "--log-interval", str(10 * args.steps), "--lr-warmup-iters", "1"]
    if args.no_sync_check:
        from fp4_dist.optim import cast

        cast._raise_if_bad = lambda *a, **k: None
    modes = (("bf16", []), ("fp4", ["--fp4-param-gather"]), ("bf16 #2", []), ("fp4 #2", ["--fp4-param-gather"]))
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
