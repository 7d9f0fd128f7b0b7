"""The FP8 block copy of an NVFP4 weight in plain PyTorch: its CPU path and the oracle of a kernel to come.

Hopper has FP8 tensor cores with block scaling (`torch.nn.functional.scaled_mm`, one fp32 scale per 128 x 128 block
of the weight) and no FP4 ones. The copy is made from the NVFP4 bytes, never from the masters, so it holds the
NVFP4 weight's values wherever E4M3 can, by integer math and fixed-order fp64 sums that any device reproduces bit
for bit:

    NVFP4 element   q * s_t * G        q in {0, +-0.5, ..., +-6}, s_t its tile's E4M3 scale, G = A * fp32(1/2688)
    as integers     +-P * 2^X * G      P = 2|q| * S <= 180, S = s_t's 4-bit significand (8-15 normal, 0-7
                                       subnormal), X = max(s_t's exponent field, 1) - 11
    block scale     b = G * sig/8 * 2^k   for each sig in 8..15, k is the smallest integer with the block's largest
                                       P * 2^X <= 448 * sig/8 * 2^k; the sig whose copy has the least squared error
                                       against the NVFP4 values wins (ties: the smaller sig)
    element         e = E4M3(+-P * 2^X / (sig/8 * 2^k))   round to nearest even
    scale (fp32)    (G * sig) * 2^(k-3)

Why a choice of significands: a product q * s_t needs up to 6 significant bits (1.5 * 1.875 = 2.8125 = 10.1101b)
and E4M3 holds 4, so a power-of-two scale rounds every element whose P has more; a scale of 1.5 * 2^k holds those
with a factor 3 exactly instead, 1.25 * 2^k those with a factor 5, and so on. A block's error is dominated by its
largest elements, which one of the eight usually holds exactly (`bench/fp8_copy_error.py`: 0.3-0.8x a power of
two's added error on random weights).

Determinism: the quotient P * 2^X / (sig/8 * 2^k) is either exact (a dyadic value of a few bits) or at least 2^-12
(relative) away from every E4M3 rounding tie, so rounding it on the way to fp64 or fp32 (at most 2^-24 relative)
never moves it across one: its E4M3 rounding is the correctly rounded value on any device that divides with
IEEE rounding (this reference: fp64, then fp32). The errors are exact in fp64, their squares rounded once, and each
block's sum is `tree_sum`'s fixed order. The sign of the NVFP4 code is kept (a negative zero code gives E4M3's 0x80).
128 x 128 blocks are symmetric, as the 16 x 16 tiles are: the copy of the transposed weight is the transposed copy
with the transposed scales, so one copy serves a GEMM with W and one with W^T.
"""

from __future__ import annotations

import torch

from ..format import FP8_BLOCK, GLOBAL_SCALE_NUMERATOR, TILE, ceil_div, is_tile_grid, tile_grid
from .reference import e4m3_rne_satfinite, expand_rowwise_scales, unpack_nibbles

_TWICE_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12)  # 2 * |q| by code & 7: integers


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2^exponent, exactly, for integer exponents in fp32's normal range [-126, 127] (built from the bits:
    no library exp2 or ldexp, whose rounding a kernel could not be sure to share)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def element_integers(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, m: int, k: int):
    """(P, X, negative): each element of the NVFP4 weight as +-P * 2^X * G (int64 [M, K] each, negative bool)."""
    if is_tile_grid(rowwise_scale_inv.shape, m, k):
        rowwise_scale_inv = expand_rowwise_scales(rowwise_scale_inv, m, k)
    codes = unpack_nibbles(rowwise_data).to(torch.int64)
    twice_q = torch.tensor(_TWICE_E2M1, dtype=torch.int64, device=codes.device)[codes & 0x7]
    s = rowwise_scale_inv[:m, : tile_grid(m, k)[1]].to(torch.int64).repeat_interleave(TILE, dim=1)[:, :k]
    field, mantissa = (s >> 3) & 0xF, s & 0x7
    significand = torch.where(field > 0, mantissa + 8, mantissa)
    return twice_q * significand, torch.clamp(field, min=1) - 11, (codes & 0x8) != 0


def block_view(x: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """[M, K] -> [bm, bk, 128 * 128], zero padded: each block's elements in row-major order."""
    bm, bk = ceil_div(m, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    padded = x.new_zeros(bm * FP8_BLOCK, bk * FP8_BLOCK)
    padded[:m, :k] = x
    return padded.view(bm, FP8_BLOCK, bk, FP8_BLOCK).permute(0, 2, 1, 3).reshape(bm, bk, FP8_BLOCK * FP8_BLOCK)


def per_element(per_block: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """[bm, bk] per-block values -> [M, K], each element its block's."""
    return per_block.repeat_interleave(FP8_BLOCK, dim=0)[:m].repeat_interleave(FP8_BLOCK, dim=1)[:, :k]


def smallest_shift(top: torch.Tensor, sig: int = 8) -> torch.Tensor:
    """int64, shape of `top` (non-negative, fp32 or fp64): the smallest k with top <= 448 * sig/8 * 2^k, 0 where top
    is 0. frexp's exponent - 10 is one or two below it; the compares are exact (small integers times powers of two)."""
    _, ex = torch.frexp(top)
    shift = ex.to(torch.int64) - 10
    for _ in range(2):
        shift = torch.where(top * 8 > 448.0 * sig * pow2(shift).to(top.dtype), shift + 1, shift)
    return torch.where(top > 0, shift, torch.zeros_like(shift))


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (a power of two long) in a fixed order: halves added elementwise, the first half
    to the second, until one is left (a kernel's shared-memory reduction adds in this order too)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def fp8_block_copy(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, amax: torch.Tensor, *,
                   significands=range(8, 16)):  # fmt: skip
    """The FP8 block copy of an NVFP4 weight [M, K] (module docstring): (E4M3 bits, uint8 [M, K]; block scales,
    fp32 [ceil(M/128), ceil(K/128)]), so that value[r, c] = float(e[r, c]) * scales[r // 128, c // 128].

    `rowwise_scale_inv` is the row-expanded form or the compact tile grid, as for `reference.dequantize`.
    `significands`: the scale significands (sig / 8) to choose from; ``(8,)``: powers of two only (for comparison).
    """
    m, k = rowwise_data.shape[0], rowwise_data.shape[1] * 2
    p, x, negative = element_integers(rowwise_data, rowwise_scale_inv, m, k)
    value = p.to(torch.float64) * pow2(x).to(torch.float64)  # P * 2^X exactly (G units)
    top = block_view(value, m, k).amax(dim=-1)
    best = None
    for sig in significands:  # the block scale's significand: sig / 8
        shift = smallest_shift(top, sig)
        unit = pow2(per_element(shift, m, k) - 3).to(torch.float64)  # 2^(k-3): the scale is sig * 2^(k-3)
        # (P * 2^X) / (sig * 2^(k-3)), through fp64 and fp32, then E4M3: the quotient is exact or 2^-12 away from
        # every E4M3 tie, so those roundings leave the E4M3 value the correctly rounded one (module docstring)
        bits = e4m3_rne_satfinite(((value / unit) / sig).to(torch.float32))
        err = bits.view(torch.float8_e4m3fn).to(torch.float64) * sig * unit - value  # exact in fp64
        sse = tree_sum(block_view(err * err, m, k))
        if best is None:
            best = [sse, torch.full_like(shift, sig), shift, bits]
            continue
        better = sse < best[0]  # ties keep the smaller significand (a power of two first)
        best[0] = torch.where(better, sse, best[0])
        best[1] = torch.where(better, sig, best[1])
        best[2] = torch.where(better, shift, best[2])
        best[3] = torch.where(per_element(better, m, k), bits, best[3])
    _, sig, shift, bits = best
    a = amax.reshape(1).to(torch.float32)
    g = a * (torch.ones_like(a) / torch.full_like(a, GLOBAL_SCALE_NUMERATOR))
    scales = (g * sig.to(torch.float32)) * pow2(shift - 3)
    return bits | (negative.to(torch.uint8) << 7), scales


def fp8_block_values(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [M, K] values of an FP8 block copy: float(e) * its block's scale."""
    m, k = bits.shape
    return bits.view(torch.float8_e4m3fn).to(torch.float32) * per_element(scales, m, k)
