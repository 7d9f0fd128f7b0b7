"""Pool the paired measurements of several processes (`megatron_compare.py --paired-only ... --json F`, run again
for each F): one process's per-pair ratio moves by several percent between processes on the lent hosts, more than
the effects being measured, so a verdict wants several.

    python bench/paired_pool.py out/paired2048.1.json out/paired2048.2.json ...

Prints, per variant, each process's median per-pair ratio to bf16, their median, and the median over all pairs of
all processes; the verdict (the median of the processes' ratios against the step limit) for GPU runs only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.megatron_compare import STEP_RATIO_LIMIT, after_warmup  # noqa: E402


def pair_ratios(step_ms: dict, name: str) -> list[float]:
    return [v / b for v, b in zip(after_warmup(step_ms[name]), after_warmup(step_ms["bf16"]))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="megatron_compare.py --json outputs of --paired-only runs")
    args = p.parse_args()
    outputs = [json.loads(Path(f).read_text()) for f in args.json]
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
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
