"""The 1 x 16 NVFP4 quantizers of activations and gradients (`fp4_dist.kernels.nvfp4_1d_reference`) against
TransformerEngine's own reference quantizer, bit for bit (golden/te_nvfp4_1d.pt, written by
golden/make_te_nvfp4_1d.py from TransformerEngine at the commit it names), and their stochastic rounding against
its definition and its statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4_dist.kernels import nvfp4_1d_reference as R
from fp4_dist.kernels.reference import unpack_nibbles
from fp4_dist.testing import assert_bytes_equal

GOLDEN = torch.load(Path(__file__).with_name("golden") / "te_nvfp4_1d.pt", weights_only=True)
CASES = GOLDEN["cases"]
RHT_CASES = [name for name, case in CASES.items() if "rht_values" in case]


def test_the_golden_data_names_its_transformer_engine_commit_and_covers_the_corners():
    assert GOLDEN["te_commit"] == "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
    scales = torch.cat([c["rowwise_scale"].reshape(-1) for c in CASES.values()])
    codes = torch.cat([unpack_nibbles(c["rowwise_data"]).reshape(-1) for c in CASES.values()])
    assert (scales == 0).any(), "no all-zero or underflowing block"
    assert ((scales > 0) & (scales < 8)).any(), "no E4M3 subnormal block scale"
    assert (scales == 0x7E).any(), "no block scale of 448 (the block holding the amax)"
    assert (codes == 0x8).any() and (codes == 0x7).any() and (codes == 0xF).any(), "no -0 or +-6 code"
    assert len(RHT_CASES) >= 5 and any(c["x"].shape[1] % 16 for c in CASES.values()), "no ragged case"


@pytest.mark.parametrize("name", list(CASES))
def test_round_to_nearest_1x16_equals_transformer_engine_bit_for_bit(name):
    case = CASES[name]
    q = R.quantize_rows_1x16(case["x"])
    assert q.data.shape == case["rowwise_data"].shape and q.scales.shape == case["rowwise_scale"].shape
    assert_bytes_equal(q.data, case["rowwise_data"], f"{name} codes")
    assert_bytes_equal(q.scales, case["rowwise_scale"], f"{name} E4M3 scales")
    assert_bytes_equal(q.amax.view(torch.uint8), case["rowwise_amax"].view(torch.uint8), f"{name} amax")


@pytest.mark.parametrize("name", RHT_CASES)
def test_hadamard_transform_then_1x16_equals_transformer_engine_bit_for_bit(name):
    case = CASES[name]
    transformed = R.rht_16(case["x"].t().contiguous())  # the wgrad operand: along x's rows (the tokens)
    assert transformed.dtype == case["rht_values"].dtype
    assert_bytes_equal(transformed.view(torch.uint8), case["rht_values"].view(torch.uint8), f"{name} transform")
    q = R.quantize_rows_1x16(transformed)
    assert_bytes_equal(q.data, case["rht_data"], f"{name} codes after the transform")
    assert_bytes_equal(q.scales, case["rht_scale"], f"{name} scales after the transform")
    assert_bytes_equal(q.amax.view(torch.uint8), case["rht_amax"].view(torch.uint8), f"{name} post-transform amax")


def test_the_hadamard_matrix_is_orthogonal_so_both_operands_transformed_keep_the_product():
    h = R.hadamard_16()
    assert torch.equal(h @ h.t(), torch.eye(16)) and set(h.abs().unique().tolist()) == {0.25}
    assert torch.equal(torch.sign(h[:, 0]), torch.tensor(R.RHT_SIGNS, dtype=torch.float32))
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    hd = torch.block_diag(*[h.double()] * 4)
    torch.testing.assert_close((a @ hd) @ (b @ hd).t(), a @ b.t(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="multiple of 16"):
        R.rht_16(torch.randn(4, 40))


GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_stochastic_rounding_rounds_up_with_probability_the_distance_to_the_lower_neighbour():
    # Every magnitude in [0, 6] whose offset from its lower neighbour is a multiple of step/256, with every one of
    # the 256 random bytes: each goes to one of its two neighbours, up exactly (a - lo) / step * 256 times, so the
    # mean over the bytes is a itself, exactly.
    a = torch.cat([lo + torch.arange(256, dtype=torch.float32) * (hi - lo) / 256 for lo, hi in zip(GRID, GRID[1:])])
    a = torch.cat([a, torch.tensor([6.0])])
    y = a.repeat_interleave(256)
    rbits = torch.arange(256, dtype=torch.int16).repeat(a.numel())
    q = R.stochastic_e2m1_codes(y, rbits)
    got = GRID[(q & 7).long()].view(-1, 256)
    lo = GRID[torch.bucketize(a, GRID, right=True) - 1]
    hi = GRID[torch.clamp(torch.bucketize(a, GRID, right=True), max=7)]
    assert ((got == lo[:, None]) | (got == hi[:, None])).all()
    assert torch.equal(got.mean(dim=1), a)
    neg = R.stochastic_e2m1_codes(-y, rbits)
    assert torch.equal(neg & 7, q & 7) and bool(((neg >> 3)[y > 0] == 1).all())


def test_stochastic_rounding_saturates_at_six_and_keeps_a_negative_zero_sign():
    y = torch.tensor([6.0, 7.5, 1e30, float("inf"), -float("inf"), float("nan"), -0.25, 0.0, -1e-9])
    for r in (0, 255):
        codes = R.stochastic_e2m1_codes(y, torch.full(y.shape, r, dtype=torch.int16))
        assert codes.tolist()[:6] == [7, 7, 7, 7, 15, 7] and codes[7] == 0
        assert codes[6] == (0x8 if r == 0 else 0x9)  # -0.25: to -0, or with the largest byte to -0.5
        assert codes[8] == 0x8  # within step/256 of zero: never up, with 8 random bits


def test_stochastic_rounding_is_reproducible_from_a_seed_and_keeps_round_to_nearest_scales():
    x = torch.randn(48, 80).to(torch.bfloat16)
    one = R.quantize_rows_1x16_sr(x, 7)
    again = R.quantize_rows_1x16_sr(x, 7)
    other = R.quantize_rows_1x16_sr(x, 8)
    rn = R.quantize_rows_1x16(x)
    assert torch.equal(one.data, again.data) and not torch.equal(one.data, other.data)
    assert torch.equal(one.scales, rn.scales) and torch.equal(one.amax, rn.amax) and one.data.shape == rn.data.shape


def test_stochastic_rounding_is_unbiased_and_its_mean_beats_round_to_nearest_as_transformer_engine_tests():
    # TransformerEngine's test_nvfp4_sr_quantize: the mean of many stochastically rounded copies is nearer x (RMSE)
    # than round to nearest, for the rows and for the transformed transpose; and the mean error is near zero.
    g = torch.Generator().manual_seed(12345)
    x = (torch.randn(128, 128, generator=g) * 2 - 1).to(torch.bfloat16)
    for operand in (x, R.rht_16(x.t().contiguous())):
        ref = operand.float()
        rn = R.values(R.quantize_rows_1x16(operand))
        mean = sum(R.values(R.quantize_rows_1x16_sr(operand, R.draw_seed(g))) for _ in range(32)) / 32
        rmse_rn, rmse_sr = (rn - ref).pow(2).mean().sqrt(), (mean - ref).pow(2).mean().sqrt()
        assert rmse_sr < 0.5 * rmse_rn, f"SR mean RMSE {rmse_sr:.3e} vs RN {rmse_rn:.3e}"
        one = R.values(R.quantize_rows_1x16_sr(operand, R.draw_seed(g)))
        assert abs(float((one - ref).mean())) < 0.05 * float((one - ref).abs().mean())


def test_unscaled_values_times_the_gemm_alpha_are_the_dequantized_values_to_an_ulp():
    x = torch.randn(32, 48).to(torch.bfloat16)
    q = R.quantize_rows_1x16(x)
    u = R.unscaled_values(q)
    assert torch.equal(u.double().float(), u)  # exact products: e2m1 x E4M3
    per_operand = q.amax / 2688.0
    torch.testing.assert_close(u * per_operand, R.values(q), rtol=2**-23, atol=0)


def test_the_random_bits_are_splitmix64_of_the_seed_and_the_element_index():
    # splitmix64's published first outputs of seed 0 (the int64 steps wrap as the CUDA kernel's uint64 do)
    z = R.splitmix64(0, torch.arange(3)).tolist()
    assert [v & (2**64 - 1) for v in z] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    seed = (1 << 63) - 12345  # near the top of the range: the sums wrap
    bits = R.stochastic_bits(seed, 40, 48)
    assert bits.dtype == torch.int16 and bits.min() >= 0 and bits.max() <= 255
    flat = torch.arange(40 * 48).view(40, 48)
    assert torch.equal(bits, (R.splitmix64(seed, flat) >> 56 & 0xFF).to(torch.int16))  # element i = r * cols + c
    assert torch.equal(R.stochastic_bits(seed, 80, 24).view(40, 48), bits)  # a pure function of (seed, i)
    with pytest.raises(ValueError, match="seed must be in"):
        R.stochastic_bits(-1, 2, 2)


def test_the_random_bytes_are_uniform_and_independent_across_seeds_and_neighbours():
    bits = R.stochastic_bits(2024, 512, 512).long().flatten()
    counts = torch.bincount(bits, minlength=256).double()
    expected = bits.numel() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 6 * (2 * 255) ** 0.5, chi2  # 255 degrees of freedom: mean 255, sd 22.6
    other = R.stochastic_bits(2025, 512, 512).long().flatten()
    for a, b in ((bits, other), (bits[:-1], bits[1:])):  # neighbouring seeds, neighbouring elements
        corr = torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1]
        assert abs(float(corr)) < 0.01, float(corr)


def test_a_seed_is_drawn_from_torchs_default_generator_on_the_host():
    torch.manual_seed(3)
    first = [R.draw_seed() for _ in range(3)]
    torch.manual_seed(3)
    assert [R.draw_seed() for _ in range(3)] == first and len(set(first)) == 3
    assert all(0 <= s < R.SEED_BOUND for s in first)
    assert R.draw_seed(torch.Generator().manual_seed(1)) == R.draw_seed(torch.Generator().manual_seed(1))


def test_a_wgrad_operand_is_the_padded_transpose_through_the_transform_then_1x16():
    t = torch.randn(37, 24).to(torch.bfloat16)  # 37 tokens: padded to 48
    for rht in (False, True):
        padded = torch.cat([t, torch.zeros(11, 24, dtype=t.dtype)]).t().contiguous()
        operand = R.rht_16(padded) if rht else padded
        assert torch.equal(R.transposed_operand(t, rht), operand)
        got, want = R.quantize_cols_1x16(t, rht), R.quantize_rows_1x16(operand)
        assert got.cols == 48 and torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
        got, want = R.quantize_cols_1x16_sr(t, rht, 9), R.quantize_rows_1x16_sr(operand, 9)
        assert torch.equal(got.data, want.data) and torch.equal(got.amax, want.amax)


def test_the_transform_adds_its_products_in_a_fixed_order_equal_to_the_exact_sum_where_that_is_exact():
    x = torch.randn(64, 32).to(torch.bfloat16)  # one binade range per group: every fp32 sum exact
    exact = (x.double().reshape(-1, 16) @ R.hadamard_16().double()).reshape(x.shape)
    assert torch.equal(R.rht_16(x), exact.to(torch.bfloat16))
    wide = torch.randn(8, 16) * torch.logspace(-20, 20, 16)  # fp32, 40 decades: the order decides the rounding
    acc = torch.zeros(8, 16)
    for i in range(16):
        acc = acc + wide[:, i : i + 1] * R.hadamard_16()[i]
    assert torch.equal(R.rht_16(wide), acc)


def test_the_cuda_kernel_holds_the_references_sign_vector_and_hash_constants():
    # read from the source, so a CPU machine catches a wrong constant before any GPU runs it
    import re

    from fp4_dist.kernels import _launch

    source = (_launch.CUDA_DIR / "nvfp4_1d.cu").read_text()
    signs = int(re.search(r"kRhtSigns = 0x([0-9A-Fa-f]+)u;", source).group(1), 16)
    assert [(-1 if signs >> i & 1 else 1) for i in range(16)] == list(R.RHT_SIGNS)
    for constant in (R._GAMMA, *R._MIX):
        assert f"0x{constant:016X}ull" in source, hex(constant)
    assert "z >> 30" in source and "z >> 27" in source and "z >> 31" in source and "z >> 56" in source
