"""The FP8 compute mode's quantization and weight-copy kernels, variant by variant, on one GPU: GB/s against the
device's copy bandwidth and launches per call.

    PYTHONPATH=. python bench/fp8_kernels.py [--tokens 2048,4096,8192] [--cols 4096,11008]
                                             [--weights 4096x4096,4096x11008,11008x4096] [--out DIR]

    quantize both   `fp8_rows.quantize_both` of x [T, C] bf16 (1 x 128 along the rows and along the columns, one
                    read), each variant of `_launch.BOTH_1X128_VARIANTS`; bytes: x read once, both E4M3 copies and
                    their fp32 scales written
    weight copy     `fp8_block.fp8_block_operand` of an NVFP4 weight [N, K] (what a weight update makes: the FP8
                    copy, its transpose, both sets of cuBLAS block scales), each variant ("fused": one launch;
                    "split": the copy kernel, the byte transpose, torch copies); bytes: the packed codes and tile
                    scales read, both copies and the scales written

Launches: CUDA kernels the profiler sees in one call (torch's copies included). Device time: CUDA events, median of
--reps runs after warm-ups, outputs preallocated where the API takes them. The default variant of each is marked *.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4_dist  # noqa: E402
from fp4_dist.kernels import _launch, fp8_block, fp8_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import bandwidth, copy_bandwidth, publish, require_gpu  # noqa: E402 - bench/timing.py, beside this script


def kernel_launches(fn) -> int:
    """CUDA kernels one call of `fn` launches (after a warm-up call, so that compilation is not counted)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def row(what: str, shape: str, variant: str, default: str, fn, nbytes: int, reps: int, copy_gbs: float) -> dict:
    return dict(kernel=what, shape=shape, variant=variant + ("*" if variant == default else ""),
                **bandwidth(fn, nbytes, reps, copy_gbs), launches=kernel_launches(fn))  # fmt: skip


def quantize_rows(tokens: int, cols: int, reps: int, copy_gbs: float) -> list[dict]:
    x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
    bits, bits_t = torch.empty_like(x, dtype=torch.uint8), torch.empty(cols, tokens, dtype=torch.uint8, device="cuda")
    scales, scales_t = fp8_rows.scales_buffer(tokens, cols, "cuda"), fp8_rows.scales_buffer(cols, tokens, "cuda")
    groups = -(-cols // 128) * tokens + -(-tokens // 128) * cols
    nbytes = 2 * tokens * cols + 2 * tokens * cols + 4 * groups
    out = []
    for variant in _launch.BOTH_1X128_VARIANTS:
        def fn(v=variant):
            _launch.launch_both_1x128(x, bits, scales, bits_t, scales_t, variant=v)
        out.append(row("quantize both", f"{tokens}x{cols}", variant, _launch.BOTH_1X128, fn, nbytes, reps, copy_gbs))
    return out


def weight_rows(n: int, k: int, reps: int, copy_gbs: float) -> list[dict]:
    w = fp4_dist.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    fields = (w.rowwise_data, w.rowwise_scale_inv, w.amax)
    out_op = fp8_block.fp8_block_operand(*fields)
    bm, bk = -(-n // 128), -(-k // 128)
    nbytes = n * k // 2 + (n // 16) * (k // 16) + 2 * n * k + 4 * (2 * bm * bk + bm * (-(-bk // 4) * 4)
                                                                  + bk * (-(-bm // 4) * 4))  # fmt: skip
    out = []
    for variant in ("fused", "split"):
        def fn(v=variant):
            fp8_block.fp8_block_operand(*fields, out=out_op, variant=v)
        out.append(row("weight copy + transpose", f"{n}x{k}", variant, _launch.FP8_BLOCK_COPY, fn, nbytes, reps,
                       copy_gbs))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="2048,4096,8192")
    p.add_argument("--cols", default="4096,11008")
    p.add_argument("--weights", default="4096x4096,4096x11008,11008x4096", help="N x K, comma separated")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    require_gpu("bench/fp8_kernels.py", "the FP8 compute mode's CUDA kernels")
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        for c in (int(v) for v in args.cols.split(",")):
            rows += quantize_rows(t, c, args.reps, copy_gbs)
    for shape in args.weights.split(","):
        rows += weight_rows(*(int(v) for v in shape.split("x")), args.reps, copy_gbs)
    lines = [f"device: {name}; device-to-device copy: {copy_gbs:.0f} GB/s (read + write); * = default variant", "",
             "| kernel | shape | variant | ms | GB/s | % of copy BW | launches |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['shape']} | {r['variant']} | {r['ms']:.4f} | {r['gbs']:.0f} | "
              f"{r['pct_copy']:.0f}% | {r['launches']} |" for r in rows]  # fmt: skip
    publish("\n".join(lines), args.out, "fp8_kernels", dict(device=name, copy_gbs=copy_gbs, rows=rows))


if __name__ == "__main__":
    main()
