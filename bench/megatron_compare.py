"""Megatron-Core --fp4-param-gather vs bf16 param gather: one torchrun job, four runs, one table.

    torchrun --nproc-per-node 2 bench/megatron_compare.py [--steps 200] [--tiny] [-- extra Megatron args]

Runs the same GPT (same seed, data, LR schedule, no gradient clipping) five times in this process, in this order:

    bf16      plain bf16 model (no quantization at all) -> what NVFP4 does to the loss (information)
    fp4       --fp4-param-gather: NVFP4 weights, 4-bit all-gather       -> the step time that must stay within
    bf16 #2   the same as bf16                             1.05x of the bf16 runs' (GPUs): fp4 runs between
              the two, so drift over the job hits both sides, and runs no checks between its steps
    fp4 #2    fp4 again, its gathered bytes checked against quantize(full master) every --check-every steps
                                                        -> determinism: losses and masters bit-identical to fp4
    bf16-gather  --fp4-fake-quant: bf16 weights and bf16 param gather, the weights NVFP4-quantized in the forward
              every step. This is Megatron's "--fp4-param-gather off" run (NVFP4 compute, bf16 gather; its
              test_fp4_param.py asks for loss within 1e-2) and the per-step fake-quantization reference at once
                                                        -> fp4 loss within 1e-2 at every step, and in fact
                                                           bit-identical losses and fp32 masters

Gradient clipping is off (--clip-grad 0): the global grad norm sums shards in a buffer-layout-dependent
order, which would let fp32 rounding differ between runs whose buffers are laid out differently. Python's
garbage collector runs between steps only (Megatron's --manual-gc), so its pauses do not land in the step times
of whichever run happens to allocate more Python objects.
Prints a short table on rank 0 and writes it (with every loss) to --json when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4_dist.examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
from fp4_dist.launch import shutdown  # noqa: E402

MODELS = {
    "gpt256": ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 "
               "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 16"),
    "gpt2048": ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 "
                "--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16"),
    "tiny": ("--num-layers 2 --hidden-size 48 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 1 --kv-channels 12 --ffn-hidden-size 64 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8"),
}
STEP_RATIO_LIMIT = 1.05  # fp4 param gather's median step over the plain bf16 run's
COMMON = ("--bf16 --use-distributed-optimizer --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine "
          "--clip-grad 0 --seed 1234 --deterministic-mode --fp4-master-digest --manual-gc")


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default="gpt256", choices=sorted(MODELS),
                   help="gpt256: hidden 256 x 4 layers, seq 256; gpt2048: hidden 2048 x 8 layers, seq 1024, "
                        "micro-batch 4; tiny: a CPU smoke run")
    p.add_argument("--tiny", action="store_true", help="same as --model tiny")
    p.add_argument("--check-every", type=int, default=20, help="parity check of the gathered NVFP4 bytes")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--json", default=None, help="write the table and all losses here (rank 0)")
    args, extra = p.parse_known_args()
    return args, [a for a in extra if a != "--"]


def run(name: str, argv: list[str], what: str) -> pretrain_gpt.RunResult:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"\n=== {name}: {what}", flush=True)
    return pretrain_gpt.main(argv)


def step_times(result: pretrain_gpt.RunResult) -> list[float]:
    """Step times after the first 5 (compilation, allocator warm-up)."""
    return [r.step_ms for r in result.records[5:]] or [r.step_ms for r in result.records]


def median_ms(*results: pretrain_gpt.RunResult) -> float:
    return statistics.median([t for r in results for t in step_times(r)])


def table(runs: dict[str, pretrain_gpt.RunResult]) -> tuple[list[tuple[str, str, str]], bool]:
    fp4, fp4b, gather, bf16 = runs["fp4"], runs["fp4 #2"], runs["bf16-gather"], runs["bf16"]

    def max_diff(a, b):
        diff = [abs(x - y) for x, y in zip(a.losses, b.losses)]
        worst = max(range(len(diff)), key=diff.__getitem__)
        return diff[worst], worst + 1

    d_gather, at_gather = max_diff(fp4, gather)
    d_bf16, at_bf16 = max_diff(fp4, bf16)
    unequal = sum(a != b for a, b in zip(fp4.losses, gather.losses))
    unequal_rerun = sum(a != b for a, b in zip(fp4.losses, fp4b.losses))
    checks = [r.parity for r in fp4.records + fp4b.records if r.parity]
    rows = [
        ("fp4 vs bf16 param gather: max |loss diff|", f"{d_gather:.2e} at step {at_gather} (limit 1e-2)",
         "PASS" if d_gather <= 1e-2 else "FAIL"),
        ("fp4 vs fake-quant (bf16 gather): unequal losses", f"{unequal}/{len(fp4.losses)} steps",
         "PASS" if unequal == 0 else "FAIL"),
        ("fp4 vs fake-quant (bf16 gather): fp32 masters",
         "identical" if fp4.master_digest == gather.master_digest else "differ",
         "PASS" if fp4.master_digest == gather.master_digest else "FAIL"),
        ("fp4 run twice: unequal losses / masters",
         f"{unequal_rerun} / {'identical' if fp4.master_digest == fp4b.master_digest else 'differ'}",
         "PASS" if unequal_rerun == 0 and fp4.master_digest == fp4b.master_digest else "FAIL"),
        ("gathered NVFP4 == quantize(full master)", f"{sum(c.startswith('ok') for c in checks)}/{len(checks)} checks",
         "PASS" if checks and all(c.startswith("ok") for c in checks) else "FAIL"),
        ("(info) fp4 vs unquantized bf16 model: max |loss diff|", f"{d_bf16:.2e} at step {at_bf16}; final "
         f"{fp4.losses[-1]:.4f} vs {bf16.losses[-1]:.4f}", ""),
    ]
    ok = all(r[2] != "FAIL" for r in rows)
    for name, res in runs.items():
        mib = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(res.buffer_bytes.items()))
        rows.append((f"{name}: median step / DDP buffers", f"{median_ms(res):.1f} ms / {mib}", ""))
    gather_fp4 = fp4.buffer_bytes.get("param_uint8", 0) + fp4.buffer_bytes.get("param_bfloat16", 0)
    gather_bf16 = gather.buffer_bytes.get("param_bfloat16", 0)
    rows.append(("param all-gather bytes per step, fp4 / bf16 gather",
                 f"{gather_fp4 / 2**20:.3f} / {gather_bf16 / 2**20:.3f} MiB "
                 f"({gather_bf16 / max(gather_fp4, 1):.2f}x less)", ""))
    rows.append(("fp4 NVFP4 compute copies (bf16, next to the param buffers)",
                 f"{fp4.compute_copy_bytes / 2**20:.2f} MiB", ""))
    ratio = median_ms(fp4) / median_ms(bf16, runs["bf16 #2"])
    if torch.cuda.is_available():
        step_ok = ratio <= STEP_RATIO_LIMIT
        rows.append(("fp4 param gather vs plain bf16: median step (fp4 / bf16 and bf16 #2)",
                     f"{median_ms(fp4):.1f} / {median_ms(bf16, runs['bf16 #2']):.1f} ms = {ratio:.3f} "
                     f"(limit {STEP_RATIO_LIMIT})", "PASS" if step_ok else "FAIL"))
    else:  # CPU ranks: a smoke run, its step times say nothing about a GPU's
        step_ok = True
        rows.append(("(info) fp4 param gather vs plain bf16: median step ratio on CPU ranks", f"{ratio:.3f}", ""))
    return rows, ok and step_ok


def main() -> int:
    args, extra = parse()
    model = MODELS["tiny" if args.tiny else args.model].split()
    base = model + COMMON.split() + ["--train-iters", str(args.steps), "--log-interval", str(args.log_interval),
                                     "--lr-warmup-iters", str(max(1, args.steps // 10))]
    base += extra
    fp4 = ["--fp4-param-gather", "--fp4-check-every", str(args.check_every)]
    runs = {
        "bf16": run("bf16", base, "plain bf16 model, no quantization"),
        "fp4": run("fp4", base + ["--fp4-param-gather"], "NVFP4 weights, 4-bit param all-gather"),
        "bf16 #2": run("bf16 #2", base, "the same as bf16 again (step time drift)"),
        "fp4 #2": run("fp4 #2", base + fp4, "the same as fp4, gathered bytes checked (determinism, parity)"),
        "bf16-gather": run("bf16-gather", base + ["--fp4-fake-quant"],
                           "bf16 weights and gather, NVFP4-quantized forward (fake quant)"),
    }
    rows, ok = table(runs)
    if dist.get_rank() == 0:
        width = max(len(r[0]) for r in rows)
        print(f"\n{'check':<{width}} | result | verdict\n{'-' * (width + 30)}")
        for name, value, verdict in rows:
            print(f"{name:<{width}} | {value} | {verdict}")
        print(f"\nOVERALL: {'PASS' if ok else 'FAIL'} ({runs['fp4'].world_size} ranks, {args.steps} steps)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"rows": rows, "ok": ok, "losses": {k: v.losses for k, v in runs.items()}}, indent=1))
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
