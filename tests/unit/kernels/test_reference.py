"""The torch reference (CPU path and kernel oracle) against known vectors and an independent numpy oracle."""

import random

import numpy as np
import pytest
import torch

import fp4_dist
from fp4_dist.format import tile_grid
from fp4_dist.kernels import reference as R
from fp4_dist.testing import assert_bytes_equal, poison_, random_weight
from tests.unit import spec_oracle as O

FLT_MAX = torch.finfo(torch.float32).max


def _quantize_unit_scale(values: torch.Tensor):
    """Quantize `values` (<= 16 entries, max|v| <= 6) in a tile whose encode multiplier is exactly 1.

    With a global amax of 2688 (S = 1) and a tile amax of 6, d_t = 6 * fp32(1/6) rounds to 1.0, so s_t = 1.0 and
    e_t = 1: the E2M1 codes are those of the values themselves.
    """
    w = torch.zeros(16, 32)
    w[0, : values.numel()] = values
    w[1, 0] = 6.0
    w[0, 16] = 2688.0  # another tile carries the global amax
    data, scales, amax, tiles = R.quantize(w)
    assert float(amax) == 2688.0 and int(tiles[0, 0]) == 0x38, "setup: tile (0, 0) must have scale 1.0"
    return R.unpack_nibbles(data)[0, : values.numel()]


E2M1_TIES = [  # |y|, expected code: the spec's RNE table at each boundary
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (5.5, 7), (6.0, 7),
    (0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6),
]


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["pos", "neg"])
def test_e2m1_tie_table_rounds_half_to_even_end_to_end(sign):
    vals = torch.tensor([sign * v for v, _ in E2M1_TIES])
    codes = _quantize_unit_scale(vals)
    want = [c | (0x8 if sign < 0 and v != 0 else 0) for v, c in E2M1_TIES]
    assert codes.tolist() == want


def test_e2m1_codes_saturate_and_sign_small_negatives():
    y = torch.tensor([7.0, 1e30, float("inf"), -float("inf"), -0.1, -0.0, 0.0, 0.2500001, 5.000001, 4.9999995])
    assert R.e2m1_codes(y).tolist() == [7, 7, 7, 15, 8, 0, 0, 1, 7, 6]


def test_e2m1_codes_match_numpy_oracle_on_random_values():
    y = torch.randn(20000) * 4
    y[:7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    np.testing.assert_array_equal(R.e2m1_codes(y).numpy(), O.e2m1_code(y.numpy()))


def test_e4m3_rounding_matches_nearest_even_search_including_subnormals_and_saturation():
    table = torch.tensor(O.E4M3, dtype=torch.float32)
    mids = (table[1:] + table[:-1]) / 2  # exact ties: must go to the even code
    special = torch.tensor([2.0**-10, 2.0**-11, 447.9, 448.0, 464.0, 480.0, 1e6, float("inf"), FLT_MAX])
    d = torch.cat([table, mids, torch.rand(5000) * 500, torch.rand(5000) * 0.02])
    np.testing.assert_array_equal(R.e4m3_rne_satfinite(d).numpy(), O.e4m3_code(d.numpy()))
    assert R.e4m3_rne_satfinite(special).tolist() == [0, 0, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E]
    # NaN is 0x7F whatever its sign bit (x86 computes inf * 0 as a NaN with it set), as the kernels write it
    nans = torch.tensor([0x7FC00000, 0xFFC00000 - (1 << 32), 0x7F800001], dtype=torch.int32).view(torch.float32)
    inf = torch.tensor([float("inf")])
    assert R.e4m3_rne_satfinite(torch.cat([nans, inf * 0.0])).tolist() == [0x7F] * 4


SHAPES = [(1, 16), (15, 48), (16, 16), (17, 80), (33, 64), (40, 48), (64, 144), (97, 32)]


@pytest.mark.parametrize("numerics", ["te", "te-2.14"])
@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "heavy"])
@pytest.mark.parametrize("m,k", SHAPES, ids=[f"M{m}-K{k}" for m, k in SHAPES])
def test_reference_matches_numpy_oracle_on_every_field(m, k, heavy, numerics):
    g = torch.Generator().manual_seed(m * 1000 + k + heavy)
    w = random_weight(m, k, heavy_tailed=heavy, generator=g).to(torch.bfloat16)
    data, scale_inv, amax, tiles = R.quantize(w.float(), numerics)
    codes, scales, oamax = O.quantize(w.float().numpy(), numerics)
    assert_bytes_equal(data, torch.from_numpy(O.pack(codes)), "rowwise_data")
    assert_bytes_equal(tiles, torch.from_numpy(scales), "tile scales")
    assert float(amax) == float(oamax)
    tm, tk = tiles.shape
    assert_bytes_equal(scale_inv[:m, :tk], torch.from_numpy(np.repeat(scales, 16, axis=0)[:m]), "valid scales")
    pad = scale_inv.clone()
    pad[:m, :tk] = 0
    assert int(pad.count_nonzero()) == 0, "scale padding must be zero"


def test_fp32_input_is_rounded_to_bf16_first():
    w = torch.randn(32, 48) * 3
    a = R.quantize(w)
    b = R.quantize(w.to(torch.bfloat16).float())
    for x, y, name in zip(a, b, ["data", "scale_inv", "amax", "tiles"]):
        assert_bytes_equal(x, y, name)


def test_zero_tiles_get_scale_zero_and_all_zero_tensor_gets_amax_zero():
    w = torch.randn(32, 32)
    w[:16, :16] = 0
    data, scale_inv, amax, tiles = R.quantize(w)
    assert int(tiles[0, 0]) == 0 and int(tiles.count_nonzero()) == 3
    assert int(R.unpack_nibbles(data)[:16, :16].count_nonzero()) == 0
    data, scale_inv, amax, tiles = R.quantize(torch.zeros(20, 48))
    assert float(amax) == 0.0 and int(data.count_nonzero()) == 0 and int(scale_inv.count_nonzero()) == 0


def test_small_tile_next_to_large_one_gets_a_subnormal_block_scale():
    w = torch.zeros(16, 32)
    w[0, 0] = 1000.0
    w[3, 20] = 0.01  # d_t = 0.01 * 2688/1000/6 = 0.00448: inside the E4M3 subnormal range [2^-9, 2^-6)
    _, _, _, tiles = R.quantize(w)
    code = int(tiles[0, 1])
    assert 0 < code < 8, f"expected an E4M3 subnormal code (exponent 0), got {code:#x}"
    _, scales, _ = O.quantize(w.to(torch.bfloat16).float().numpy())
    assert code == int(scales[0, 1])


def test_numerics_variants_differ_exactly_where_their_formulas_round_differently():
    # Every bf16 tile amax in [A/1024, A) against bf16 tensor amaxes A until the two formulas disagree.
    rng = np.random.default_rng(0)
    bf16 = lambda v: torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).float().numpy()  # noqa: E731
    found = None
    for a_tensor in bf16(rng.uniform(1, 100, 2000)):
        a_tiles = np.unique(bf16(np.geomspace(a_tensor / 1024, a_tensor, 4000)))
        s = np.float32(np.float32(2688.0) / a_tensor)
        new = O.e4m3_code(a_tiles * np.float32(s * np.float32(np.float32(1) / np.float32(6))))
        old = O.e4m3_code((a_tiles / np.float32(6)) * s)
        diff = np.nonzero(new != old)[0]
        if diff.size:
            found = (a_tensor, a_tiles[diff[0]], new[diff[0]], old[diff[0]])
            break
    assert found, "no differing block found"
    a_tensor, a_tile, want_new, want_old = found
    w = torch.zeros(16, 32)
    w[0, 0], w[5, 17] = float(a_tensor), float(a_tile)
    w = w.to(torch.bfloat16).float()
    assert float(w[0, 0]) == float(a_tensor) and float(w[5, 17]) == float(a_tile)
    t_new = R.quantize(w, "te")[3]
    t_old = R.quantize(w, "te-2.14")[3]
    _, s_new, _ = O.quantize(w.numpy(), "te")
    _, s_old, _ = O.quantize(w.numpy(), "te-2.14")
    assert int(t_new[0, 1]) == int(s_new[0, 1]) and int(t_old[0, 1]) == int(s_old[0, 1])
    assert (int(t_new[0, 1]), int(t_old[0, 1])) == (int(want_new), int(want_old))
    assert int(t_new[0, 1]) != int(t_old[0, 1]) and torch.equal(t_new[:, :1], t_old[:, :1])


def test_dequantize_error_is_what_fp4_allows_on_gaussian_data():
    w = torch.randn(256, 512)
    data, scale_inv, amax, _ = R.quantize(w)
    err = ((R.dequantize(data, scale_inv, amax) - w).norm() / w.norm()).item()
    assert 0.05 < err < 0.15, err


@pytest.mark.parametrize("m,k", [(1, 16), (40, 48), (130, 80), (16, 272)])
def test_dequantize_reads_the_compact_tile_grid_as_the_row_expanded_scales(m, k):
    q = fp4_dist.quantize(random_weight(m, k, generator=torch.Generator().manual_seed(m + k)))
    grid = q.rowwise_scale_inv[:m:16, : tile_grid(m, k)[1]].contiguous()
    assert tuple(grid.shape) == tile_grid(m, k)
    want = R.dequantize(q.rowwise_data, q.rowwise_scale_inv, q.amax)
    assert_bytes_equal(R.dequantize(q.rowwise_data, grid, q.amax), want, "reference")
    out = poison_(torch.empty(m, k))
    fp4_dist.kernels.dequantize([q.rowwise_data], [grid], [q.amax], [out])
    assert_bytes_equal(out, want, "stage on the CPU")
    with pytest.raises(ValueError, match=r"rowwise_scale_inv 0 \(or its tile grid"):
        fp4_dist.kernels.dequantize([q.rowwise_data], [grid[:, :-1].contiguous() if grid.shape[1] > 1 else grid[:0]],
                                    [q.amax], [out])


def test_dequantize_uses_amax_times_scale_over_2688():
    w = torch.randn(16, 16)
    data, scale_inv, amax, tiles = R.quantize(w)
    s = tiles.view(torch.float8_e4m3fn).float()[0, 0]
    f = (s * amax[0]) * (torch.tensor(1.0) / torch.tensor(2688.0))
    codes = R.unpack_nibbles(data)
    vals = torch.tensor(O.E2M1, dtype=torch.float32)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    assert torch.equal(R.dequantize(data, scale_inv, amax), vals * f)


@pytest.mark.parametrize("m,k", [(2, 16), (18, 48), (32, 80), (46, 32), (64, 144)])
def test_columnwise_copy_equals_packing_the_transposed_codes(m, k):
    w = random_weight(m, k, generator=torch.Generator().manual_seed(m + k))
    data, scale_inv, _, _ = R.quantize(w)
    codes, scales, _ = O.quantize(w.to(torch.bfloat16).float().numpy())
    want = O.pack(np.ascontiguousarray(codes.T))
    assert_bytes_equal(R.transpose_nibbles(data), torch.from_numpy(want), "columnwise_data")
    col = R.transpose_scales(scale_inv, m, k)
    want_scales = np.zeros(col.shape, dtype=np.uint8)
    for kk in range(k):
        for mt in range(scales.shape[0]):
            want_scales[kk, mt] = scales[mt, kk // 16]
    assert_bytes_equal(col, torch.from_numpy(want_scales), "columnwise_scale_inv")


def test_odd_m_has_no_columnwise_copy():
    data, *_ = R.quantize(torch.randn(17, 32))
    with pytest.raises(ValueError, match="even M"):
        R.transpose_nibbles(data)


def test_shard_by_shard_cast_equals_whole_cast_for_random_even_cuts():
    from fp4_dist.testing import shard_cuts

    rng = random.Random(7)
    for m, k in [(17, 48), (33, 80), (5, 16)]:
        w = random_weight(m, k, generator=torch.Generator().manual_seed(k)).reshape(-1)
        whole = R.quantize(w.view(m, k))
        ranges = list(shard_cuts(m * k, 5, rng))
        tiles = torch.zeros(R.tile_grid(m, k))
        amax = torch.zeros(1)
        for a, b in ranges:
            t, s = R.shard_tile_amax(w[a:b], a, m, k)
            tiles, amax = torch.maximum(tiles, t), torch.maximum(amax, s)
        scales = R.tile_scales(tiles, amax)
        enc = R.encode_multipliers(scales, amax)
        data = torch.full((m * k // 2,), 0xA5, dtype=torch.uint8)
        for a, b in ranges:
            R.cast_shard(w[a:b], a, m, k, enc, data[a >> 1 : (b + 1) >> 1])
        assert_bytes_equal(data.view(m, k // 2), whole[0], f"{m}x{k} cuts {ranges}")
