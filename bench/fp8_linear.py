"""The FP8 compute mode's parts on one Hopper GPU, against bf16: GEMMs, quantization kernels, the weight copy, and a
whole linear layer's forward + backward.

    PYTHONPATH=. python bench/fp8_linear.py [--tokens 8192] [--shapes 4096x4096,11008x4096,4096x11008] [--out DIR]

Per weight shape N x K (out x in features) and T tokens:

    GEMMs        fprop x @ W^T, dgrad dy @ W, wgrad dy^T @ x: torch.matmul in bf16 against `fp8_gemm.cublas_mm` on
                 operands already quantized (the dgrad's includes the transpose of the weight copy it makes)
    quantize     the 1 x 128 kernel on x [T, K] (rows) and on x^T (the wgrad's, read through strides): GB/s of
                 the bytes it must move (bf16 in, E4M3 and scales out) against the device copy bandwidth
    weight copy  the CUDA FP8 block copy of the NVFP4 weight (once per optimizer step)
    layer        nn.Linear bf16 against NVFP4Linear in the FP8 mode (copy kept: several microbatches per step;
                 copy remade: one), forward + backward with the weight gradient, device ms and host ms per call

Device time: CUDA events, median of --reps runs after warm-ups. Hopper only (the FP8 block GEMMs are sm_90's).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4_dist  # noqa: E402
from fp4_dist.compute import fp8_copy  # noqa: E402
from fp4_dist.compute.fp8_gemm import Fp8Operand, cublas_mm, require_fp8_gemm  # noqa: E402
from fp4_dist.kernels import fp8_block, fp8_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench/timing.py, beside this script
from timing import bandwidth, copy_bandwidth, host_ms, median_ms, publish, require_gpu  # noqa: E402


def gemm_rows(t: int, n: int, k: int, reps: int) -> list[dict]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    fp4_dist.convert_linear_weights(lin, compute="fp8")
    wop = Fp8Operand.weight(lin.weight)
    xq, dyq = Fp8Operand.rows(x), Fp8Operand.rows(dy)
    xtq, dytq = Fp8Operand.rows(x.t()), Fp8Operand.rows(dy.t())
    flops = 2.0 * t * n * k
    cases = [("fprop", lambda: x @ w.t(), lambda: cublas_mm(xq, wop, torch.bfloat16)),
             ("dgrad", lambda: dy @ w, lambda: cublas_mm(dyq, wop.t(), torch.bfloat16)),
             ("wgrad", lambda: dy.t() @ x, lambda: cublas_mm(dytq, xtq, torch.float32))]
    out = []
    for name, bf16, fp8 in cases:
        b, f = median_ms(bf16, reps), median_ms(fp8, reps)
        out.append(dict(shape=f"{n}x{k}", gemm=name, bf16_ms=b, fp8_ms=f, bf16_tflops=flops / b / 1e9,
                        fp8_tflops=flops / f / 1e9, speedup=b / f))  # fmt: skip
    return out


def kernel_rows(t: int, n: int, k: int, reps: int, copy_gbs: float) -> list[dict]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp4_dist.convert_linear_weights(lin, compute="fp8")
    w = lin.weight
    wop = Fp8Operand.weight(w)
    quant_bytes = t * k * (2 + 1) + t * (k // 128) * 4  # bf16 in, E4M3 out, scales out
    copy_bytes = n * k // 2 + w.rowwise_scale_inv.numel() + n * k + (n // 128) * (k // 128) * 4
    cases = [("quantize x [T, K] rows", lambda: fp8_rows.quantize_rows_1x128(x), quant_bytes),
             ("quantize x^T (the wgrad's)", lambda: fp8_rows.quantize_rows_1x128(x.t()), quant_bytes),
             ("quantize x^T, any-strides kernel", lambda: fp8_rows.LAUNCHERS["strided"](x.t(), *fp8_rows_out(x.t())),
              quant_bytes),
             ("quantize x both ways, one read (the layer's)", lambda: fp8_rows.quantize_both(x),
              quant_bytes + t * k + t * (k // 128) * 4),
             ("weight copy [N, K]", lambda: fp8_block.fp8_block_copy(w.rowwise_data, w.rowwise_scale_inv, w.amax),
              copy_bytes),
             ("its transpose (the dgrad's)", lambda: fp8_block.transposed_bytes(wop.bits), 2 * n * k)]  # fmt: skip
    return [dict(shape=f"{n}x{k}", kernel=name, **bandwidth(fn, nbytes, reps, copy_gbs))
            for name, fn, nbytes in cases]


def fp8_rows_out(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    return torch.empty(rows, cols, dtype=torch.uint8, device=x.device), fp8_rows.scales_buffer(rows, cols, x.device)


def layer_rows(t: int, n: int, k: int, reps: int) -> list[dict]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8.load_state_dict(bf16.state_dict())
    fp4_dist.convert_linear_weights(fp8, compute="fp8")

    def step(layer, remake=False):
        def run():
            if remake:
                fp8_copy.forget(layer)  # as after an optimizer step: the next use makes the copy again
            layer(x).backward(dy)
        return run

    out = []
    for name, fn in (("bf16 nn.Linear", step(bf16)), ("fp8, copy kept", step(fp8)),
                     ("fp8, copy remade", step(fp8, remake=True))):  # fmt: skip
        device_ms, host = median_ms(fn, reps), host_ms(fn, reps)
        out.append(dict(shape=f"{n}x{k}", layer=name, ms=device_ms, host_ms=host))
        x.grad = None
    base = out[0]["ms"]
    for r in out:
        r["ratio"] = r["ms"] / base
    return out


def profile_host(t: int, n: int, k: int, reps: int) -> None:
    """Where the FP8 layer's host time goes: cProfile of `reps` forward + backward calls (copy kept)."""
    import cProfile
    import pstats

    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    layer = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp4_dist.convert_linear_weights(layer, compute="fp8")
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        layer(x).backward(dy)
    prof.disable()
    torch.cuda.synchronize()
    print(f"FP8 layer {n}x{k}, {t} tokens: host per forward + backward, {reps} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008", help="N x K (out x in), comma separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--profile-host", action="store_true",
                   help="instead: cProfile of the FP8 layer's forward + backward (copy kept), by own time")
    args = p.parse_args()
    require_gpu("bench/fp8_linear.py", "the FP8 compute mode's GEMMs and kernels")
    require_fp8_gemm("cuda")
    if args.profile_host:
        profile_host(args.tokens, *[int(v) for v in args.shapes.split(",")[0].split("x")], args.reps)
        return
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gemms, kernels, layers = [], [], []
    for n, k in shapes:
        gemms += gemm_rows(args.tokens, n, k, args.reps)
        kernels += kernel_rows(args.tokens, n, k, args.reps, copy_gbs)
        layers += layer_rows(args.tokens, n, k, args.reps)
    lines = [f"device: {name}; {args.tokens} tokens; device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             "| weight N x K | GEMM | bf16 ms | FP8 ms | bf16 TFLOP/s | FP8 TFLOP/s | FP8 speed-up |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['shape']} | {r['gemm']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['bf16_tflops']:.0f} | "
              f"{r['fp8_tflops']:.0f} | {r['speedup']:.2f}x |" for r in gemms]  # fmt: skip
    lines += ["", "| weight N x K | kernel | ms | GB/s | % of copy BW |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['kernel']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% |"
              for r in kernels]  # fmt: skip
    lines += ["", "| weight N x K | layer forward + backward | device ms | / bf16 | host ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['layer']} | {r['ms']:.3f} | {r['ratio']:.3f} | {r['host_ms']:.3f} |"
              for r in layers]  # fmt: skip
    publish("\n".join(lines), args.out, "fp8_linear",
            dict(device=name, tokens=args.tokens, copy_gbs=copy_gbs, gemms=gemms, kernels=kernels, layers=layers))


if __name__ == "__main__":
    main()
