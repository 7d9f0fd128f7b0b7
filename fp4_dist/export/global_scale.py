"""The exported global scale: the one number per weight that lets compressed-tensors decode our bytes as we do.

fp4_dist decodes an element as ``code * ((float(s) * A) * fp32(1/2688))`` (spec section 3); compressed-tensors'
NVFP4 decompressor as ``code * fp32(float(s) / g)``, rounded to bf16, where ``g`` is the stored
``weight_global_scale``. Codes, tile scales ``s`` and the amax ``A`` are exported unchanged, so ``g`` is the only
choice. Its natural value ``2688 / A`` (the encode scale, as compressed-tensors computes it) gives each factor
``float(s) / g`` within an ulp or two of ours, not always equal.

A decode depends only on (code, scale byte, g, A), and there are 7 non-zero code magnitudes and 126 positive
finite E4M3 scales, so 882 products decide a weight completely: `choose_global_scale` tries the fp32 values
around ``2688 / A`` and keeps the first that makes all 882 agree (fp32 factors equal: any output dtype; else
every product rounded to bf16 equal: compressed-tensors' bf16 decode). Where none does, it keeps the one with
the fewest differing products and the caller counts the elements that differ, each by one bf16 ulp at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format import E2M1_VALUES, GLOBAL_SCALE_NUMERATOR, TILE
from ..kernels.reference import unpack_nibbles

SEARCH_ULPS = 64
"""fp32 neighbours of 2688 / A tried on each side."""

_SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)  # 0x01..0x7E
_CODES = torch.tensor(E2M1_VALUES[1:], dtype=torch.float32)  # 0.5 .. 6
_INV = torch.ones(1) / torch.full((1,), GLOBAL_SCALE_NUMERATOR)  # fp32(1/2688), as the spec's dequantize has it


@dataclass(frozen=True)
class GlobalScale:
    """The exported ``weight_global_scale`` of one amax and how exactly it reproduces our decode."""

    value: float
    """fp32 value to store."""
    exact: str
    """"fp32": every factor float(s) / g equals ours (any output dtype); "bf16": every product rounds to the same
    bf16; "approx": `mismatched` (code, scale) products differ by one bf16 ulp."""
    mismatched: int = 0


def _ours(scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Our decode factor (float(s) * A) * fp32(1/2688) of each scale value."""
    return (scales * amax) * _INV


def _around_2688_over(x: float) -> torch.Tensor:
    """The finite positive fp32 values within `SEARCH_ULPS` of fp32(2688 / x), nearest first: the candidates for g
    given A, and for A given g."""
    center = torch.full((1,), GLOBAL_SCALE_NUMERATOR) / torch.tensor([x], dtype=torch.float32)
    bits = int(center.view(torch.int32))
    steps = sorted(range(-SEARCH_ULPS, SEARCH_ULPS + 1), key=abs)
    return torch.tensor([bits + d for d in steps if 0 < bits + d < 0x7F800000], dtype=torch.int32).view(torch.float32)


def choose_global_scale(amax: float) -> GlobalScale:
    """The stored global scale for a weight whose fp32 amax is `amax` (deterministic in `amax`, so weights that
    share one amax get one global scale, as vLLM's fused layers need)."""
    if not amax > 0:  # every tile scale is 0: every decode is a signed zero whatever g is
        return GlobalScale(1.0, "fp32")
    ours, gs = _ours(_SCALES, torch.tensor([amax], dtype=torch.float32)), _around_2688_over(amax)
    theirs = _SCALES[None, :] / gs[:, None]  # [candidates, scales]
    same_factor = (theirs == ours[None, :]).all(dim=1)
    if bool(same_factor.any()):
        return GlobalScale(float(gs[int(same_factor.nonzero()[0])]), "fp32")
    ours_bf16 = (_CODES[:, None] * ours[None, :]).to(torch.bfloat16)  # [codes, scales]
    theirs_bf16 = (_CODES[None, :, None] * theirs[:, None, :]).to(torch.bfloat16)
    differ = (theirs_bf16 != ours_bf16[None]).sum(dim=(1, 2))
    best = int(torch.argmin(differ))  # the first minimum: the nearest candidate to 2688 / A
    n = int(differ[best])
    return GlobalScale(float(gs[best]), "bf16" if n == 0 else "approx", n)


def ct_decode(codes_packed: torch.Tensor, scales_e4m3: torch.Tensor, global_scale: float) -> torch.Tensor:
    """compressed-tensors' NVFP4 decode (`code * fp32(scale / g)`, fp32) of packed bytes [M, K/2] and 1x16 scales
    [M, K/16], written out here so an export can count its differences without importing compressed-tensors."""
    codes = unpack_nibbles(codes_packed).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = table[codes & 0x7] * torch.where((codes & 0x8) != 0, -1.0, 1.0)
    factor = scales_e4m3.to(torch.float32) / torch.tensor([global_scale], dtype=torch.float32)
    return values * factor.repeat_interleave(TILE, dim=1)


def amax_for_global_scale(global_scale: float, scale_bytes: torch.Tensor) -> tuple[float, int]:
    """An fp32 amax A for a checkpoint that stores only g (another writer): the value near 2688 / g under which our
    decode factor (s * A) * fp32(1/2688) equals compressed-tensors' fp32(s / g) for the most of the scale bytes
    present (uint8). Returns (A, number of those scale values whose factors still differ)."""
    present = torch.unique(scale_bytes.reshape(-1))
    present = present[(present != 0) & (present != 0x80)]
    if not global_scale > 0 or present.numel() == 0:
        return 0.0, 0
    s = present.view(torch.float8_e4m3fn).to(torch.float32).abs()
    theirs = s / torch.tensor([global_scale], dtype=torch.float32)
    cands = _around_2688_over(global_scale)
    ours = _ours(s[None, :], cands[:, None])
    differ = (ours != theirs[None, :]).sum(dim=1)
    best = int(torch.argmin(differ))
    return float(cands[best]), int(differ[best])
