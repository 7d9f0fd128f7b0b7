"""Host microseconds per call of each piece of a lean use (fp4_dist.compute.lean) against a kept copy's lookup, on the
device the step runs on (a step's host time is these calls times 4 x layers x weights x 2 per microbatch).

    python bench/lean_percall.py [--size 2048] [--calls 20000]

Prints one table. The weights are [size, size]; their values do not matter here.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4_dist  # noqa: E402
from fp4_dist.compute import lean  # noqa: E402
from fp4_dist.compute.view import compute_view  # noqa: E402
from bench.lean_host import per_call  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def linear(keep: bool):
        m = torch.nn.Linear(args.size, args.size, bias=False).to(dev, torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fp4_dist.convert_linear_weights(m, compute_copy=keep)
        return m

    kept, a, b = linear(True), linear(False), linear(False)  # a and b share a pool buffer
    va, vb = lean.lean_view(a), lean.lean_view(b)
    va.value(a.weight, True, fresh_tensor=False)
    use = lean._Use(va, a.weight, va.buffer.token)
    x = torch.zeros(16, device=dev)
    rows = [
        ("kept copy: compute_view", lambda: compute_view(kept, kept.weight)),
        ("lean: LeanView.value, copy made already", lambda: va.value(a.weight, True, fresh_tensor=False)),
        ("lean: _Use.refill, copy made already", use.refill),
        ("lean: _Use() (the node's note)", lambda: lean._Use(va, a.weight, va.buffer.token)),
        ("lean: _current (what proves a copy current)", lambda: lean._current(a.weight)),
        ("lean: _Buffer.free (storage use count)", va.buffer.free),
        ("lean: bound dequantize (Bound.__call__)", va.fill),
        ("lean: value of a and b in turn (a launch each)",
         lambda: (va.value(a.weight, True, fresh_tensor=False), vb.value(b.weight, True, fresh_tensor=False))),
        ("torch: x.add_(1) (a torch launch)", lambda: x.add_(1)),
        ("torch: tensor.untyped_storage()", lambda: x.untyped_storage()),
    ]
    print(f"| call ({dev.type}, torch {torch.__version__}, Python {sys.version.split()[0]}) | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call(fn, args.calls, warmup=200):.2f} |", flush=True)


if __name__ == "__main__":
    main()
