"""Memory and step time of a GPT-like stack trained with Zero1Optimizer on one GPU or several: plain bf16 weights,
NVFP4 weights with kept compute copies (compute_copy=True), and lean NVFP4 weights (the default: a copy only around
each use, `fp4_dist.compute.lean`).

    python bench/zero1_stack.py [--hidden 2048] [--layers 8] [--seq 1024] [--micro-batch 4] [--steps 15] [--rounds 2]
        [--nproc N] [--device cpu]

Each mode runs in its own process (so each has its own peak), in rounds that alternate the order; prints per mode
the peak allocated memory during the timed steps, the median step (forward + backward + optimizer step, CUDA
events) and the bytes the weights hold (bf16 params, or packed NVFP4 + compute copies). With ``--nproc N`` each
mode's process is N data-parallel ranks under torchrun (NCCL, one GPU each; every rank its own micro-batch of the
same shape, so the tokens per step grow with N): Zero1Optimizer's gradient reduce-scatter and 4-bit gather run between
them, the step is rank 0's and the peak the largest of any rank's. ``--device cpu`` runs the same on CPU ranks (gloo):
a check that the bench runs, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4_dist  # noqa: E402
from fp4_dist.optim import Zero1Optimizer  # noqa: E402
from timing import median_ms, require_gpu  # noqa: E402 - bench/timing.py, beside this script

MODES = ("bf16", "kept", "lean")


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, h: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h, h // 128) for _ in range(layers))
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def run_mode(mode: str, args) -> dict:
    import torch.distributed as dist

    from fp4_dist.launch import init_distributed, shutdown

    info = init_distributed("nccl" if args.device == "cuda" else "gloo")
    dev = info.device if args.device == "cuda" else torch.device("cpu")  # the CPU asked for on a GPU machine too
    torch.manual_seed(0)  # the same model on every rank
    model = Net(args.hidden, args.layers).to(dev, torch.bfloat16)
    if mode != "bf16":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp4_dist.convert_linear_weights(model, compute_copy=mode == "kept")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Zero1Optimizer: none of")  # bf16: plain ZeRO-1, the baseline
        opt = Zero1Optimizer(model.named_parameters(), lambda g: torch.optim.AdamW(g, lr=1e-4, fused=True))
    x = torch.randn(args.micro_batch, args.seq, args.hidden, device=dev, dtype=torch.bfloat16,
                    generator=torch.Generator(dev).manual_seed(1 + info.rank))  # each rank its own micro-batch

    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cuda = dev.type == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_ms = median_ms(step, args.steps, warmup=0)
    weights = dict(opt.param_memory_bytes(), lean_pool=fp4_dist.compute.pool_bytes())
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0], dtype=torch.float64, device=dev)
    if info.world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    shutdown()
    return {"mode": mode, "peak_MiB": peak.item() / 2**20, "step_ms": step_ms, "ranks": info.world_size,
            "rank": info.rank, "weights_MiB": {k: v / 2**20 for k, v in weights.items()}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help="which modes to run (comma-separated)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel ranks per mode (torchrun, one GPU each)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: gloo CPU ranks, to check that the bench runs (no measurement)")
    p.add_argument("--mode", choices=MODES, help="run one mode here and print its JSON (the driver's child)")
    args = p.parse_args()
    if args.device == "cuda":
        require_gpu("bench/zero1_stack.py", "Zero1Optimizer's step time and peak GPU memory")
        if args.nproc > torch.cuda.device_count():
            raise SystemExit(f"bench/zero1_stack.py: --nproc {args.nproc} needs as many GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
    if args.mode:
        result = run_mode(args.mode, args)
        if result["rank"] == 0:
            print(json.dumps(result))
        return
    modes = tuple(args.modes.split(","))
    results = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            launcher = [sys.executable] if args.nproc == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
            cmd = launcher + [__file__, "--mode", mode] + [f"--{k.replace('_', '-')}={v}" for k, v in
                              vars(args).items() if k not in ("mode", "rounds", "modes", "nproc")]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"bench/zero1_stack.py: the {mode} run failed (exit {proc.returncode}):\n"
                                 + proc.stderr[-3000:])
            results[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    where = (f"{args.nproc} x {torch.cuda.get_device_name()}" if args.device == "cuda"
             else f"{args.nproc} CPU rank{'s' * (args.nproc > 1)}")
    print(f"GPT-like stack, hidden {args.hidden} x {args.layers} layers, {args.micro_batch} x {args.seq} tokens per "
          f"rank, Zero1Optimizer (AdamW) on {where}")
    print(f"{'mode':9} {'peak MiB':>10} {'step ms (runs)':>24} {'vs bf16':>8} {'weights MiB':>43}")
    base = statistics.median(r["step_ms"] for r in results[modes[0]])
    for mode, runs in results.items():
        step = statistics.median(r["step_ms"] for r in runs)
        w = runs[0]["weights_MiB"]
        wtxt = (f"dense {w['dense']:.0f} nvfp4 {w['nvfp4']:.0f} copies {w['compute_copies']:.0f} "
                f"pool {w['lean_pool']:.0f}")
        each = ", ".join(f"{r['step_ms']:.2f}" for r in runs)
        peak = max(r["peak_MiB"] for r in runs)
        print(f"{mode:9} {peak:10.0f} {step:8.2f} ({each}) {step / base:8.3f} {wtxt:>43}")


if __name__ == "__main__":
    main()
