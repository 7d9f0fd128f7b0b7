"""The NVFP4 recipe's emulated GEMMs and operand kernels, per device, and the one-time check of a device.

A block-scaled NVFP4 GEMM multiplies the operands' unscaled values u = e2m1(code) * float(E4M3 scale), adds in fp32
and applies alpha = (amax_a * amax_b) * fp32(1 / 2688^2) in its epilogue. Every such u has at most 6 significant bits
and lies in [2^-10, 2688], so it is exact in bf16 as well as fp32, and the product of two is exact in fp32:

    CPU    u in fp32 (`nvfp4_1d_reference`), one fp32 matmul
    CUDA   u in bf16 (`kernels.nvfp4_1d`, one launch per operand), torch.mm with an fp32 result (cuBLAS: exact
           products, fp32 accumulation)

then on both ``(sum * alpha + bias) -> out_dtype``, the same fp32 operations in the same order. The two differ only
in the order of the fp32 additions ("within accumulation order"). The native NVFP4 ``scaled_mm`` of sm_100 would
take the codes and scales as they are; it is not built, and such devices are refused until it has been run there.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from ..format import E2M1_VALUES
from ..kernels import nvfp4_1d_reference as q1d

__all__ = ["operand_kernels", "unscaled_values", "emulated_mm", "check_bf16_exact", "check_device"]


def operand_kernels(device: torch.device) -> ModuleType:
    """The module whose quantizers make the operands on `device`: the CUDA kernels (`kernels.nvfp4_1d`) on a GPU,
    the reference (`nvfp4_1d_reference`) elsewhere; both with the same functions and bits."""
    if device.type == "cuda":
        from ..kernels import nvfp4_1d

        return nvfp4_1d
    return q1d


def unscaled_values(q: q1d.Nvfp4Rows) -> torch.Tensor:
    """q's unscaled values as its device's GEMM reads them: fp32 on the CPU, bf16 on a GPU (the same numbers)."""
    return operand_kernels(q.data.device).unscaled_values(q)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b^T of unscaled values (exact products, fp32 sums)."""
    if a.is_cuda:
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return a @ b.t()


def emulated_mm(a: torch.Tensor, amax_a: torch.Tensor, b: torch.Tensor, amax_b: torch.Tensor, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The block-scaled NVFP4 GEMM a @ b^T from the operands' unscaled values (`unscaled_values`: [M, K] and [N, K])
    and amaxes: fp32 sums, then alpha, the bias (fp32) and one rounding to `out_dtype`."""
    y = _mm_fp32(a, b) * q1d.gemm_alpha(amax_a, amax_b)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


def check_bf16_exact() -> None:
    """Raise RuntimeError unless every e2m1 value times every finite E4M3 scale (8 magnitudes, both signs, x 127
    scales) is the same number in bf16 as in fp32: what lets the GPU's GEMM read bf16 operands without rounding."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    scales = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    products = torch.cat([mags, -mags])[:, None] * scales[None, :]
    inexact = products.to(torch.bfloat16).to(torch.float32) != products
    if inexact.any():
        i, j = inexact.nonzero()[0].tolist()
        raise RuntimeError(f"an NVFP4 unscaled value is not exact in bf16: {float(products[i, j])!r} (e2m1 "
                           f"{float(torch.cat([mags, -mags])[i])} x E4M3 {float(scales[j])}); the GPU GEMM cannot read "
                           "bf16 operands")  # fmt: skip


DEVICES: dict[torch.device, Optional[str]] = {}
"""Each GPU's one-time check (`check_device`): None where the mode runs there, else the refusal."""


def check_device(device: torch.device) -> Optional[str]:
    """None on the CPU and on CUDA GPUs sm_80 .. sm_90 where the kernels give the reference's bits (checked once per
    device, then a lookup); else the sentence that refuses the device."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return (f"the nvfp4 compute mode runs on the CPU and on CUDA GPUs of sm_80 to sm_90 (CuPy kernels), not on "
                f"{device}")  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in DEVICES:
        DEVICES[device] = _first_check(device)
    return DEVICES[device]


def _first_check(device: torch.device) -> Optional[str]:
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 10:
        return (f"{device} is sm_{major}{minor}: the nvfp4 compute mode's GPU path emulates the NVFP4 GEMM on "
                "Hopper-class GPUs (sm_80 to sm_90); on sm_100+ the native NVFP4 scaled_mm is the path to take, a "
                "later drop-in that has not been built or run on such a GPU, so the device is refused")  # fmt: skip
    if major < 8:
        return f"the nvfp4 compute mode's kernels need an sm_80 or newer GPU (bf16), {device} is sm_{major}{minor}"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "the nvfp4 compute mode's GPU kernels need CuPy (pip install '.[cuda]')"
    check_bf16_exact()
    return _disagreement(device)


def _disagreement(device: torch.device) -> Optional[str]:
    """None where the kernels give the reference's bits on a small ragged case (each quantizer, the unscaled values)
    and the fp32-result GEMM runs; else what differs."""
    from ..kernels import nvfp4_1d

    g = torch.Generator().manual_seed(66)
    t = (torch.randn(37, 24, generator=g) * torch.logspace(-3, 3, 24)).to(torch.bfloat16)
    cases = {
        "rows, to nearest": (q1d.quantize_rows_1x16(t), nvfp4_1d.quantize_rows_1x16),
        "rows, stochastic": (q1d.quantize_rows_1x16_sr(t, 5), lambda x: nvfp4_1d.quantize_rows_1x16_sr(x, 5)),
        "wgrad operand, transform, stochastic": (q1d.quantize_cols_1x16_sr(t, True, 6),
                                                 lambda x: nvfp4_1d.quantize_cols_1x16_sr(x, True, 6)),
    }  # fmt: skip
    tg = t.to(device)
    for name, (want, kernel) in cases.items():
        got = kernel(tg)
        if not (torch.equal(got.data.cpu(), want.data) and torch.equal(got.scales.cpu(), want.scales)
                and torch.equal(got.amax.cpu(), want.amax)):  # fmt: skip
            return f"the nvfp4 compute mode's CUDA quantizer ({name}) disagrees with its reference on {device}"
        u = nvfp4_1d.unscaled_values(got).cpu()
        if not torch.equal(u.float(), q1d.unscaled_values(want)):
            return f"the nvfp4 compute mode's CUDA unscaled values ({name}) disagree with the reference on {device}"
    try:
        a = nvfp4_1d.unscaled_values(nvfp4_1d.quantize_rows_1x16(tg))
        _mm_fp32(a, a)
    except (RuntimeError, TypeError) as e:
        return (f"the nvfp4 compute mode's GPU GEMM needs torch.mm(..., out_dtype=torch.float32) on bf16 (torch >= "
                f"2.8), which failed on {device} with torch {torch.__version__}: {e}")  # fmt: skip
    return None
