"""The FP8 block copy of an NVFP4 weight (`fp4_dist.kernels.fp8_block_reference`) against an oracle in exact
rational arithmetic: every element's NVFP4 value as a Fraction, the block exponent by search, and E4M3 rounding by
nearest of all 255 finite E4M3 values (ties to the even code)."""

from __future__ import annotations

import bisect
from fractions import Fraction

import pytest
import torch

import fp4_dist
from fp4_dist.format import E2M1_VALUES, FP8_BLOCK
from fp4_dist.kernels import reference
from fp4_dist.kernels.fp8_block_reference import fp8_block_copy, fp8_block_values
from fp4_dist.testing import extreme_nvfp4_bytes, random_weight


def _e4m3(code: int) -> Fraction:
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    value = Fraction(mantissa, 8) * Fraction(2) ** -6 if exponent == 0 else \
        (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)  # fmt: skip
    return -value if code & 0x80 else value


_VALUES = [_e4m3(c) for c in range(0x7F)]  # increasing with the code; 0x7F is NaN in E4M3 (fn)


def _round_e4m3(x: Fraction) -> int:
    """E4M3 code nearest to |x| <= 448 (ties to the even code), with x's sign."""
    hi = bisect.bisect_left(_VALUES, abs(x))
    if hi < len(_VALUES) and _VALUES[hi] == abs(x):
        best = hi
    else:
        lo = hi - 1
        below, above = abs(x) - _VALUES[lo], _VALUES[hi] - abs(x)
        best = lo if below < above or (below == above and lo % 2 == 0) else hi
    return best | (0x80 if x < 0 else 0)


def _tree_sum(xs: list) -> float:
    while len(xs) > 1:
        half = len(xs) // 2
        xs = [a + b for a, b in zip(xs[:half], xs[half:])]
    return xs[0]


def _oracle(w: torch.Tensor):
    """(NVFP4 weight, per block (significand, k), E4M3 bits): each block's scale sig/8 * 2^k (times G) is the one of
    least squared error against the NVFP4 values (squares rounded to fp64 and summed in the module's fixed order,
    ties to the smaller sig), k the smallest with the block's largest value under 448 * sig/8 * 2^k."""
    q = fp4_dist.quantize(w)
    m, k = w.shape
    codes = reference.unpack_nibbles(q.rowwise_data).tolist()
    scales = q.rowwise_scale_inv.tolist()
    value = [[(-1 if c & 8 else 1) * Fraction(E2M1_VALUES[c & 7]) * _e4m3(scales[r][j // 16])
              for j, c in enumerate(row)] for r, row in enumerate(codes)]  # fmt: skip
    negative = [[bool(c & 8) for c in row] for row in codes]
    bm, bk = -(-m // FP8_BLOCK), -(-k // FP8_BLOCK)
    chosen, bits = [[None] * bk for _ in range(bm)], [[0] * k for _ in range(m)]
    for i in range(bm):
        for j in range(bk):
            cells = [(r, c) for r in range(i * 128, i * 128 + 128) for c in range(j * 128, j * 128 + 128)]
            inside = [(r, c) for r, c in cells if r < m and c < k]
            top = max(abs(value[r][c]) for r, c in inside)
            best = None
            for sig in range(8, 16):
                shift = 0
                if top > 0:
                    shift = -40
                    while top > 448 * Fraction(sig, 8) * Fraction(2) ** shift:
                        shift += 1
                unit = Fraction(sig, 8) * Fraction(2) ** shift
                codes_here = {(r, c): _round_e4m3(value[r][c] / unit) for r, c in inside}
                squares = [float(_e4m3(codes_here[rc]) * unit - value[rc[0]][rc[1]]) ** 2 if rc in codes_here else 0.0
                           for rc in cells]  # fmt: skip
                sse = _tree_sum(squares)
                if best is None or sse < best[0]:
                    best = (sse, sig, shift, codes_here)
            chosen[i][j] = best[1:3]
            for (r, c), code in best[3].items():
                bits[r][c] = (code & 0x7F) | (0x80 if negative[r][c] else 0)
    return q, chosen, torch.tensor(bits, dtype=torch.uint8)


@pytest.mark.parametrize("m,k,heavy", [(144, 272, False), (129, 48, True), (17, 400, True), (128, 256, False)])
def test_the_copy_equals_exact_rational_arithmetic(m, k, heavy):
    w = random_weight(m, k, heavy_tailed=heavy, generator=torch.Generator().manual_seed(m * k))
    q, chosen, want = _oracle(w)
    bits, scales = fp8_block_copy(q.rowwise_data, q.rowwise_scale_inv, q.amax)
    assert bits.shape == (m, k) and scales.shape == (len(chosen), len(chosen[0])) and scales.dtype == torch.float32
    mismatch = (bits != want).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} E4M3 codes differ, first at {mismatch[0].tolist()}"
    g = q.amax.float() * (torch.ones(1) / torch.full((1,), 2688.0))
    want_scales = torch.tensor([[(g * sig).item() * 2.0 ** (shift - 3) for sig, shift in row] for row in chosen])
    assert torch.equal(scales, want_scales)
    if m * k > 128 * 256:  # six blocks: the choice of significand shows
        assert len({sig for row in chosen for sig, _ in row}) > 1, f"one significand everywhere: {chosen}"


def test_the_copy_is_within_e4m3_rounding_of_the_nvfp4_values_and_exact_where_e4m3_holds_them():
    w = random_weight(384, 512, heavy_tailed=True, generator=torch.Generator().manual_seed(3))
    q = fp4_dist.quantize(w)
    bits, scales = fp8_block_copy(q.rowwise_data, q.rowwise_scale_inv, q.amax)
    got = fp8_block_values(bits, scales).double()
    nvfp4 = reference.dequantize(q.rowwise_data, q.rowwise_scale_inv, q.amax).double()
    normal = got.abs() >= scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1) * 2.0**-6
    rel = ((got - nvfp4).abs() / nvfp4.abs())[normal]
    assert rel.max() <= 2.0**-4 + 2.0**-20  # E4M3's half step, plus the fp32 ulps of the two value formulas
    exact = (got - nvfp4).abs() <= nvfp4.abs() * 2.0**-22
    assert exact.float().mean() > 0.5, "most NVFP4 products fit E4M3's 4 significant bits"
    assert (bits.view(torch.float8_e4m3fn).float().abs() <= 448).all()


def test_the_copy_of_the_transpose_is_the_transposed_copy():
    w = random_weight(272, 400, generator=torch.Generator().manual_seed(5))
    a, b = fp4_dist.quantize(w), fp4_dist.quantize(w.t().contiguous())
    bits, scales = fp8_block_copy(a.rowwise_data, a.rowwise_scale_inv, a.amax)
    bits_t, scales_t = fp8_block_copy(b.rowwise_data, b.rowwise_scale_inv, b.amax)
    assert torch.equal(bits_t, bits.t()) and torch.equal(scales_t, scales.t())


def test_zero_weights_and_the_compact_tile_grid():
    zero = fp4_dist.quantize(torch.zeros(130, 32))
    bits, scales = fp8_block_copy(zero.rowwise_data, zero.rowwise_scale_inv, zero.amax)
    assert not bits.any() and not scales.any()
    w = random_weight(130, 160, generator=torch.Generator().manual_seed(7))
    q = fp4_dist.quantize(w)
    grid = q.rowwise_scale_inv[0:130:16, :10].contiguous()
    for got, want in zip(fp8_block_copy(q.rowwise_data, grid, q.amax),
                         fp8_block_copy(q.rowwise_data, q.rowwise_scale_inv, q.amax)):  # fmt: skip
        assert torch.equal(got, want)


def test_an_fp32_division_gives_the_codes_of_the_fp64_one_for_every_element_and_scale():
    # The CUDA copy divides in fp32 where the reference divides in fp64 and rounds to fp32 (cuda/fp8_block.cu):
    # every element value P * 2^X against every significand and every shift that keeps the quotient in E4M3's range.
    twice_q, significand = torch.tensor([1, 2, 3, 4, 6, 8, 12]), torch.arange(16)
    p = torch.unique(twice_q[:, None] * significand[None, :])
    v = (p[:, None].double() * torch.pow(2.0, torch.arange(-10, 5).double())[None, :]).reshape(-1)
    for sig in range(8, 16):
        for shift in range(-22, 12):
            scaled = v * 2.0 ** (3 - shift)
            fp64 = (scaled / sig).float()
            fp32 = scaled.float() / torch.tensor(float(sig))
            in_range = fp64 <= 448.0
            assert torch.equal(fp32[in_range].view(torch.int32), fp64[in_range].view(torch.int32)), (sig, shift)


@pytest.mark.parametrize("seed", range(4))
def test_a_blocks_squared_errors_sum_exactly_in_fp64_so_any_order_gives_the_reference_sum(seed):
    # The CUDA copy sums squared errors in another order than tree_sum (cuda/fp8_block.cu): the same total only
    # because every partial sum is exact. Checked here against exact rational sums, on blocks of extreme spread.
    from fp4_dist.kernels.fp8_block_reference import (block_view, element_integers, pow2, smallest_shift,
                                                      tree_sum)  # fmt: skip
    from fp4_dist.kernels.reference import e4m3_rne_satfinite

    data, tiles = extreme_nvfp4_bytes(seed)
    m, k = data.shape[0], data.shape[1] * 2
    p, x, _ = element_integers(data, tiles, m, k)
    value = p.double() * pow2(x).double()
    top = block_view(value, m, k).amax(dim=-1)
    for sig in range(8, 16):
        shift = smallest_shift(top, sig)
        unit = pow2(shift.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1) - 3).double()
        bits = e4m3_rne_satfinite(((value / unit) / sig).float())
        err = bits.view(torch.float8_e4m3fn).double() * sig * unit - value
        sq = block_view(err * err, m, k)
        for b, got in zip(sq.reshape(-1, FP8_BLOCK * FP8_BLOCK), tree_sum(sq).reshape(-1)):
            exact = sum((Fraction(v) for v in b.tolist()), Fraction(0))
            assert Fraction(got.item()) == exact and Fraction(b.flip(0).cumsum(0)[-1].item()) == exact, sig
