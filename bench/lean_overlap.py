"""Whether lean compute's per-use copies can be made while the layer before computes: a layer stack's GEMMs
(forward, then dgrad and wgrad in reverse), device time per pass, with the copies made in line or ahead on a
side stream.

    PYTHONPATH=. python bench/lean_overlap.py [--model gpt4096-tp2 gpt4096 gpt2048] [--tokens 2048 8192] [--out DIR]

Variants, per model (the four linears of a GPT layer, `--layers` of them; tokens as the Megatron benches use):

    bf16            the GEMMs with bf16 weights: the floor
    in line         lean compute today: each layer's copies made by one dequantize launch just before its GEMMs
                    (a use that follows the same layer's use finds them made: the last layer's backward)
    ahead           the same launches on a second stream, one layer ahead: two buffer sets, the copy of the next
                    layer is written while this layer's GEMMs run; CUDA events order them (no host wait)
    ahead, low      the same with the side stream at low priority (the GEMMs' blocks go first)
    dequant alone   the in-line launches without the GEMMs, and their bandwidth (read packed + write bf16)

The numbers answer: what part of lean's copy traffic can hide under the GEMMs of the layer before.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch

import fp4_dist
from fp4_dist import kernels
from timing import median_ms, publish, require_gpu  # noqa: E402 - bench/timing.py, beside this script

MODELS = {  # [out, in] of a GPT layer's qkv, proj, fc1, fc2; tokens per microbatch of the Megatron bench
    "gpt4096-tp2": ([(6144, 4096), (4096, 2048), (8192, 4096), (4096, 8192)], 2048),
    "gpt4096": ([(12288, 4096), (4096, 4096), (16384, 4096), (4096, 16384)], 2048),
    "gpt2048": ([(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)], 4096),
    "llama-tp2": ([(3072, 4096), (4096, 2048), (11008, 4096), (4096, 5504)], 2048),  # GQA 8 groups, SwiGLU 11008
}


def run_model(name: str, layers: int, reps: int, tokens: Optional[int] = None) -> list:
    shapes, default_tokens = MODELS[name]
    tokens = tokens or default_tokens
    dev = torch.device("cuda")
    packed, bf16 = [], []
    for _ in range(layers):
        qs = [fp4_dist.quantize(torch.randn(n, k, device=dev)) for n, k in shapes]
        packed.append(qs)
        bf16.append([q.dequantize().to(torch.bfloat16) for q in qs])
    sets = [[torch.empty(n, k, device=dev, dtype=torch.bfloat16) for n, k in shapes] for _ in range(2)]

    def bind(i: int, s: int):
        qs = packed[i]
        return kernels.bind_dequantize([q.rowwise_data for q in qs], [q.rowwise_scale_inv for q in qs],
                                       [q.amax for q in qs], sets[s])  # fmt: skip

    xs = [torch.randn(tokens, k, device=dev, dtype=torch.bfloat16) for n, k in shapes]
    dys = [torch.randn(tokens, n, device=dev, dtype=torch.bfloat16) for n, k in shapes]
    order = list(range(layers)) + list(reversed(range(layers)))  # uses: forward, then backward
    fresh = [j == 0 or order[j - 1] != i for j, i in enumerate(order)]  # a use whose copy is not made already
    fills = {(i, s): bind(i, s) for i in range(layers) for s in (0, 1)}

    def gemms(ws, backward: bool) -> None:
        for w, x, dy in zip(ws, xs, dys):
            if backward:
                torch.mm(dy, w)  # dgrad
                torch.mm(dy.t(), x)  # wgrad
            else:
                torch.mm(x, w.t())

    def floor():
        for j, i in enumerate(order):
            gemms(bf16[i], j >= layers)

    def in_line(with_gemms: bool = True):
        for j, i in enumerate(order):
            if fresh[j]:
                fills[(i, 0)]()
            if with_gemms:
                gemms(sets[0], j >= layers)

    def ahead(side: torch.cuda.Stream):
        main = torch.cuda.current_stream()
        slot = [0] * len(order)  # which buffer set use j reads
        filled, consumed = [None] * len(order), [None] * len(order)
        s = 0
        for j in range(len(order)):
            s ^= fresh[j] and j > 0
            slot[j] = s

        def issue(j: int) -> None:  # the copy of use j, on the side stream, after the set's last reader
            if not fresh[j]:
                filled[j] = filled[j - 1]
                return
            prev = max((u for u in range(j) if slot[u] == slot[j]), default=None)
            with torch.cuda.stream(side):
                if prev is not None:
                    side.wait_event(consumed[prev])
                fills[(order[j], slot[j])]()
                filled[j] = torch.cuda.Event()
                filled[j].record(side)

        def run():
            issue(0)
            for j in range(len(order)):
                if j + 1 < len(order):
                    issue(j + 1)
                main.wait_event(filled[j])
                gemms(sets[slot[j]], j >= layers)
                consumed[j] = torch.cuda.Event()
                consumed[j].record(main)
        return run

    lo = torch.cuda.Stream.priority_range()[0]  # (0, -n): a lower number is a higher priority
    variants = {"bf16": floor, "in line": in_line, "ahead": ahead(torch.cuda.Stream()),
                "ahead, low": ahead(torch.cuda.Stream(priority=lo)),
                "dequant alone": lambda: in_line(with_gemms=False)}  # fmt: skip
    times = {label: median_ms(fn, reps) for label, fn in variants.items()}
    fills_per_pass = sum(fresh)
    elems = sum(n * k for n, k in shapes)
    gbps = fills_per_pass * elems * (2 + 0.5 + 1 / 16) / (times["dequant alone"] * 1e-3) / 1e9
    base = times["bf16"]
    return [(name, str(tokens), label, f"{ms:.3f}",
             f"{gbps:.0f} GB/s" if label == "dequant alone" else f"{ms / base:.3f}") for label, ms in times.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--tokens", type=int, nargs="+", default=[None],
                   help="tokens per microbatch (default: the Megatron bench's for the model)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    require_gpu("bench/lean_overlap.py", "a layer stack's GEMMs with lean copies made in line or ahead")
    torch.manual_seed(0)
    rows = []
    for name in args.model:
        for tokens in args.tokens:
            rows += run_model(name, args.layers, args.reps, tokens)
            torch.cuda.empty_cache()
    lines = [f"{args.layers} layers, forward + backward GEMMs, device {torch.cuda.get_device_name()}", "",
             "| model | tokens | variant | ms per pass | / bf16 |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    publish("\n".join(lines), args.out, "lean_overlap", {"rows": rows})


if __name__ == "__main__":
    main()
