"""Benchmark of the CUDA stage kernels against the byte floor (spec section 5) and the measured copy bandwidth.

    PYTHONPATH=. python bench/kernels.py [--max-log2 30] [--out DIR]

Per stage and size (one [N/4096, 4096] weight, 2^20 .. 2^30 elements, fp32 master, whole tensor owned):
device time (CUDA events, median, L2 flushed before each run), GB/s of the minimal bytes, and % of the
device-to-device copy bandwidth measured in the same run (bytes read + written). Then, for a list of 1,000
weights of mixed shapes: kernel launches per stage, host time per call (plan cached; the cuda_ops layer and the
public fp4_dist.kernels API, which adds the argument checks), and device time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fp4_dist.kernels as K
from fp4_dist.format import columnwise_data_shape, columnwise_scale_shape, rowwise_scale_shape
from fp4_dist.kernels import _launch, cuda_ops

DEV = torch.device("cuda")


def timed(fn, reps: int, flush: torch.Tensor | None) -> float:
    """Median device milliseconds of fn() over `reps` runs (after 3 warm-ups); L2 flushed before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 20, None)
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def stage_runs(numel: int):
    """(name, fn, minimal bytes) of every stage for one [numel / 4096, 4096] weight."""
    m, k = numel // 4096, 4096
    shapes = [(m, k)]
    master = torch.randn(numel, device=DEV)
    amax_buf = torch.empty(K.amax_layout(shapes).total, device=DEV)
    si = torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)
    ao = torch.empty(1, device=DEV)
    data = torch.empty(m, k // 2, dtype=torch.uint8, device=DEV)
    cols = torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV)
    csi = torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)
    cuda_ops.partial_amax([master], [0], shapes, out=amax_buf)
    enc = cuda_ops.fused_scale(amax_buf, shapes, [si], [ao])
    tiles = numel // 256
    return [
        ("partial_amax", lambda: cuda_ops.partial_amax([master], [0], shapes, out=amax_buf), 4 * numel + 4 * tiles),
        ("fused_scale", lambda: cuda_ops.fused_scale(amax_buf, shapes, [si], [ao]), si.numel() + 8 * tiles),
        ("partial_cast", lambda: cuda_ops.partial_cast([master], [0], shapes, enc, [data.view(-1)]),
         4 * numel + numel // 2 + 4 * tiles),
        ("nibble_transpose", lambda: cuda_ops.nibble_transpose([data], [cols]), numel),
        ("scale_transpose", lambda: cuda_ops.scale_transpose([si], [csi], shapes), csi.numel() + tiles),
    ]  # fmt: skip


def size_table(max_log2: int, copy_gbs: float, reps: int) -> list[dict]:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    rows = []
    for log2 in range(20, max_log2 + 1, 2):
        for name, fn, nbytes in stage_runs(1 << log2):
            ms = timed(fn, reps, flush)
            gbs = nbytes / ms / 1e6
            rows.append(dict(stage=name, log2=log2, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs))
        torch.cuda.empty_cache()
    return rows


class Counter:
    def __init__(self):
        self.calls = 0
        self._real = _launch._launch

    def __enter__(self):
        def counting(*args):
            self.calls += 1
            return self._real(*args)

        _launch._launch = counting
        return self

    def __exit__(self, *exc):
        _launch._launch = self._real


def many_weights(count: int, reps: int) -> list[dict]:
    """Launches, host time and device time per stage for `count` weights of mixed shapes in one call."""
    g = torch.Generator().manual_seed(0)
    shapes = [(int(m), int(k)) for m, k in zip(torch.randint(1, 17, (count,), generator=g) * 32,
                                                torch.randint(1, 17, (count,), generator=g) * 64)]  # fmt: skip
    masters = [torch.randn(m * k, device=DEV) for m, k in shapes]
    starts = [0] * count
    si = [torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV) for m, k in shapes]
    ao = [torch.empty(1, device=DEV) for _ in shapes]
    data = [torch.empty(m, k // 2, dtype=torch.uint8, device=DEV) for m, k in shapes]
    frags = [d.view(-1) for d in data]
    cols = [torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV) for m, k in shapes]
    csi = [torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV) for m, k in shapes]
    amax = torch.empty(K.amax_layout(shapes).total, device=DEV)
    enc = cuda_ops.fused_scale(cuda_ops.partial_amax(masters, starts, shapes, out=amax), shapes, si, ao)
    stages = {
        "partial_amax": (lambda m: m.partial_amax(masters, starts, shapes, out=amax)),
        "fused_scale": (lambda m: m.fused_scale(amax, shapes, si, ao)),
        "partial_cast": (lambda m: m.partial_cast(masters, starts, shapes, enc, frags)),
        "nibble_transpose": (lambda m: m.nibble_transpose(data, cols)),
        "scale_transpose": (lambda m: m.scale_transpose(si, csi, shapes)),
    }
    rows = []
    for name, call in stages.items():
        host = {}
        for label, mod in (("cuda_ops", cuda_ops), ("api", K)):
            call(mod)  # builds and caches the plan
            torch.cuda.synchronize()
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call(mod)
                samples.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            host[label] = 1e3 * statistics.median(samples)
        with Counter() as c:
            call(cuda_ops)
        ms = timed(lambda: call(cuda_ops), reps, None)
        rows.append(dict(stage=name, weights=count, launches=c.calls, host_ms_cuda_ops=host["cuda_ops"],
                         host_ms_api=host["api"], device_ms=ms))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-log2", type=int, default=30)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--weights", type=int, default=1000)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    sizes = size_table(args.max_log2, copy_gbs, args.reps)
    many = many_weights(args.weights, args.reps)
    lines = [f"device: {name}; device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             "| stage | elements | time (us) | GB/s (minimal bytes) | % of copy BW |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['stage']} | 2^{r['log2']} | {1e3 * r['ms']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% |" for r in sizes]
    lines += ["", f"{args.weights} weights of mixed shapes in one call:", "",
              "| stage | launches | host ms (cuda_ops) | host ms (fp4_dist.kernels API) | device ms |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['stage']} | {r['launches']} | {r['host_ms_cuda_ops']:.3f} | {r['host_ms_api']:.3f} | {r['device_ms']:.3f} |"
              for r in many]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_kernels.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
            json.dump(dict(device=name, copy_gbs=copy_gbs, sizes=sizes, many=many), f, indent=1)


if __name__ == "__main__":
    main()
