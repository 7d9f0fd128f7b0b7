"""The nvfp4 compute mode (TransformerEngine's NVFP4 recipe, emulated) on one GPU, against bf16: its quantization
kernels' bandwidth and a whole linear layer's forward + backward.

    PYTHONPATH=. python bench/nvfp4_linear.py [--cases 2048x4096x4096,8192x11008x4096] [--out DIR]

A case is T x N x K: T tokens, a weight of N out x K in features.

    quantize  each 1 x 16 quantization the layer makes: x [T, K] rows (to nearest), dy [T, N] rows (stochastic),
              and the wgrad operands RHT(x^T), RHT(dy^T) read in place (amax launch + quantize launch), and the
              unscaled bf16 values the GEMM reads (one launch); GB/s of the bytes each must move (the amax pass
              reads its input once more) against the device copy bandwidth
    layer     nn.Linear in bf16 against NVFP4Linear in the nvfp4 mode (the recipe's defaults: stochastic rounding,
              RHT), forward + backward with the weight gradient, device ms and host ms per call

Device time: CUDA events, median of --reps runs after warm-ups. sm_80 to sm_90 (the mode's check refuses others).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4_dist  # noqa: E402
from fp4_dist.compute import nvfp4, nvfp4_gemm  # noqa: E402
from fp4_dist.kernels import nvfp4_1d  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench/timing.py, beside this script
from timing import bandwidth, copy_bandwidth, host_ms, median_ms, publish, require_gpu  # noqa: E402


def _quant_bytes(rows: int, cols: int, passes: int) -> int:
    """Bytes a 1 x 16 quantization of a bf16 [rows, cols] must move: bf16 in (`passes` times: the amax pass reads
    it too), codes and E4M3 scales out."""
    return passes * rows * cols * 2 + rows * cols // 2 + rows * cols // 16


def kernel_rows(t: int, n: int, k: int, reps: int, copy_gbs: float) -> list[dict]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    xq = nvfp4_1d.quantize_rows_1x16(x)
    cases = [("x [T, K] rows, to nearest", lambda: nvfp4_1d.quantize_rows_1x16(x), _quant_bytes(t, k, 2)),
             ("dy [T, N] rows, stochastic", lambda: nvfp4_1d.quantize_rows_1x16_sr(dy, 1), _quant_bytes(t, n, 2)),
             ("RHT(x^T), to nearest (wgrad)", lambda: nvfp4_1d.quantize_cols_1x16(x, True), _quant_bytes(k, t, 2)),
             ("RHT(dy^T), stochastic (wgrad)", lambda: nvfp4_1d.quantize_cols_1x16_sr(dy, True, 1),
              _quant_bytes(n, t, 2)),
             ("unscaled bf16 values of x", lambda: nvfp4_1d.unscaled_values(xq), t * k // 2 + t * k // 16 + 2 * t * k),
             ]  # fmt: skip
    return [dict(case=f"{t}x{n}x{k}", kernel=name, **bandwidth(fn, nbytes, reps, copy_gbs))
            for name, fn, nbytes in cases]


def layer_rows(t: int, n: int, k: int, reps: int) -> list[dict]:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp4 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    fp4.load_state_dict(bf16.state_dict())
    fp4_dist.convert_linear_weights(fp4, compute="nvfp4", options=nvfp4.Nvfp4Recipe(bf16_first=0, bf16_last=0))

    def step(layer):
        return lambda: layer(x).backward(dy)

    out = []
    for name, fn in (("bf16 nn.Linear", step(bf16)), ("nvfp4 recipe (SR, RHT)", step(fp4))):
        device_ms, host = median_ms(fn, reps), host_ms(fn, reps)
        out.append(dict(case=f"{t}x{n}x{k}", layer=name, ms=device_ms, host_ms=host,
                        tflops=3 * 2.0 * t * n * k / device_ms / 1e9))  # fmt: skip
        x.grad = None
    base = out[0]["ms"]
    for r in out:
        r["ratio"] = r["ms"] / base
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="2048x4096x4096,8192x4096x4096,8192x11008x4096,8192x4096x11008",
                   help="T x N x K (tokens x out x in features), comma separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    require_gpu("bench/nvfp4_linear.py", "the nvfp4 compute mode's kernels and layer")
    why = nvfp4_gemm.check_device(torch.device("cuda"))
    if why is not None:
        raise SystemExit(f"bench/nvfp4_linear.py: {why}")
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    kernels, layers = [], []
    for case in args.cases.split(","):
        t, n, k = (int(v) for v in case.split("x"))
        kernels += kernel_rows(t, n, k, args.reps, copy_gbs)
        layers += layer_rows(t, n, k, args.reps)
        torch.cuda.empty_cache()
    lines = [f"device: {name}; device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             "| T x N x K | kernel | ms | GB/s | % of copy BW |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['case']} | {r['kernel']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% |"
              for r in kernels]  # fmt: skip
    lines += ["", "| T x N x K | layer forward + backward | device ms | / bf16 | TFLOP/s | host ms |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['case']} | {r['layer']} | {r['ms']:.3f} | {r['ratio']:.2f} | {r['tflops']:.0f} | "
              f"{r['host_ms']:.3f} |" for r in layers]  # fmt: skip
    publish("\n".join(lines), args.out, "nvfp4_linear",
            dict(device=name, copy_gbs=copy_gbs, kernels=kernels, layers=layers))


if __name__ == "__main__":
    main()
