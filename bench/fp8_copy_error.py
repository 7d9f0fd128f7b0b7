"""How close the FP8 block copy of an NVFP4 weight is to it: the fraction of elements the copy holds exactly and the
error it adds against NVFP4's own, on random weights or on trained ones from a safetensors file. Runs on CPU.

    python bench/fp8_copy_error.py [--safetensors FILE [--max-weights 8]] [--size 1024] [--out DIR]

Per weight W (bf16): NVFP4 = quantize(W); its FP8 block copy (`fp4_dist.kernels.fp8_block_reference`: E4M3 values,
one scale per 128 x 128 block, the NVFP4 global factor times sig/8 * 2^k, sig chosen per block for the least
squared error); the same with powers of two only (sig = 8); for context, W quantized straight to E4M3 with one
scale per 128 x 128 block (block amax / 448: TransformerEngine's Float8BlockScaling for weights with fp32 scales;
its default rounds the scales to powers of two).
Columns:

    exact          elements the copy holds exactly (equal to NVFP4's value within an fp32 ulp)
    added          RMS(copy - NVFP4) / RMS(NVFP4 - W): the copy's error against the one NVFP4 itself makes
    powers of two  `exact` and `added` with sig = 8 in every block
    copy / nvfp4   RMS(copy - W) / RMS(NVFP4 - W): the total error of what the FP8 GEMM reads, against bf16's GEMM
                   on the NVFP4 values
    fp8 direct     RMS(E4M3 block quantization of W - W) / RMS(NVFP4 - W)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4_dist  # noqa: E402
from fp4_dist.kernels import reference  # noqa: E402
from fp4_dist.kernels.fp8_block_reference import block_view, fp8_block_copy, fp8_block_values, per_element  # noqa: E402
from fp4_dist.testing import random_weight  # noqa: E402
from timing import publish  # noqa: E402 - bench/timing.py, beside this script


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64)


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def fp8_direct(w: torch.Tensor) -> torch.Tensor:
    """W quantized straight to E4M3, one scale (block amax / 448) per 128 x 128 block."""
    m, k = w.shape
    scale = block_view(w.double(), m, k).abs().amax(dim=-1) / 448
    scale = per_element(torch.where(scale > 0, scale, torch.ones_like(scale)), m, k)
    return _e4m3(w.double() / scale) * scale


def measure(name: str, w: torch.Tensor) -> tuple:
    w = w.to(torch.bfloat16).float()
    q = fp4_dist.quantize(w)
    nvfp4 = reference.dequantize(q.rowwise_data, q.rowwise_scale_inv, q.amax).double()
    own = _rms(nvfp4 - w.double())
    chosen, powers = (fp8_block_values(*fp8_block_copy(q.rowwise_data, q.rowwise_scale_inv, q.amax,
                                                       significands=sigs)).double()
                      for sigs in (range(8, 16), (8,)))  # fmt: skip
    row = [name, f"{list(w.shape)}"]
    for copy in (chosen, powers):
        exact = float(((copy - nvfp4).abs() <= nvfp4.abs() * 2.0**-22).double().mean())
        row += [f"{100 * exact:.1f}%", f"{_rms(copy - nvfp4) / own:.3f}"]
    return (*row, f"{_rms(chosen - w.double()) / own:.3f}", f"{_rms(fp8_direct(w) - w.double()) / own:.3f}")


def weights(args) -> list[tuple[str, torch.Tensor]]:
    if args.safetensors:
        from safetensors.torch import load_file

        found = [(n, t) for n, t in load_file(args.safetensors).items()
                 if t.dim() == 2 and t.is_floating_point() and t.shape[1] % 16 == 0]  # fmt: skip
        return found[: args.max_weights]
    g = torch.Generator().manual_seed(0)
    n = args.size
    return [("gaussian", torch.randn(n, n, generator=g)),
            ("tiles of mixed magnitude", random_weight(n, n, generator=g)),
            ("heavy-tailed", random_weight(n, n + n // 2, heavy_tailed=True, generator=g))]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--safetensors", default=None, help="take the 2D float weights of this file (K %% 16 == 0)")
    p.add_argument("--max-weights", type=int, default=8)
    p.add_argument("--size", type=int, default=1024, help="random weights: [size, size] and [size, 1.5 size]")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [measure(name, w) for name, w in weights(args)]
    lines = ["| weight | shape | exact | added | powers of two: exact | added | copy / nvfp4 | fp8 direct |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    publish("\n".join(lines), args.out, "fp8_copy_error", {"rows": rows})


if __name__ == "__main__":
    main()
