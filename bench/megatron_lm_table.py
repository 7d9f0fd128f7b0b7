"""The table of bench/megatron_lm_gpu.sh: a bf16 and an --fp4-param-gather run of megatron.training's loop side by
side (losses from the launcher's run records, step times from Megatron's own log lines).

    python bench/megatron_lm_table.py OUT NAME [--check-every N]     # reads OUT/NAME-{bf16,fp4}.{json,log}
    python bench/megatron_lm_table.py OUT NAME NAME ... --summary     # one row per NAME (parallel layouts)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP = 10


def step_times(log: Path, check_every: int) -> dict[int, float]:
    times = {int(m.group(1)): float(m.group(2)) for m in STEP.finditer(log.read_text())}
    return {i: t for i, t in times.items() if i > WARMUP and not (check_every and i % check_every == 0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("names", nargs="+", metavar="name")
    p.add_argument("--check-every", type=int, default=0, help="steps that ran the check (left out of the medians)")
    p.add_argument("--summary", action="store_true", help="one row per name: final losses, median steps, checks")
    a = p.parse_args(argv)
    if a.summary:
        return summary(a.out, a.names, a.check_every)
    a.name = a.names[0]
    runs = {mode: json.loads((a.out / f"{a.name}-{mode}.json").read_text()) for mode in ("bf16", "fp4")}
    loss = {mode: {it["iteration"]: it["loss"] for it in r["iterations"]} for mode, r in runs.items()}
    last = max(loss["bf16"])
    shown = sorted({1, 2, 5, *range(10, last + 1, 10), last} & set(loss["bf16"]) & set(loss["fp4"]))
    print(f"\n{a.name}: megatron.training loop, bf16 vs --fp4-param-gather "
          f"({runs['fp4']['nvfp4_weights']} NVFP4 weights)")
    print("| iteration | bf16 loss | fp4 loss | fp4 - bf16 |\n|---:|---:|---:|---:|")
    for i in shown:
        b, f = loss["bf16"][i], loss["fp4"][i]
        print(f"| {i} | {b:.4f} | {f:.4f} | {f - b:+.4f} ({100 * (f - b) / b:+.2f}%) |")
    tail = [i for i in loss["bf16"] if i > last - 10]
    mean = {m: statistics.fmean(loss[m][i] for i in tail) for m in loss}
    gap = 100 * (mean["fp4"] - mean["bf16"]) / mean["bf16"]
    print(f"mean loss over the last {len(tail)} iterations: bf16 {mean['bf16']:.4f}, fp4 {mean['fp4']:.4f} "
          f"({gap:+.2f}%)")
    checks = [it.get("check", "") for it in runs["fp4"]["iterations"] if "check" in it]
    same_init = runs["fp4"]["master_digest_after_setup"] == runs["bf16"]["master_digest_after_setup"]
    print(f"fp32 masters after setup == the bf16 run's: {same_init}; parity checks passed: "
          f"{sum(c.startswith('ok') for c in checks)}/{len(checks)} (+ after setup: "
          f"{runs['fp4'].get('check_after_setup', 'not run')[:2]})")
    logs = {m: sorted(a.out.glob(f"{a.name}-{m}.log")) + sorted(a.out.glob(f"{a.name}-{m}-r*.log"))
            for m in ("bf16", "fp4")}  # fmt: skip
    times = {m: [t for log in logs[m] for t in step_times(log, a.check_every).values()] for m in logs}
    med = {m: statistics.median(t) for m, t in times.items() if t}
    if len(med) == 2:
        per_run = {m: " / ".join(f"{statistics.median(step_times(log, a.check_every).values()):.1f}" for log in logs[m])
                   for m in logs}  # fmt: skip
        print(f"median step (iterations > {WARMUP}, checked ones left out; {len(logs['bf16'])} run(s) each): bf16 "
              f"{med['bf16']:.1f} ms, fp4 {med['fp4']:.1f} ms, fp4/bf16 {med['fp4'] / med['bf16']:.3f} (per run: "
              f"bf16 {per_run['bf16']}, fp4 {per_run['fp4']})")
    ok = same_init and checks and all(c.startswith("ok") for c in checks) and abs(gap) <= 1.0
    print(f"verdict: {'PASS' if ok else 'FAIL'} (same init, every check, final gap within 1%)")
    return 0 if ok else 1


def summary(out: Path, names: list[str], check_every: int) -> int:
    """One row per run pair: the mean loss of each mode over the last 10 iterations (one batch's loss moves by
    several percent from step to step), the median step of each, the fp4 run's checks (after setup and every
    `check_every` iterations). PASS: the fp32 masters start from the bf16 run's init and every check passed (the
    gathered bytes equal quantize(full master) on every rank); the loss gap is shown, not judged: a 100-iteration run
    of a small model moves by a percent or two with any change of the weights' values (a convergence study is where
    NVFP4 training is judged).
    """
    print("| layout | NVFP4 weights (rank 0) | loss bf16 | loss fp4 | fp4 - bf16 | median step bf16 (ms) | "
          "median step fp4 (ms) | fp4 / bf16 | peak MiB bf16 / fp4 | checks passed | verdict |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    failed = 0
    for name in names:
        paths = {mode: out / f"{name}-{mode}.json" for mode in ("bf16", "fp4")}
        if not all(p.exists() for p in paths.values()):
            print(f"| {name} | - | - | - | - | - | - | - | - | - | FAIL (no run record) |")
            failed += 1
            continue
        runs = {mode: json.loads(p.read_text()) for mode, p in paths.items()}
        loss = {m: {it["iteration"]: it["loss"] for it in r["iterations"]} for m, r in runs.items()}
        # a run that reached its last iteration recorded its final digest there (fp4_dist.megatron.monitor)
        stopped = [m for m in runs if "master_digest_final" not in runs[m] or not loss[m]]
        if not stopped and max(loss["bf16"]) != max(loss["fp4"]):
            stopped = [min(runs, key=lambda m: max(loss[m]))]
        if stopped:  # a run that ended early (its log says why): a row of its own, not a crash of the table
            said = "; ".join(f"{m} stopped after iteration {max(loss[m], default=0)}, see {name}-{m}.log"
                             for m in stopped)  # fmt: skip
            print(f"| {name} | - | - | - | - | - | - | - | - | - | FAIL ({said}) |")
            failed += 1
            continue
        tail = [i for i in loss["bf16"] if i > max(loss["bf16"]) - 10]
        b, f = (statistics.fmean(loss[m][i] for i in tail) for m in ("bf16", "fp4"))
        times = {m: list(step_times(out / f"{name}-{m}.log", check_every).values()) for m in runs}
        med = {m: statistics.median(t) if t else float("nan") for m, t in times.items()}  # none past the warm-up
        checks = [runs["fp4"].get("check_after_setup", "")] + [it["check"] for it in runs["fp4"]["iterations"]
                                                              if "check" in it]  # fmt: skip
        passed = sum(c.startswith("ok") for c in checks)
        same_init = runs["fp4"]["master_digest_after_setup"] == runs["bf16"]["master_digest_after_setup"]
        ok = same_init and passed == len(checks)
        failed += not ok
        peak = [runs[m].get("peak_allocated_mib") for m in ("bf16", "fp4")]  # max over ranks; none on CPU ranks
        memory = f"{peak[0]:,.0f} / {peak[1]:,.0f}" if None not in peak else "-"
        print(f"| {name} | {runs['fp4']['nvfp4_weights']} | {b:.4f} | {f:.4f} | {100 * (f - b) / b:+.2f}% | "
              f"{med['bf16']:.1f} | {med['fp4']:.1f} | {med['fp4'] / med['bf16']:.3f} | {memory} | "
              f"{passed}/{len(checks)} | {'PASS' if ok else 'FAIL'}{'' if same_init else ' (init differs)'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
