"""A linear layer's forward + backward with an NVFP4 weight against the same layer with a bf16 weight.

    PYTHONPATH=. python bench/linear.py [--tokens 4096] [--out DIR]

For each weight [M, K] (out_features x in_features): y = x @ W^T with x bf16 [tokens, K], then backward with
a fixed upstream gradient (input and weight gradients). Device time per iteration: CUDA events around 20
back-to-back iterations (so host work overlaps device work as in training); the variants take turns, round
after round (so clock and temperature drift hit them alike), and each reports its median over the rounds.
Host time: wall time of one iteration's Python call, median. Variants:

    bf16               nn.Linear with a bf16 weight
    nvfp4              the same layer after convert_linear_weights(compute_copy=True) (an NVFP4Linear: it computes
                       with its cached alias of the weight's kept compute copy), copy current (every microbatch)
    nvfp4 + refresh    the same, plus one refresh of the copy per iteration (one microbatch per weight update)
    nvfp4 parameter    F.linear on the NVFP4 parameter itself: every op through NVFP4Tensor's dispatch (what a
                       layer with its own forward, or Megatron's linears before the compute view, pay)
    nvfp4 per use      compute_copy = False: a dequantize launch in forward and again in backward
    (old) reference    the plain-torch reference dequantize on every use (what every forward ran before)
    subclass floor     the bf16 weight inside a tensor subclass that does nothing but unwrap it for every op:
                       what PyTorch's dispatch of any wrapper-subclass parameter costs (NVFP4Tensor is one)
    bf16 via alias     the bf16 parameter used through a cached tensor linked to it by clone's autograd node, as
                       NVFP4Linear uses its weight (what that node itself costs)
    subclass via alias a do-nothing wrapper-subclass parameter used the same way: no dispatch per use, but the
                       autograd engine still accumulates the weight gradient into a tensor-subclass leaf
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import fp4_dist
from fp4_dist.tensor.copy import refresh_compute_copies
from fp4_dist.kernels import reference
from timing import Span, publish, require_gpu  # noqa: E402 - bench/timing.py, beside this script

DEV = torch.device("cuda")
SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))


def timed(step, iters: int = 20, repeats: int = 7) -> tuple[float, float]:
    """(device ms per iteration, host ms per iteration), medians."""
    return interleaved({"x": step}, iters, repeats)["x"]


def interleaved(steps: dict, iters: int = 20, rounds: int = 9) -> dict:
    """{name: (device ms per iteration, host ms per iteration)}: medians over rounds in which every step runs
    `iters` times in turn."""
    for step in steps.values():
        for _ in range(5):
            step()
    torch.cuda.synchronize()
    device = {k: [] for k in steps}
    host = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            span = Span().start()
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                host[name].append(time.perf_counter() - t0)
            device[name].append(span.stop().ms() / iters)
    return {k: (statistics.median(device[k]), 1e3 * statistics.median(host[k])) for k in steps}


class PassThrough(torch.Tensor):
    """A wrapper subclass that runs every op on the plain tensor it holds (detach keeps the wrapper, as
    nn.Parameter needs): the host cost of subclass dispatch with no work of its own."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        self.inner = inner
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return PassThrough(args[0].inner)
        return func(*[a.inner if isinstance(a, PassThrough) else a for a in args], **(kwargs or {}))

    __torch_function__ = torch._C._disabled_torch_function_impl


def variants(m: int, k: int, tokens: int):
    g = torch.Generator(device=DEV).manual_seed(m * 7 + k)
    w32 = torch.randn(m, k, device=DEV, generator=g) * 0.02
    x = torch.randn(tokens, k, device=DEV, generator=g, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, m, device=DEV, generator=g, dtype=torch.float32).to(torch.bfloat16)
    bf16 = torch.nn.Linear(k, m, bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(w32)
    layer = torch.nn.Linear(k, m, bias=False, device=DEV, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(w32.clone())
    fp4_dist.convert_linear_weights(layer, dtype=torch.bfloat16, compute_copy=True)
    assert type(layer) is fp4_dist.NVFP4Linear
    q = torch.nn.Parameter(fp4_dist.quantize(w32))
    per_use = torch.nn.Parameter(fp4_dist.quantize(w32))
    per_use.compute_copy = False
    floor = torch.nn.Parameter(PassThrough(w32.to(torch.bfloat16)))

    leaf = torch.nn.Parameter(PassThrough(w32.to(torch.bfloat16)))
    aliases = {"bf16 via alias": (bf16.weight.clone(), bf16.weight), "subclass via alias": (leaf.clone(), leaf)}
    assert all(type(v) is torch.Tensor and v.grad_fn is not None for v, _ in aliases.values())  # no dispatch per use

    def through_alias(name):
        v, w = aliases[name]

        def step():
            w.grad = x.grad = None
            F.linear(x, v).backward(dy)
        return step

    def fwd_bwd(w):
        def step():
            w.grad = x.grad = None
            F.linear(x, w).backward(dy)
        return step

    def module(lin):
        def step():
            lin.weight.grad = x.grad = None
            lin(x).backward(dy)
        return step

    def with_refresh():
        refresh_compute_copies([layer.weight])
        module(layer)()

    class _Reference(torch.autograd.Function):  # the old compute path: plain-torch dequantize on each use
        @staticmethod
        def forward(ctx, w):
            return reference.dequantize(w.rowwise_data, w.rowwise_scale_inv, w.amax, torch.bfloat16)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def old():
        q.grad = x.grad = None
        F.linear(x, _Reference.apply(q)).backward(dy)

    return {"bf16": module(bf16), "nvfp4": module(layer), "nvfp4 + refresh": with_refresh,
            "nvfp4 parameter": fwd_bwd(q), "nvfp4 per use": fwd_bwd(per_use), "(old) reference": old,
            "subclass floor": fwd_bwd(floor), "bf16 via alias": through_alias("bf16 via alias"),
            "subclass via alias": through_alias("subclass via alias")}  # fmt: skip


def dequantize_vs_copy(m: int, k: int) -> dict:
    """One weight's dequantize launch against a bf16 device copy of the same weight (2 + 2 bytes/element)."""
    q = fp4_dist.quantize(torch.randn(m, k, device=DEV))
    src = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    out = torch.empty_like(src)
    deq = timed(lambda: fp4_dist.kernels.dequantize([q.rowwise_data], [q.rowwise_scale_inv], [q.amax], [out]))[0]
    copy = timed(lambda: dst.copy_(src))[0]
    ref = timed(lambda: reference.dequantize(q.rowwise_data, q.rowwise_scale_inv, q.amax, torch.bfloat16), 5, 3)[0]
    return {"dequantize_ms": deq, "bf16_copy_ms": copy, "reference_ms": ref}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    require_gpu("bench/linear.py", "an NVFP4 linear layer's device time against bf16's")
    name = torch.cuda.get_device_name()
    rows = []
    for m, k in SHAPES:
        res = interleaved(variants(m, k, args.tokens))
        rows.append(dict(shape=[m, k], **{label: {"device_ms": d, "host_ms": h} for label, (d, h) in res.items()},
                         **dequantize_vs_copy(m, k)))  # fmt: skip
    labels = ["bf16", "nvfp4", "nvfp4 parameter", "subclass floor", "bf16 via alias", "subclass via alias",
              "nvfp4 + refresh", "nvfp4 per use", "(old) reference"]  # fmt: skip
    hosts = ("bf16", "nvfp4", "nvfp4 parameter", "subclass floor", "bf16 via alias", "subclass via alias")
    lines = [f"device: {name}; linear forward + backward, {args.tokens} tokens, bf16 activations", "",
             "| weight [M, K] | " + " | ".join(f"{lb} ms (x bf16)" for lb in labels) +
             " | host ms " + " / ".join(hosts) + " |",
             "|---|" + "---|" * (len(labels) + 1)]  # fmt: skip
    for r in rows:
        base = r["bf16"]["device_ms"]
        cells = [f"{r[lb]['device_ms']:.3f} ({r[lb]['device_ms'] / base:.3f}x)" for lb in labels]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) +
                     " | " + " / ".join(f"{r[lb]['host_ms']:.3f}" for lb in hosts) + " |")
    lines += ["", "| weight [M, K] | dequantize kernel ms | bf16 copy of the weight ms | kernel / copy | "
              "reference (torch) ms | reference / copy |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['shape']} | {r['dequantize_ms']:.4f} | {r['bf16_copy_ms']:.4f} | "
                     f"{r['dequantize_ms'] / r['bf16_copy_ms']:.2f}x | {r['reference_ms']:.3f} | "
                     f"{r['reference_ms'] / r['bf16_copy_ms']:.1f}x |")
    publish("\n".join(lines), args.out, "bench_linear", dict(device=name, tokens=args.tokens, rows=rows))


if __name__ == "__main__":
    main()
