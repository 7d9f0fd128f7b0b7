"""FSDP2 training step with NVFP4 weights (fp4_dist.fsdp) against plain bf16 FSDP2, same model, same run.

    torchrun --nproc-per-node N bench/fsdp.py [--hidden 2048] [--layers 8] [--tokens 8192] [--steps 30]

A GPT-like stack of pre-norm blocks (attention projections qkv [3h, h] and out [h, h], MLP [4h, h] and [h, 4h];
the attention itself is left out: it does not touch the weights) sharded per block. Variants take turns, round
after round: "bf16" is torch's fully_shard with MixedPrecisionPolicy(param_dtype=bf16) (the weights gathered in
bf16); "nvfp4" is fp4_dist.fsdp.fully_shard_nvfp4 with the same policy (linear weights gathered as NVFP4, cast
once per step before the forward). Prints the median step time of each (forward + backward + AdamW step; CUDA
events) and the all-gather bytes per step counted on the real collective.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4_dist.fsdp import fully_shard_nvfp4  # noqa: E402
from fp4_dist.launch import init_distributed, shutdown  # noqa: E402
from timing import publish  # noqa: E402 - bench/timing.py, beside this script


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, h: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def build(variant: str, args, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = Net(args.hidden, args.layers)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if variant == "nvfp4":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fully_shard_nvfp4(model, mp_policy=mp, shard_modules=list(model.blocks))
    else:
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


class Counter:
    """Bytes of every all-gather, counted by wrapping (not mocking) torch.distributed."""

    def __init__(self):
        self.bytes = 0
        self._names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
        self._real = {n: getattr(dist, n) for n in self._names}

    def __enter__(self):
        for n in self._names:
            fn = self._real[n]

            def wrapper(out, inp, *a, _fn=fn, **k):
                self.bytes += out.numel() * out.element_size()
                return _fn(out, inp, *a, **k)

            setattr(dist, n, wrapper)
        return self

    def __exit__(self, *exc):
        for n in self._names:
            setattr(dist, n, self._real[n])


def step_fn(model, opt, x):
    def step():
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def held_by_forward(model, x) -> float:
    """MiB the forward leaves allocated for its backward (activations, and anything of the gathered weights that
    outlives the reshard after forward): the same activations in both variants, so a difference is weights."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(x)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - before) / 2**20
    out.float().square().mean().backward()
    for p in model.parameters():
        p.grad = None
    return held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--profile", action="store_true", help="also cProfile a few steps of each variant (rank 0)")
    args = p.parse_args()
    info = init_distributed()
    dev = info.device
    x = torch.randn(args.tokens // 8, 8, args.hidden, device=dev, generator=None).to(torch.bfloat16)
    runs = {v: build(v, args, dev) for v in ("bf16", "nvfp4")}
    steps = {v: step_fn(m, o, x) for v, (m, o) in runs.items()}
    gathered = {}
    for v, fn in steps.items():
        for _ in range(3):
            fn()
        with Counter() as c:
            fn()
        gathered[v] = c.bytes
    times = {v: [] for v in steps}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(args.rounds):
        for v, fn in steps.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            sync()
            times[v].append(1e3 * (time.perf_counter() - t0) / args.steps)
    med = {v: statistics.median(t) for v, t in times.items()}
    held = {v: held_by_forward(runs[v][0], x) for v in runs} if dev.type == "cuda" else {}
    if args.profile and info.rank == 0:
        import cProfile
        import io
        import pstats

        for v, fn in steps.items():
            sync()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.steps):
                fn()
            prof.disable()
            host = 1e3 * (time.perf_counter() - t0) / args.steps
            sync()
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                prof.dump_stats(Path(args.out) / f"profile_{v}.pstats")
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            print(f"##### {v}: host ms per step (no sync, profiled) {host:.2f}\n{text.getvalue()[-4000:]}", flush=True)
            if dev.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
                    for _ in range(args.steps):
                        fn()
                    sync()
                print(kprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16), flush=True)
    weights = sum(m.numel() for b in runs["bf16"][0].blocks for m in (b.qkv.weight, b.proj.weight, b.fc1.weight,
                                                                         b.fc2.weight))  # fmt: skip
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    lines = [f"device: {name} x {info.world_size}; hidden {args.hidden} x {args.layers} blocks, {args.tokens} tokens "
             f"per rank, {weights / 1e6:.1f}M linear weight elements", "",
             "| variant | median step ms | all-gather MiB per step (fwd + bwd) | x bf16 | MiB held from forward to "
             "backward |", "|---|---|---|---|---|"]
    for v in steps:
        lines.append(f"| {v} | {med[v]:.2f} | {gathered[v] / 2**20:.2f} | "
                     f"{med[v] / med['bf16']:.3f} time, {gathered[v] / max(gathered['bf16'], 1):.3f} bytes | "
                     f"{held.get(v, float('nan')):.0f} |")
    text = "\n".join(lines)
    if info.rank == 0:
        publish(text, args.out, "bench_fsdp", {"median_ms": med, "times": times, "gathered_bytes": gathered})
    shutdown()


if __name__ == "__main__":
    main()
