"""Host time per use of a linear weight: plain bf16, NVFP4 with a kept compute copy, lean NVFP4 (fp4_dist.compute.lean),
the bookkeeping of a use on Megatron's path alone (lean's claim and backward check, a kept copy's lookup), and the
dequantize launch itself, bound (a direct driver launch) and through the call form (CuPy's generic call). The weight
does not change between the calls, so a lean use finds its copy made and launches nothing.

    python bench/host_per_use.py [--size 2048] [--tokens 16] [--calls 2000] [--device cpu]

A few tokens make the GPU work negligible, so the wall time per call is the host's (the device is drained once
at the end of each timed loop). Prints one table, microseconds per call. ``--device cpu`` times the layers' host
path on a CPU core (the same Python and autograd work; the dequantize launch rows need CUDA and are left out).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4_dist  # noqa: E402
from fp4_dist import kernels  # noqa: E402
from timing import require_gpu  # noqa: E402 - bench/timing.py, beside this script


def per_call(fn, calls: int, warmup: int = 20) -> float:
    """Microseconds per call of `fn` (the device drained before and after the timed loop)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t) / calls


def megatron_path(dev: torch.device, size: int, calls: int) -> list:
    """The bookkeeping of a weight use on Megatron's path alone (the adapter's rows, without Megatron's linear): a
    lean use with its claim (`lean_call_refilled`, an op that only claims), the backward's check that the copy is
    in its buffer (`Use.refill`), and a kept copy's lookup (`compute_view`). The copy is made already, so no use
    launches anything."""
    from fp4_dist.compute.view import compute_view
    from fp4_dist.megatron import lean_claim

    layers = {}
    for kept in (False, True):
        layers[kept] = torch.nn.Linear(size, size, bias=False).to(dev, torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp4_dist.convert_linear_weights(layers[kept], compute_copy=kept)
    lean, kept = layers[False], layers[True]
    use = lean_claim.lean_call_refilled(lean, lean.weight, lean_claim.claim)
    return [("Megatron path, lean use and its claim (lean_call_refilled)",
             per_call(lambda: lean_claim.lean_call_refilled(lean, lean.weight, lean_claim.claim), calls)),
            ("Megatron path, lean backward's check (Use.refill)", per_call(use.refill, calls)),
            ("Megatron path, kept copy's lookup (compute_view)",
             per_call(lambda: compute_view(kept, kept.weight), calls))]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="also cProfile the lean forward + backward loop")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    if args.device == "cuda":
        require_gpu("bench/host_per_use.py", "host time per weight use of the CUDA launches (--device cpu: the "
                    "layers' host path on a CPU core)")
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows, nvfp4_weights = [], []
    for mode in ("bf16", "kept", "lean", "lean", "kept", "bf16"):
        m = torch.nn.Linear(args.size, args.size, bias=False).to(dev, torch.bfloat16)
        if mode != "bf16":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fp4_dist.convert_linear_weights(m, compute_copy=mode == "kept")
            nvfp4_weights.append(m.weight)
        fwd = per_call(lambda: m(x), args.calls)
        both = per_call(lambda: m(x).sum().backward(), args.calls)
        rows.append((f"{mode}: forward", fwd))
        rows.append((f"{mode}: forward + backward", both))
        if mode == "lean" and args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            per_call(lambda: m(x).sum().backward(), args.calls // 4)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    rows += megatron_path(dev, args.size, args.calls)
    if dev.type == "cpu":
        print(f"host us per call, [{args.size}, {args.size}] weight, {args.tokens} tokens, a CPU core")
        for name, us in rows:
            print(f"| {name} | {us:.1f} |")
        return
    w = next(p for p in nvfp4_weights if fp4_dist.is_nvfp4_tensor(p))
    out = torch.empty(tuple(w.shape), dtype=torch.bfloat16, device=dev)
    bound = kernels.bind_dequantize([w.rowwise_data], [w.rowwise_scale_inv], [w.amax], [out])
    rows.append(("dequantize, bound (direct driver launch)", per_call(bound, args.calls)))
    rows.append(("dequantize, call form (plan lookup, CuPy launch)",
                 per_call(lambda: kernels.dequantize([w.rowwise_data], [w.rowwise_scale_inv], [w.amax], [out]),
                          args.calls)))  # fmt: skip
    rows.append(("torch copy_ of the same bytes (a torch launch)", per_call(lambda: out.copy_(out), args.calls)))
    print(f"host us per call, [{args.size}, {args.size}] weight, {args.tokens} tokens, {torch.cuda.get_device_name()}")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
