"""Step time of FSDP-style data parallelism at 8-64 ranks across nodes, bf16 against NVFP4 parameter gathers,
projected from measured per-collective bandwidths (a model, not a measurement: the numbers it starts from are).

    python bench/projection.py [--bus-gbps 2.9 25] [--ranks 8 16 32 64] [--grad-bytes 2]

Per rank and step (ZeRO-3 / FSDP2 with the weights resharded after the forward, so gathered twice; ring
collectives, whose per-rank traffic is (N-1)/N of the full tensor)::

    gather      2 x (N-1)/N x weight elements x bytes per element   (bf16: 2; NVFP4: 0.504 = 0.5 + 1/256 of scales)
    reduce      (N-1)/N x weight elements x gradient bytes             (FSDP2's bf16 reduce: 2; fp32: 4)
    time        bytes / bus bandwidth per rank  +  2 (N-1) x latency per collective call
    compute     measured: GPU busy time of one step (scaled by weight elements for other shapes, same tokens per
                rank: the same MFU assumed)
    step        without overlap: compute + gather + reduce
                with overlap (FSDP2's prefetch on its own streams): max(compute, gather + reduce) + one layer's
                gather (the first, which nothing hides)

What it starts from (bench/RESULTS.md, FSDP2): GPT 2048 x 8 (402.7M linear weight elements, 8192 tokens per
rank), 4 x H200, 2026-11-27: GPU busy 44 ms per step; NCCL over sockets at 2 ranks moved 1,536.8 MiB of bf16
gathers in 274.9 ms of all-gather kernel time and 768.4 MiB of gradients in 138.2 ms: 2.9 GB/s of bus bandwidth
per rank for both (the default `--bus-gbps`); at 2 ranks the model gives 435 ms (bf16) and 214 ms (NVFP4) for
the measured 410 and 216 ms (with overlap). 25 GB/s is a per-GPU share of a 200 Gb/s node link, an assumption, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4_dist.format import TILE  # noqa: E402
from fp4_dist.fsdp.wire import gathered_bytes  # noqa: E402

MEASURED_COMPUTE_MS = 44.0  # GPU busy per step, GPT 2048 x 8, 8192 tokens per rank, H200
MEASURED_ELEMENTS = 402.7e6  # its linear weight elements
SHAPES = {
    "GPT 2048 x 8": (402.7e6, 8),  # (linear weight elements, layers)
    "7B-class (4096 x 32)": (32 * 12 * 4096**2, 32),  # qkv 3h^2 + out h^2 + MLP 8h^2 per layer
}
# Bytes per weight element on the wire: the package's own rule for one 16 x 16 tile (packed codes + its scale byte).
GATHER_BYTES = {"bf16": 2.0, "nvfp4": gathered_bytes((TILE, TILE), "nvfp4") / TILE**2}


def step_ms(elements: float, layers: int, ranks: int, bus_gbps: float, variant: str, overlap: bool,
            grad_bytes: float, latency_us: float) -> float:  # fmt: skip
    share = (ranks - 1) / ranks
    gather = 2 * share * elements * GATHER_BYTES[variant] / (bus_gbps * 1e6)
    reduce = share * elements * grad_bytes / (bus_gbps * 1e6)
    calls = 3 * layers  # a gather in the forward and the backward, a reduce-scatter, per layer
    comm = gather + reduce + calls * 2 * (ranks - 1) * latency_us / 1e3
    compute = MEASURED_COMPUTE_MS * elements / MEASURED_ELEMENTS
    if not overlap:
        return compute + comm
    return max(compute, comm) + gather / (2 * layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bus-gbps", type=float, nargs="+", default=[2.9, 25.0],
                   help="bus bandwidth per rank across nodes, GB/s (2.9: measured, NCCL over sockets)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 16, 32, 64])
    p.add_argument("--grad-bytes", type=float, default=2.0, help="bytes per gradient element reduced (bf16: 2)")
    p.add_argument("--latency-us", type=float, default=20.0, help="per ring step of a collective call")
    args = p.parse_args()
    head = " | ".join(f"{n} ranks" for n in args.ranks)
    print(f"Projected step ms (gradients reduced at {args.grad_bytes:g} B/element, {args.latency_us:g} us per ring "
          f"step; compute {MEASURED_COMPUTE_MS:g} ms per 402.7M weight elements)\n")
    print(f"| shape | bus GB/s | gathers | overlap | {head} | NVFP4 / bf16 at {args.ranks[-1]} |")
    print("|---|---|---|---|" + "---|" * (len(args.ranks) + 1))
    for shape, (elements, layers) in SHAPES.items():
        for bw in args.bus_gbps:
            for overlap in (True, False):
                times = {v: [step_ms(elements, layers, n, bw, v, overlap, args.grad_bytes, args.latency_us)
                             for n in args.ranks] for v in GATHER_BYTES}  # fmt: skip
                for v in GATHER_BYTES:
                    ratio = f"{times['nvfp4'][-1] / times['bf16'][-1]:.2f}" if v == "nvfp4" else ""
                    cells = " | ".join(f"{t:,.0f}" for t in times[v])
                    print(f"| {shape} | {bw:g} | {v} | {'yes' if overlap else 'no'} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
