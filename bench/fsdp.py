"""FSDP2 training step with NVFP4 weights (fp4_dist.fsdp) against plain bf16 FSDP2, same model, same run.

    torchrun --nproc-per-node N bench/fsdp.py [--hidden 2048] [--layers 8] [--tokens 8192] [--steps 10] [--rounds 5]
        [--slow-link] [--profile] [--phases] [--no-optimizer]
    torchrun --nproc-per-node N bench/fsdp.py --memory-only bf16|nvfp4 [--hidden ...]   # peak memory, one variant

A GPT-like stack of pre-norm blocks (attention projections qkv [3h, h] and out [h, h], MLP [4h, h] and [h, 4h];
the attention itself is left out: it does not touch the weights) sharded per block. Variants take turns in
rounds of bf16, nvfp4, nvfp4, bf16 (--steps each; the ratio of each round is printed, and their median). "bf16" is
torch's fully_shard with MixedPrecisionPolicy(param_dtype=bf16) (the weights gathered in bf16); "nvfp4" is
fp4_dist.fsdp.fully_shard_nvfp4 with the same policy (linear weights gathered as NVFP4, cast once per step before
the forward). Prints the median step time of each (forward + backward + AdamW step), the
bytes per step of each collective (counted on the real calls) and, on GPUs, each collective's exposed time (the
part of its kernels no other kernel overlaps, from a device trace). --slow-link runs NCCL over sockets.
--phases times the host per step and phase (forward, backward, optimizer step; nothing traced, no synchronisation
added) and, inside them, fp4_dist's own calls (the cast, FSDP2's two extension hooks, the batched dequantize) and
FSDP2's per-group and per-parameter work: what the NVFP4 step adds on the host, call by call, against bf16's.
--no-optimizer leaves the optimizer step out (no cast after the first step): the gather path alone.
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
from device_trace import exposed_collectives  # noqa: E402 - bench/device_trace.py, beside this script
from timing import SLOW_LINK, max_over_ranks, patched, publish  # noqa: E402 - bench/timing.py, beside this script


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
            fully_shard_nvfp4(model, mp_policy=mp, shard_modules=list(model.blocks), compute=args.compute)
    else:
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


COLLECTIVES = {"all-gather": ("all_gather_single", "all_gather_into_tensor"),
               "reduce-scatter": ("reduce_scatter_tensor", "reduce_scatter_single"),
               "all-reduce": ("all_reduce",)}


class Counter:
    """Bytes each collective moves per call, counted by wrapping (not mocking) torch.distributed: the output of
    an all-gather, the input of a reduce-scatter, the buffer of an all-reduce."""

    def __init__(self):
        self.bytes = {kind: 0 for kind in COLLECTIVES}
        self._real = {n: (kind, getattr(dist, n)) for kind, names in COLLECTIVES.items() for n in names
                      if hasattr(dist, n)}  # fmt: skip

    def __enter__(self):
        for n, (kind, fn) in self._real.items():
            def wrapper(*a, _fn=fn, _kind=kind, **k):
                # the larger buffer: an all-gather's output, a reduce-scatter's input, the all-reduce's one
                self.bytes[_kind] += max(t.numel() * t.element_size() for t in (*a, *k.values())
                                         if isinstance(t, torch.Tensor))  # fmt: skip
                return _fn(*a, **k)

            setattr(dist, n, wrapper)
        return self

    def __exit__(self, *exc):
        for n, (_, fn) in self._real.items():
            setattr(dist, n, fn)


def traced(fn, steps: int):
    """torch.profiler's events of `steps` steps, the device traced alone (the host runs at its own speed)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.events()


def step_fn(model, opt, x, optimize: bool = True):
    def step():
        model(x).float().square().mean().backward()
        if optimize:
            opt.step()
        opt.zero_grad(set_to_none=True)
    step.parts = (model, opt, x)
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


def profile_variant(variant: str, fn, args, report: bool, events) -> None:
    """Where one variant's step time goes (every rank runs the same steps; rank 0 reports): host milliseconds per
    step with nothing added (the step's own waits included), the calls that make the host wait for the GPU (torch's
    sync debug mode), the device's busy time and idle gaps (`events`: its `traced` steps, on a GPU), and
    cProfile's largest own times."""
    import cProfile
    import io
    import pstats

    from device_trace import counting_waits, launches, short, summarize

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = args.steps
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = 1e3 * (time.perf_counter() - t0) / n
    sync()
    t1 = time.perf_counter()
    wall = 1e3 * (t1 - t0) / n
    waits: dict = {}
    if cuda:
        with counting_waits(waits, n):
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(n):
                fn()
        sync()
        dev = summarize(events, n)
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(n):
        fn()
    sync()
    prof_py.disable()
    if not report:
        return
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        prof_py.dump_stats(Path(args.out) / f"profile_{variant}.pstats")
    text = io.StringIO()
    stats = pstats.Stats(prof_py, stream=text)
    stats.sort_stats("tottime").print_stats(16)
    stats.sort_stats("cumulative").print_stats(r"fp4_dist", 16)
    lines = [f"\n##### {variant}: {n} steps: host {host:.2f} ms per step (enqueue, its own waits included), "
             f"wall {wall:.2f} ms"]
    if cuda:
        lines.append(f"GPU busy {dev.busy_ms:.2f} ms per step, idle {sum(dev.gaps.values()):.2f} ms between kernels; "
                     f"{launches(dev):.0f} kernel launches per step, {sum(dev.kernels.values()):.2f} ms kernel time")
        lines.append(f"waits for the GPU per step: {sum(waits.values()):.1f}")
        lines += [f"  {v:5.1f}  {k}" for k, v in sorted(waits.items(), key=lambda kv: -kv[1])[:8]]
        lines.append("largest idle gaps (ms per step):")
        lines += [f"  {ms:7.3f}  {a} -> {b}" for (a, b), ms in sorted(dev.gaps.items(), key=lambda kv: -kv[1])[:10]]
        lines.append("kernels (ms per step, count):")
        lines += [f"  {ms:7.3f}  {short(k, 100)}" for k, ms in sorted(dev.kernels.items(), key=lambda kv: -kv[1])[:14]]
    lines.append(text.getvalue()[-6000:])
    print("\n".join(lines), flush=True)


PHASES = ("forward", "backward", "optimizer", "zero_grad")


def fsdp2_targets() -> list:
    """FSDP2's own per-group and per-parameter work, timed in both variants alike (where the NVFP4 path's extension
    hooks make FSDP2 itself do more)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group as pg

    group, param = pg.FSDPParamGroup, _fsdp_param.FSDPParam
    out = [(group, name, f"FSDP2 {name}") for name in ("unshard", "wait_for_unshard", "reshard", "post_backward")
           if name in group.__dict__]
    out += [(pg, name, f"FSDP2 {name}") for name in ("foreach_all_gather", "foreach_all_gather_copy_out",
                                                      "foreach_reduce") if name in pg.__dict__]
    out += [(param, name, f"FSDP2 param.{name}") for name in ("init_unsharded_param", "all_gather_inputs",
                                                              "free_unsharded_param") if name in param.__dict__]
    return out


def phases(steps: dict, args, report: bool) -> None:
    """Host milliseconds per step by phase, runs of `args.steps` steps in the order bf16, nvfp4, nvfp4, bf16 (x
    rounds), medians over steps; the fp4_dist rows are sums over the step of the calls named (rank 0 prints)."""
    from fp4_dist.fsdp import dequant_batch, master, shard

    targets = [(shard._Registry, "precompute", "cast (root pre-forward)"),
               (master._BoundPreAllGather, "__call__", "fsdp_pre_all_gather"),
               (master.NVFP4Master, "fsdp_post_all_gather", "fsdp_post_all_gather"),
               (dequant_batch.DequantBatch, "flush", "  of which dequantize launches"),
               (shard._Registry, "after_forward", "non-finite verdict (root post-forward)")]
    targets += fsdp2_targets()
    labels = [label for _, _, label in targets]
    rows = {v: {k: [] for k in (*PHASES, "step", *labels)} for v in steps}
    calls = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds, step_calls = {}, {}  # of the step that runs, cleared before each
    with patched(targets, seconds, step_calls):
        for _ in range(args.rounds):
            for v in ("bf16", "nvfp4", "nvfp4", "bf16"):
                model, opt, x = steps[v].parts
                sync()
                for _ in range(args.steps):
                    seconds.clear()
                    step_calls.clear()
                    t = [time.perf_counter()]
                    out = model(x)
                    t.append(time.perf_counter())
                    out.float().square().mean().backward()
                    t.append(time.perf_counter())
                    if not args.no_optimizer:
                        opt.step()
                    t.append(time.perf_counter())
                    opt.zero_grad(set_to_none=True)
                    t.append(time.perf_counter())
                    for i, k in enumerate(PHASES):
                        rows[v][k].append(1e3 * (t[i + 1] - t[i]))
                    rows[v]["step"].append(1e3 * (t[-1] - t[0]))
                    for label in labels:
                        rows[v][label].append(1e3 * seconds.get(label, 0.0))
                    calls[v] = dict(step_calls)
                sync()
    if not report:
        return
    med = {v: {k: statistics.median(x) for k, x in r.items()} for v, r in rows.items()}
    lines = [f"\nHost ms per step by phase (median of {args.rounds * 2 * args.steps} steps per variant; the host "
             "enqueues without waiting, so a phase that outruns the GPU shows its host cost, one that waits on a "
             "full launch queue shows the GPU's)", "", "| phase | bf16 | nvfp4 | nvfp4 - bf16 | nvfp4 calls per step |",
             "|---|---|---|---|---|"]
    for k in (*PHASES, "step", *labels):
        n = calls.get("nvfp4", {}).get(k, "")
        lines.append(f"| {k} | {med['bf16'][k]:.2f} | {med['nvfp4'][k]:.2f} | {med['nvfp4'][k] - med['bf16'][k]:+.2f} "
                     f"| {n} |")
    print("\n".join(lines), flush=True)


def memory_only(args, x, info) -> None:
    """`--memory-only`: one variant alone, its peak memory (torch's allocator, max over ranks)."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, opt = build(args.memory_only, args, x.device)
    step = step_fn(model, opt, x, not args.no_optimizer)
    for _ in range(args.steps):
        step()
    peaks = max_over_ranks([torch.cuda.max_memory_allocated() if cuda else 0,
                            torch.cuda.max_memory_reserved() if cuda else 0])
    allocated, reserved = (v / 2**20 for v in peaks)
    if info.rank == 0:
        print(f"memory {args.memory_only}: peak allocated {allocated:,.0f} MiB, reserved {reserved:,.0f} MiB (max over "
              f"{info.world_size} ranks; hidden {args.hidden} x {args.layers} blocks, {args.tokens} tokens per rank)",
              flush=True)  # fmt: skip
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds, each bf16, nvfp4, nvfp4, bf16 (--steps each)")
    p.add_argument("--compute", choices=("bf16", "fp8"), default="bf16",
                   help="what the nvfp4 variant's GEMMs read: bf16 (the default) or fp8 (FP8 copies of the gathered "
                        "weights, FP8 block-scaled GEMMs: Hopper; docs/fp8.md)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--profile", action="store_true",
                   help="also say where each variant's step time goes: host, waits, device gaps, cProfile (rank 0)")
    p.add_argument("--phases", action="store_true",
                   help="host time per step by phase and of fp4_dist's own calls, bf16 against nvfp4 (rank 0)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="steps without the optimizer step (so no NVFP4 cast after the first): the gather path alone")
    p.add_argument("--memory-only", choices=("bf16", "nvfp4"), default=None,
                   help="no timing: build this variant alone in the process, run --steps steps and print its peak "
                        "allocated and reserved memory per rank (max over ranks); one process per variant")
    p.add_argument("--slow-link", action="store_true",
                   help="NCCL over sockets only (no NVLink, shared memory or InfiniBand): a proxy for data "
                        "parallelism across nodes")
    args = p.parse_args()
    if args.slow_link:  # read by NCCL when the communicators are made, below
        os.environ.update(SLOW_LINK)
    info = init_distributed()
    dev = info.device
    x = torch.randn(args.tokens // 8, 8, args.hidden, device=dev, generator=None).to(torch.bfloat16)
    if args.memory_only:
        memory_only(args, x, info)
        return
    runs = {v: build(v, args, dev) for v in ("bf16", "nvfp4")}
    steps = {v: step_fn(m, o, x, not args.no_optimizer) for v, (m, o) in runs.items()}
    moved = {}
    for v, fn in steps.items():
        for _ in range(3):
            fn()
        with Counter() as c:
            fn()
        moved[v] = c.bytes
    times = {v: [] for v in steps}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.phases:  # before any tracing: the profiler leaves CUDA launches slower for the rest of the process
        phases(steps, args, info.rank == 0)
    rounds = []  # each round runs bf16, nvfp4, nvfp4, bf16 (ABBA): a drift of the machine hits both alike
    for _ in range(args.rounds):
        got = {v: [] for v in steps}
        for v in ("bf16", "nvfp4", "nvfp4", "bf16"):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[v]()
            sync()
            got[v].append(1e3 * (time.perf_counter() - t0) / args.steps)
        for v in steps:
            times[v] += got[v]
        rounds.append(statistics.mean(got["nvfp4"]) / statistics.mean(got["bf16"]))
    med = {v: statistics.median(t) for v, t in times.items()}
    paired = statistics.median(rounds)
    # Traced after the timed rounds: the profiler leaves CUDA launches slower for the rest of the process.
    trace = {v: traced(fn, args.steps) for v, fn in steps.items()} if dev.type == "cuda" else {}
    exposed = {v: exposed_collectives(events, args.steps) for v, events in trace.items()}
    held = {v: held_by_forward(runs[v][0], x) for v in runs} if dev.type == "cuda" else {}
    if args.profile:
        for v, fn in steps.items():
            profile_variant(v, fn, args, info.rank == 0, trace.get(v))
    weights = sum(m.numel() for b in runs["bf16"][0].blocks for m in (b.qkv.weight, b.proj.weight, b.fc1.weight,
                                                                         b.fc2.weight))  # fmt: skip
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    link = "slow link (NCCL over sockets)" if args.slow_link else "NVLink" if dev.type == "cuda" else "gloo"
    lines = [f"device: {name} x {info.world_size}, {link}; hidden {args.hidden} x {args.layers} blocks, {args.tokens} "
             f"tokens per rank, {weights / 1e6:.1f}M linear weight elements", "",
             f"NVFP4 / bf16 per ABBA round, median of {args.rounds}: {paired:.3f} (rounds: "
             + ", ".join(f"{r:.3f}" for r in rounds) + ")", "",
             "| variant | median step ms | x bf16 | all-gather MiB/step | reduce-scatter MiB/step | all-reduce KiB/step "
             "| exposed ms/step: all-gather, reduce-scatter, all-reduce | MiB held from forward to backward |",
             "|---|---|---|---|---|---|---|---|"]
    for v in steps:
        b, e = moved[v], exposed.get(v, {})
        shown = ", ".join(f"{e.get(k, (0.0, 0.0))[1]:.2f}" for k in COLLECTIVES) if e else "-"
        lines.append(f"| {v} | {med[v]:.2f} | {med[v] / med['bf16']:.3f} | {b['all-gather'] / 2**20:.2f} | "
                     f"{b['reduce-scatter'] / 2**20:.2f} | {b['all-reduce'] / 2**10:.2f} | {shown} | "
                     f"{held.get(v, float('nan')):.0f} |")
    text = "\n".join(lines)
    if info.rank == 0:
        publish(text, args.out, "bench_fsdp", {"median_ms": med, "times": times, "paired": paired, "rounds": rounds,
                                               "bytes": moved,
                                               "exposed_ms": exposed, "slow_link": args.slow_link})
    shutdown()


if __name__ == "__main__":
    main()
