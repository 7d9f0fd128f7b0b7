"""What a tensor-subclass *parameter* costs the host even when no op dispatches to it.

    python bench/subclass_leaf.py [--device cuda] [--size 256] [--tokens 64]

NVFP4Linear computes with a cached plain alias of its weight's compute copy (fp4_dist/compute_view.py), so its
forward and backward never enter NVFP4Tensor's Python dispatch; the weight gradient still goes into the parameter,
a tensor-subclass leaf. This times F.linear forward + backward through a cached plain tensor linked to a parameter
that is (a) a plain bf16 tensor, (b) a wrapper subclass that does nothing, (c) an NVFP4Tensor, by an expand view
(an autograd view of the parameter) or by clone's node (not a view: `compute_view.compute_alias`,
what the layers use now), and with the parameter passed directly (a: plain, c: through the dispatch), in
interleaved rounds (medians of 30 rounds of 50 iterations, the GPU drained between rounds): small sizes, so that
the host time is what is measured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4_dist  # noqa: E402
from bench.linear import PassThrough  # noqa: E402  (the do-nothing subclass of linear.py's floor column)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    dev, n = torch.device(args.device), args.size
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(n, n, generator=g)
    x = torch.randn(args.tokens, n, generator=g).to(dev, torch.bfloat16).requires_grad_()
    dy = torch.randn(args.tokens, n, generator=g).to(dev, torch.bfloat16)
    plain = torch.nn.Parameter(w32.to(dev, torch.bfloat16))
    nothing = torch.nn.Parameter(PassThrough(w32.to(dev, torch.bfloat16)))
    nvfp4 = torch.nn.Parameter(fp4_dist.quantize(w32.to(dev)))
    leaves = {"plain bf16": plain, "do-nothing subclass": nothing, "NVFP4Tensor": nvfp4}
    fp4_dist.post_all_gather_processing([nvfp4])  # its compute copy, which compute_alias aliases
    links = {"an expand view": lambda w: w.expand(n, n),
             "clone's node": lambda w: fp4_dist.compute.view.compute_alias(w) if w is nvfp4 else w.clone()}
    views = {(name, how): link(w) for name, w in leaves.items() for how, link in links.items()}
    assert all(type(v) is torch.Tensor for v in views.values())  # plain tensors: no dispatch when used

    def step(w, used):
        def run():
            w.grad = x.grad = None
            F.linear(x, used).backward(dy)
        return run

    cases = {f"{name} parameter, through {how}": step(leaves[name], v) for (name, how), v in views.items()}
    cases["plain bf16 parameter, directly"] = step(plain, plain)
    cases["NVFP4Tensor parameter, directly (dispatch)"] = step(nvfp4, nvfp4)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {k: [] for k in cases}
    for run in cases.values():
        for _ in range(50):
            run()
    sync()
    gc.disable()
    try:
        for _ in range(30):
            for name, run in cases.items():
                t0 = time.perf_counter()
                for _ in range(50):
                    run()
                times[name].append((time.perf_counter() - t0) / 50 * 1e6)
                sync()
    finally:
        gc.enable()
    base = statistics.median(times["plain bf16 parameter, directly"])
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"device: {name}; F.linear forward + backward, weight [{n}, {n}], {args.tokens} tokens, host us per "
          "iteration (median of 30 rounds)\n\n| parameter | us | x plain |\n|---|---|---|")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.1f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
