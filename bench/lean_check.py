"""Lean compute against kept compute copies on a GPU: the same Megatron GPT trained both ways in one process must
give bitwise the same losses and fp32 masters (the CPU suites check this on gloo ranks; this runs it on CUDA).

    torchrun --nproc-per-node 1 bench/lean_check.py [--model gpt256] [--steps 6] [-- extra Megatron args]

GPT 256 has 4 layers, so each pool buffer is shared by 4 weights and every backward writes its copy again before
reading it. (Recomputation runs in tests/distributed/test_megatron_run.py, through megatron.training's pretrain():
this entry point does not implement it.) Prints one line and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.megatron_compare import COMMON, MODELS  # noqa: E402
from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
from fp4_dist.launch import shutdown  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=6)
    args, extra = p.parse_known_args()
    base = MODELS[args.model].split() + COMMON.split() + ["--fp4-param-gather", "--train-iters", str(args.steps),
                                                          "--log-interval", str(args.steps), "--lr-warmup-iters", "1"]
    base += [a for a in extra if a != "--"]
    kept = pretrain_gpt.main(base)
    lean = pretrain_gpt.main(base + ["--fp4-no-compute-copy"])
    ok = kept.losses == lean.losses and kept.master_digest == lean.master_digest
    print(f"lean vs kept copies: losses {'equal' if kept.losses == lean.losses else 'DIFFER'}, masters "
          f"{'equal' if kept.master_digest == lean.master_digest else 'DIFFER'} ({len(lean.losses)} steps) "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
