"""Where lean compute's time goes at the widths users train, and whether copies that never leave the L2 cache win
it back: one linear layer's forward, device time per call.

    PYTHONPATH=. python bench/lean_l2.py [--tokens 2048] [--chunk-mib 4 8 16] [--out DIR]

Lean compute (`compute_copy=False`) writes a weight's whole bf16 copy before its GEMM reads it: 2.5 bytes per
element through device memory on top of bf16's GEMM, once per use (forward and backward of every microbatch).
With 2,048 tokens per microbatch that is about 14% of a forward GEMM's time on an H100. Variants, per weight
shape of a GPT 4096 layer (tensor-parallel size 2) and 4096 tokens' worth of data rotated so nothing is cached
between calls:

    bf16            F.linear(x, W) with a bf16 weight: the floor
    lean            dequantize W into one buffer [N, K], then F.linear on it (today's lean, one use)
    dequant alone   that dequantize launch without the GEMM
    chunk N MiB     W's rows in chunks of N MiB of bf16: each dequantized into one of two ring buffers and
                    multiplied straight away into its columns of the output (torch.mm(out=...)); a chunk small
                    enough to stay in the L2 cache is read by its GEMM from there, and a ring slot overwritten
                    while still cached is never written back to device memory
    max |diff|      of the chunked output against lean's (0: the chunked GEMMs computed the same bits)

Prints a table; the question it answers: can a per-use copy cost (nearly) nothing, so that weights can hold less
memory than bf16 at bf16's step time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fp4_dist
from fp4_dist import kernels
from timing import median_ms, publish, require_gpu  # noqa: E402 - bench/timing.py, beside this script

SHAPES = {"qkv": (6144, 4096), "proj": (4096, 2048), "fc1": (8192, 4096), "fc2": (4096, 8192)}
"""[out_features, in_features] of a GPT 4096 layer's linears at tensor-parallel size 2 (GQA-free, ffn 16384)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0, 8.0, 16.0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    require_gpu("bench/lean_l2.py", "a linear layer's forward with per-use copies")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    totals: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        q = fp4_dist.quantize(w)
        wb = q.dequantize().to(torch.bfloat16)
        xs = [torch.randn(args.tokens, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        buf = torch.empty(n, k, device=dev, dtype=torch.bfloat16)
        fill = kernels.bind_dequantize([q.rowwise_data], [q.rowwise_scale_inv], [q.amax], [buf])
        it = {"i": 0}

        def x():
            it["i"] += 1
            return xs[it["i"] % len(xs)]

        variants = {"bf16": lambda: F.linear(x(), wb), "lean": lambda: (fill(), F.linear(x(), buf)),
                    "dequant alone": fill}  # fmt: skip
        out = torch.empty(args.tokens, n, device=dev, dtype=torch.bfloat16)
        for mib in args.chunk_mib:
            rows_per = max(128, int(mib * 2**20 / (2 * k)) // 128 * 128)
            if rows_per >= n:
                continue
            ring = [torch.empty(rows_per, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            chunks = []
            for j, r0 in enumerate(range(0, n, rows_per)):
                r1 = min(n, r0 + rows_per)
                slot = ring[j % 2][: r1 - r0]
                bound = kernels.bind_dequantize([q.rowwise_data[r0:r1]], [q.rowwise_scale_inv[r0:r1]], [q.amax],
                                                [slot])  # fmt: skip
                chunks.append((bound, slot, r0, r1))

            def chunked(chunks=chunks):
                xi = x()
                for bound, slot, r0, r1 in chunks:
                    bound()
                    torch.mm(xi, slot.t(), out=out[:, r0:r1])
                return out

            variants[f"chunk {mib:g} MiB ({rows_per} rows)"] = chunked
        for fn in variants.values():  # warm-up: plans, cuBLAS handles, allocator
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        ref = F.linear(xs[0], buf)
        for label, fn in variants.items():
            ms = median_ms(fn, args.reps)
            totals[label.split(" (")[0]] = totals.get(label.split(" (")[0], 0.0) + ms
            diff = ""
            if label.startswith("chunk"):
                it["i"] = -1  # the next x() is xs[0]
                got = fn()
                diff = f"{(got.float() - ref.float()).abs().max().item():.3g}"
            rows.append((name, f"[{n}, {k}]", label, f"{ms:.3f}", diff))
    base = totals["bf16"]
    lines = [f"tokens {args.tokens}, device {torch.cuda.get_device_name()}", "",
             "| weight | shape | variant | ms | max abs diff vs lean |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    lines += ["", "| variant | sum over the layer's four weights, ms | / bf16 |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {v / base:.3f} |" for k, v in totals.items()]
    publish("\n".join(lines), args.out, "lean_l2", {"rows": rows, "totals": totals})


if __name__ == "__main__":
    main()
