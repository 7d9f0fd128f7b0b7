"""Where a Megatron step's host time goes: cProfile of the same steps with and without --fp4-param-gather.

    torchrun --nproc-per-node 2 bench/megatron_profile.py [--model gpt256] [--steps 30] [--no-sync-check]

Host-bound steps (small models) show every extra Python call of the NVFP4 path; rank 0 prints, for each mode,
the median step time and the functions with the largest own time, then the fp4_dist functions by cumulative
time. --no-sync-check replaces the cast's one device-to-host read (the non-finite check) by nothing, to measure
what that wait costs (diagnostic only: a non-finite master then goes unnoticed).
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-sync-check", action="store_true")
    args = p.parse_args()
    base = MODELS[args.model].split() + COMMON.replace("--fp4-master-digest", "").split()
    base += ["--train-iters", str(args.steps), "--log-interval", str(10 * args.steps), "--lr-warmup-iters", "1"]
    if args.no_sync_check:
        from fp4_dist.optim import cast

        cast._raise_if_bad = lambda *a, **k: None
    report = []
    for mode, extra in (("bf16", []), ("fp4", ["--fp4-param-gather"]), ("bf16 #2", []), ("fp4 #2", ["--fp4-param-gather"])):
        ms, text = profile(base + extra)
        report.append((mode, ms, text))
    if dist.get_rank() == 0:
        for mode, ms, text in report[:2]:
            print(f"\n########## {mode}: median step {ms:.1f} ms\n{text}")
        print("median step ms: " + ", ".join(f"{m} {ms:.1f}" for m, ms, _ in report), flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
