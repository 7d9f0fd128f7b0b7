"""Step time and peak memory of Megatron's own training loop with CUDA graphs, per compute mode, on one GPU.

    python bench/megatron_graphs.py [--graphs full_iteration] [--rounds 3] [--iters 16] [--shape llama|tiny]
        [--modes bf16,lean,kept,fp8,fp8-lowmem,nvfp4] [--check-every N] [--out DIR]

One process per run (`examples/pretrain_gpt.py` through ``python -m fp4_dist.megatron.run``), the modes taking turns
(bf16, lean, kept, fp8, fp8-lowmem, then again, --rounds times), so a slowdown that lasts a run lands on one mode only:

    bf16   plain bf16 weights, no --fp4-param-gather
    lean   --fp4-param-gather, the default compute (a copy made around each use)
    kept   --fp4-param-gather --compute-copy (a bf16 copy per weight, made once per step)
    fp8    --fp4-param-gather --compute fp8 (FP8 block-scaled GEMMs on the weights' FP8 copies and their kept
           transposes)
    fp8-lowmem  the same with --compute-option keep_transpose=false (each dgrad transposes its weight's copy)
    nvfp4  --fp4-param-gather --compute nvfp4 (the emulated NVFP4 recipe: 4-bit activations and gradients too);
           eager only (``--graphs none``): Megatron's start-up refuses its graphs

The llama shape is the one of the CUDA-graphs issue: hidden 4096 x 6 layers, ffn 11,008, GQA 8 groups, RMSNorm,
SwiGLU, RoPE, untied embeddings, vocab 32,000, seq 2,048, micro-batch 1, global batch 4 (four microbatches a step),
``--transformer-impl local --bf16 --use-distributed-optimizer``. A step's time is Megatron's own log line ("elapsed
time per iteration"), the median over every round's iterations after the capture (``--cuda-graph-warmup-steps`` +
1) and before its last (which also hashes the masters for the run record); peak memory (allocated and reserved, the
graph pools included) is the run record's. The table gives each mode's median and its ratio to bf16's, and the
spread of the per-round medians.

With ``--check-every N`` the NVFP4 runs check their gathered weights every N iterations (the launcher's
``--check-every``). Those iterations (the check, and the lean audit of the step before it) are left out of the
median, and a second table gives the check's own time (the run record's ``check_ms``) and what it adds to a step on
average: (check iteration - median) / N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP = 2  # --cuda-graph-warmup-steps: eager steps before the capture
SHAPES = {
    "llama": ("--num-layers 6 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
              "--group-query-attention --num-query-groups 8 --normalization RMSNorm --swiglu "
              "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
              "--vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
              "--global-batch-size 4"),
    "tiny": ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 2 --global-batch-size 8 --vocab-size 512"),
}
COMMON = ("--transformer-impl local --bf16 --use-distributed-optimizer --lr 1e-4 --tokenizer-type NullTokenizer "
          "--split 100,0,0 --log-interval 1 --eval-interval 100000 --eval-iters 0 --seed 1234 --num-workers 0 "
          "--no-gradient-accumulation-fusion --no-check-for-nan-in-loss-and-grad")
MODES = {"bf16": ([], False), "lean": ([], True), "kept": (["--compute-copy"], True),
         "fp8": (["--compute", "fp8"], True),
         "fp8-lowmem": (["--compute", "fp8", "--compute-option", "keep_transpose=false"], True),
         "nvfp4": (["--compute", "nvfp4"], True)}
EAGER_ONLY = {"nvfp4"}


def run(out: Path, name: str, mode: str, a) -> dict:
    runner, fp4 = MODES[mode]
    log, record = out / f"{name}.log", out / f"{name}.json"
    graphs = [] if a.graphs == "none" else ["--cuda-graph-impl", a.graphs, "--cuda-graph-warmup-steps", str(WARMUP)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "fp4_dist.megatron.run", "--log-json", str(record), *runner, str(REPO / "examples" / "pretrain_gpt.py"),
           *SHAPES[a.shape].split(), *COMMON.split(), "--train-iters", str(a.iters), "--data-path", a.data,
           *graphs, *(["--fp4-param-gather"] if fp4 else [])]  # fmt: skip
    if fp4 and a.check_every:
        cmd[cmd.index("--log-json"):cmd.index("--log-json")] = ["--check-every", str(a.check_every)]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    if rc != 0:
        print(f"{name}: exit {rc}\n{text[-4000:]}", flush=True)
        return {"rc": rc}
    steps = {int(m.group(1)): float(m.group(2)) for m in STEP.finditer(text)}
    rec = json.loads(record.read_text())
    # The last iteration also hashes every fp32 master for the record (master_digest_final, seconds at this size):
    # left out of the median and of the check's cost.
    checked = {it["iteration"]: it["check_ms"] for it in rec["iterations"] if "check_ms" in it}
    kept = [t for i, t in steps.items() if WARMUP + 1 < i < a.iters and i not in checked]
    result = {"rc": 0, "median_ms": statistics.median(kept), "steps": steps, "checked": checked,
              "allocated_mib": rec.get("peak_allocated_mib"), "reserved_mib": rec.get("peak_reserved_mib"),
              "losses": [it["loss"] for it in rec["iterations"]]}
    for i, ms in checked.items():
        print(f"{name}: iteration {i} checked: step {steps.get(i, float('nan')):.1f} ms, of which the check "
              f"{ms:.1f} ms", flush=True)
    print(f"{name}: median {result['median_ms']:.1f} ms over {len(kept)} steps, peak allocated "
          f"{result['allocated_mib']:.0f} MiB, reserved {result['reserved_mib']:.0f} MiB", flush=True)
    return result


def _timed(x: dict) -> list:
    """A run's step times, past the capture and not checked."""
    return [s for i, s in x["steps"].items() if WARMUP + 1 < i < max(x["steps"]) and i not in x.get("checked", {})]


def table(results: dict, a, rounds: int) -> None:
    """The markdown tables of the runs so far."""
    modes = list(results)
    ok = {m: [x for x in rs if x["rc"] == 0] for m, rs in results.items()}
    base = statistics.median([s for x in ok.get("bf16", []) for s in _timed(x)] or [0])
    print(f"\n{a.shape}, --cuda-graph-impl {a.graphs}, {rounds} rounds of {a.iters} iterations (median step over "
          f"iterations > {WARMUP + 1} of every round)")
    print("| mode | step (ms) | / bf16 | per-round medians | peak allocated (MiB) | peak reserved (MiB) |")
    print("|---|---:|---:|---|---:|---:|")
    for m in modes:
        if not ok[m]:
            print(f"| {m} | failed | | | | |")
            continue
        med = statistics.median([s for x in ok[m] for s in _timed(x)])
        per_round = ", ".join(f"{x['median_ms']:.1f}" for x in ok[m])
        ratio = f"{med / base:.3f}x" if base else ""
        print(f"| {m} | {med:.1f} | {ratio} | {per_round} | {max(x['allocated_mib'] for x in ok[m]):.0f} | "
              f"{max(x['reserved_mib'] for x in ok[m]):.0f} |")
    if not a.check_every:
        return
    print(f"\nThe parity check every {a.check_every} iterations (the checked iterations against the mode's median)")
    print("| mode | checks | check (ms) | checked step (ms) | added per step |")
    print("|---|---:|---:|---:|---:|")
    for m in modes:
        checks = [(x["steps"][i], ms, statistics.median(_timed(x))) for x in ok[m] for i, ms in
                  x.get("checked", {}).items() if i in x["steps"] and i < max(x["steps"])]  # fmt: skip
        if not checks:
            continue
        step, ms, med = (statistics.median(c[k] for c in checks) for k in range(3))
        added = statistics.median((c[0] - c[2]) / a.check_every / c[2] for c in checks)
        print(f"| {m} | {len(checks)} | {ms:.1f} | {step:.1f} | {100 * added:.1f}% |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="full_iteration", choices=["none", "local", "full_iteration"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--shape", default="llama", choices=list(SHAPES))
    p.add_argument("--modes", default=",".join(m for m in MODES if m not in EAGER_ONLY))
    p.add_argument("--check-every", type=int, default=0, help="the NVFP4 runs' parity check interval (0: none)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "graphs")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    if a.graphs != "none" and (eager := sorted(EAGER_ONLY & set(modes))):
        p.error(f"--modes {','.join(eager)} runs eagerly only (its CUDA graphs are refused): add --graphs none")
    if a.check_every and a.check_every >= a.iters:
        # the last iteration's step also writes the run record: a check there is not timed against the others
        p.error(f"--check-every {a.check_every} needs --iters above it (got {a.iters}): the check table times the "
                "checked iterations before the last")
    a.out.mkdir(parents=True, exist_ok=True)
    a.data = str(a.out / "data" / "corpus")
    subprocess.run([sys.executable, "-m", "examples.megatron_preprocess", "--input",
                    str(REPO / "examples" / "data" / "tiny_corpus.txt"), "--output-prefix", a.data],
                   cwd=REPO, check=True, capture_output=True)  # fmt: skip
    results = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:  # ABBA: neither end of a round always goes first
            print(f"[round {r + 1}/{a.rounds}] {m}", flush=True)
            results[m].append(run(a.out, f"{m}-{r}", m, a))
        table(results, a, rounds=r + 1)  # after each round: a run cut short still leaves its table
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0 if all(x["rc"] == 0 for rs in results.values() for x in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
