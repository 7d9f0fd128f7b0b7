"""Benchmark of the CUDA stage kernels against the byte floor (spec section 5) and the measured copy bandwidth.

    PYTHONPATH=. python bench/kernels.py [--max-log2 30] [--variants] [--out DIR]

Per stage and size (one [N/4096, 4096] weight, 2^20 .. 2^30 elements, fp32 master, whole tensor owned; the
dequantize stage writes the bf16 compute copy, 0.5 + 2 + 1/16 bytes per element):
device time (CUDA events, median, L2 flushed before each run), GB/s of the minimal bytes, and % of the
device-to-device copy bandwidth measured in the same run (bytes read + written). Then, for a list of 1,000
weights of mixed shapes: kernel launches per stage, host time per call (the call form, plan cached, and the
bound form), and device time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import fp4_dist.kernels as K
from fp4_dist.format import columnwise_data_shape, columnwise_scale_shape, rowwise_scale_shape
from fp4_dist.kernels import _launch
from timing import copy_bandwidth, median_ms, publish, require_gpu  # noqa: E402 - bench/timing.py, beside this script

DEV = torch.device("cuda")


def timed(fn, reps: int, flush: torch.Tensor | None) -> float:
    """Median device milliseconds of fn() over `reps` runs (after 3 warm-ups); L2 flushed before each."""
    return median_ms(fn, reps, before=None if flush is None else flush.zero_)


def same_size_copy_gbs(nbytes: int, reps: int, flush: torch.Tensor) -> float:
    """GB/s of a device copy moving `nbytes` in all (read + write), timed like the stages (L2 flushed first).

    The big 1 GiB copy is the ceiling; this one says how much of a stage's shortfall at small sizes any single
    launch of that size shares (ramp-up, tail, the flush's write-backs).
    """
    src = torch.empty(max(nbytes // 2, 16), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps, flush)
    return 2 * src.numel() / ms / 1e6


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
    K.partial_amax([master], [0], shapes, out=amax_buf)
    enc = K.fused_scale(amax_buf, shapes, [si], [ao])
    K.partial_cast([master], [0], shapes, enc, [data.view(-1)])
    values = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
    tiles = numel // 256
    return [
        ("partial_amax", lambda: K.partial_amax([master], [0], shapes, out=amax_buf), 4 * numel + 4 * tiles),
        ("fused_scale", lambda: K.fused_scale(amax_buf, shapes, [si], [ao]), si.numel() + 8 * tiles),
        ("partial_cast", lambda: K.partial_cast([master], [0], shapes, enc, [data.view(-1)]),
         4 * numel + numel // 2 + 4 * tiles),
        ("nibble_transpose", lambda: K.nibble_transpose([data], [cols]), numel),
        ("scale_transpose", lambda: K.scale_transpose([si], [csi], shapes), csi.numel() + tiles),
        ("dequantize (bf16)", lambda: K.dequantize([data], [si], [ao], [values]),
         numel // 2 + 2 * numel + numel // 16),
    ]  # fmt: skip


def variant_runs(numel: int):
    """(name, fn, minimal bytes) of the launch variants tried for partial_cast and nibble_transpose: the grid
    (resident blocks looping over units, or one block per unit) and the transpose unit shape."""
    from fp4_dist.kernels import cuda_plans

    m, k = numel // 4096, 4096
    shapes = [(m, k)]
    master = torch.randn(numel, device=DEV)
    enc = torch.ones(numel // 256, device=DEV)
    data = torch.empty(m, k // 2, dtype=torch.uint8, device=DEV)
    cols = torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV)
    cast = cuda_plans.cast_plan(0, [master], [0], shapes, [data.view(-1)])
    runs = []
    for grid in ("resident", "units"):
        for e2m1 in _launch._E2M1:
            def run_cast(grid=grid, e2m1=e2m1):
                _launch.GRID["partial_cast"] = grid
                _launch.launch_partial_cast(cast, torch.bfloat16, enc, e2m1)
                _launch.GRID["partial_cast"] = "resident"

            runs.append((f"partial_cast [{e2m1}, grid {grid}]", run_cast, 4 * numel + numel // 2 + 4 * (numel // 256)))
        for tile in cuda_plans.NIBBLE_TILES:
            plan = cuda_plans.nibble_plan(0, [data], [cols], tile=tile)

            def run_t(plan=plan, tile=tile, grid=grid):
                _launch.GRID["nibble_transpose"] = grid
                _launch.launch_nibble_transpose(plan)
                _launch.GRID["nibble_transpose"] = "resident"

            runs.append((f"nibble_transpose [{tile}, grid {grid}]", run_t, numel))
        si = torch.full(rowwise_scale_shape(m, k), 0x38, dtype=torch.uint8, device=DEV)
        amax = torch.ones(1, device=DEV)
        values = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
        dq = cuda_plans.dequant_plan(0, [data], [si], [amax], [values])

        def run_d(plan=dq, grid=grid):
            _launch.GRID["dequantize"] = grid
            _launch.launch_dequantize(plan)
            _launch.GRID["dequantize"] = "units"

        runs.append((f"dequantize [grid {grid}]", run_d, numel // 2 + 2 * numel + numel // 16))
    return runs


def size_table(max_log2: int, copy_gbs: float, reps: int, variants: bool = False) -> list[dict]:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    rows = []
    for log2 in range(20, max_log2 + 1, 2):
        runs = stage_runs(1 << log2) if not variants else (variant_runs(1 << log2) if log2 >= 24 else [])
        for name, fn, nbytes in runs:
            ms = timed(fn, reps, flush)
            gbs = nbytes / ms / 1e6
            same = same_size_copy_gbs(nbytes, reps, flush)
            rows.append(dict(stage=name, log2=log2, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                             pct_same_copy=100 * gbs / same))
        torch.cuda.empty_cache()
    return rows


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
    enc = K.fused_scale(K.partial_amax(masters, starts, shapes, out=amax), shapes, si, ao)
    values = [torch.empty(m, k, dtype=torch.bfloat16, device=DEV) for m, k in shapes]
    stages = {
        "partial_amax": (lambda m: m.partial_amax(masters, starts, shapes, out=amax)),
        "fused_scale": (lambda m: m.fused_scale(amax, shapes, si, ao)),
        "partial_cast": (lambda m: m.partial_cast(masters, starts, shapes, enc, frags)),
        "nibble_transpose": (lambda m: m.nibble_transpose(data, cols)),
        "scale_transpose": (lambda m: m.scale_transpose(si, csi, shapes)),
        "dequantize": (lambda m: m.dequantize(data, si, ao, values)),
    }
    binds = {
        "partial_amax": K.bind_partial_amax(masters, starts, shapes, amax),
        "fused_scale": K.bind_fused_scale(amax, shapes, si, ao, torch.empty_like(enc)),
        "partial_cast": K.bind_partial_cast(masters, starts, shapes, enc, frags),
        "nibble_transpose": K.bind_nibble_transpose(data, cols),
        "scale_transpose": K.bind_scale_transpose(si, csi, shapes),
        "dequantize": K.bind_dequantize(data, si, ao, values),
    }
    rows = []
    for name, call in stages.items():
        variants = {"call": lambda: call(K), "bound": binds[name]}
        host = {}
        for label, fn in variants.items():
            fn()  # builds and caches the plan
            torch.cuda.synchronize()
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            host[label] = 1e3 * statistics.median(samples)
        with _launch.LaunchCounter() as c:
            call(K)
        ms = timed(lambda: call(K), reps, None)
        rows.append(dict(stage=name, weights=count, launches=c.calls, host_ms_call=host["call"],
                         host_ms_bound=host["bound"], device_ms=ms))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-log2", type=int, default=30)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--weights", type=int, default=1000)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--variants", action="store_true", help="also time the launch variants (grid, transpose unit)")
    args = p.parse_args()
    require_gpu("bench/kernels.py", "the CUDA kernels' device time and bandwidth")
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    sizes = size_table(args.max_log2, copy_gbs, args.reps)
    tried = size_table(args.max_log2, copy_gbs, args.reps, variants=True) if args.variants else []
    many = many_weights(args.weights, args.reps)
    lines = [f"device: {name}; device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             "| stage | elements | time (us) | GB/s (minimal bytes) | % of copy BW | % of a copy of the same bytes |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['stage']} | 2^{r['log2']} | {1e3 * r['ms']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% | "
              f"{r['pct_same_copy']:.0f}% |" for r in sizes]
    if tried:
        lines += ["", "Launch variants (bf16 rounding, enc = 1):", "", "| variant | elements | time (us) | % of copy BW |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['stage']} | 2^{r['log2']} | {1e3 * r['ms']:.1f} | {r['pct_copy']:.0f}% |" for r in tried]
    lines += ["", f"{args.weights} weights of mixed shapes in one call:", "",
              "| stage | launches | host ms (call form, plan cached) | host ms (bound form) | device ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['stage']} | {r['launches']} | {r['host_ms_call']:.3f} | {r['host_ms_bound']:.3f} | "
              f"{r['device_ms']:.3f} |" for r in many]  # fmt: skip
    publish("\n".join(lines), args.out, "bench_kernels",
            dict(device=name, copy_gbs=copy_gbs, sizes=sizes, variants=tried, many=many))


if __name__ == "__main__":
    main()
