"""fp4_dist/kernels/stages.py on the CPU reference path: the compact scale exchange stages (owner_scales,
expand_scales) and the bound stages.

Claims: dp ranks that exchange only tensor and cut-tile amaxes, compute the scales of the tiles they own and
expand the gathered bytes produce the bytes of quantizing each whole weight; a bound stage gives the bytes of
the stage function and follows new values written into its tensors; bad ranges raise before anything is written.
(The GPU twins of these tests are in test_stages_cuda.py.)
"""

import random

import pytest
import torch

import fp4_dist.kernels as K
from fp4_dist.buffers.layout import build_layout
from fp4_dist.buffers.tile_owners import tile_exchange
from fp4_dist.format import rowwise_scale_shape

from fp4_dist.kernels import reference as R
from fp4_dist.testing import assert_bytes_equal, awkward_shapes, poison_, random_weight


def simulate_ranks(shapes, masters, dp, layout_kw, device="cpu", numerics="te"):
    """Every rank of a dp group in one process: partial amax, MAX over ranks of the exchanged entries only,
    owner scales into its compact bytes, partial cast; then expand. Returns (data, scale_invs, amaxes)."""
    layout = build_layout([m * k for m, k in shapes], dp, **layout_kw)
    ex = tile_exchange(layout, shapes)
    n, lay = len(shapes), K.amax_layout(shapes)
    index = list(range(n)) + [n + lay.tile_offsets[i] + t for i in range(n) for t in ex.cut[i]]
    index = torch.tensor(index, dtype=torch.int64, device=device)
    pieces = [layout.pieces(r) for r in range(dp)]
    shards = [[None if p is None else masters[i].view(-1)[p.span.start:p.span.end].to(device)
               for i, p in enumerate(pieces[r])] for r in range(dp)]  # fmt: skip
    starts = [[0 if p is None else p.span.start for p in pieces[r]] for r in range(dp)]
    local = [K.partial_amax(shards[r], starts[r], shapes, device=device) for r in range(dp)]
    message = torch.stack([buf[index] for buf in local]).amax(dim=0)  # the all-reduce
    gathered = poison_(torch.empty(dp * ex.cap, dtype=torch.uint8, device=device))
    data = [poison_(torch.empty(m, k // 2, dtype=torch.uint8, device=device)) for m, k in shapes]
    amax_outs = [poison_(torch.empty(1, device=device)) for _ in shapes]
    for r in range(dp):
        local[r][index] = message
        enc = poison_(torch.empty(lay.total - n, device=device))
        K.owner_scales(local[r], shapes, ex.enc[r], ex.scale[r], gathered[r * ex.cap:(r + 1) * ex.cap], enc,
                       amax_outs, numerics=numerics)  # fmt: skip
        frags = [None if s is None else d.view(-1)[a >> 1:(a + s.numel() + 1) >> 1]
                 for s, a, d in zip(shards[r], starts[r], data)]  # fmt: skip
        K.partial_cast(shards[r], starts[r], shapes, enc, frags)
    scale_invs = [poison_(torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=device)) for m, k in shapes]
    K.expand_scales(gathered, shapes, ex.sources, scale_invs)
    return data, scale_invs, amax_outs


@pytest.mark.parametrize("seed", range(24))
def test_cut_tile_exchange_and_owner_scales_give_whole_weight_quantize_bytes(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    shapes = awkward_shapes(rng, rng.randint(1, 5), max_m=70)
    shapes = [(m + m % 2, k) for m, k in shapes]  # whole bytes per weight (M * K even)
    masters = [random_weight(m, k, heavy_tailed=i % 2 == 0, generator=gen) for i, (m, k) in enumerate(shapes)]
    dp = rng.randint(1, 5)
    kw = dict(align=rng.choice([2, 2, 64]), bucket_numel=rng.choice([None, 700, 3000]))
    data, scale_invs, amaxes = simulate_ranks(shapes, masters, dp, kw)
    for i, w in enumerate(masters):
        ref_data, ref_si, ref_amax, _ = R.quantize(w)
        label = f"weight {i} {shapes[i]} dp={dp} {kw}"
        assert_bytes_equal(data[i], ref_data, f"{label} rowwise_data")
        assert_bytes_equal(scale_invs[i], ref_si, f"{label} rowwise_scale_inv")
        assert_bytes_equal(amaxes[i], ref_amax, f"{label} amax")


def test_owner_scales_match_fused_scale_for_te_214_numerics_too():
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    shapes = awkward_shapes(rng, 4, max_m=50)
    shapes = [(m + m % 2, k) for m, k in shapes]
    masters = [random_weight(m, k, generator=gen) for m, k in shapes]
    amaxes = K.partial_amax([w.view(-1) for w in masters], [0] * 4, shapes)
    ref_si = [torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8) for m, k in shapes]
    ref_enc = K.fused_scale(amaxes, shapes, ref_si, [torch.empty(1) for _ in shapes], numerics="te-2.14")
    _, scale_invs, _ = simulate_ranks(shapes, masters, 3, dict(align=2), numerics="te-2.14")
    for i in range(4):
        assert_bytes_equal(scale_invs[i], ref_si[i], f"scale_inv {i}")
    enc = poison_(torch.empty(ref_enc.numel()))
    tiles = [-(-m // 16) * -(-k // 16) for m, k in shapes]
    K.owner_scales(amaxes, shapes, [(0, t) for t in tiles], [(0, t) for t in tiles], torch.empty(sum(tiles),
                   dtype=torch.uint8), enc, [torch.empty(1) for _ in shapes], numerics="te-2.14")  # fmt: skip
    assert_bytes_equal(enc, ref_enc, "encode multipliers")


def test_bound_stages_give_the_stage_bytes_and_follow_new_values_in_their_tensors():
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    shapes = [(m + m % 2, k) for m, k in awkward_shapes(rng, 4, max_m=60)]
    masters = [random_weight(m, k, generator=gen).view(-1) for m, k in shapes]
    starts = [0, 2, 16, 0]
    shards = [w[s:].clone() for w, s in zip(masters, starts)]
    amaxes = torch.empty(K.amax_layout(shapes).total)
    si = [torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8) for m, k in shapes]
    ao = [torch.empty(1) for _ in shapes]
    enc = torch.empty(amaxes.numel() - 4)
    data = [torch.zeros(m * k // 2, dtype=torch.uint8) for m, k in shapes]
    frags = [d[s >> 1:] for d, s in zip(data, starts)]
    runs = [K.bind_partial_amax(shards, starts, shapes, amaxes),
            K.bind_fused_scale(amaxes, shapes, si, ao, enc),
            K.bind_partial_cast(shards, starts, shapes, enc, frags)]  # fmt: skip
    for step in range(2):
        for s in shards:
            s.normal_(generator=gen).mul_(step + 1)
        for run in runs:
            run()
        ref_amax = K.partial_amax(shards, starts, shapes)
        ref_enc = K.fused_scale(ref_amax, shapes, [x.clone() for x in si], [x.clone() for x in ao])
        ref_data = [d.clone() for d in data]
        K.partial_cast(shards, starts, shapes, ref_enc, [d[s >> 1:] for d, s in zip(ref_data, starts)])
        assert_bytes_equal(amaxes, ref_amax, f"step {step} amaxes")
        assert_bytes_equal(enc, ref_enc, f"step {step} enc")
        for i in range(4):
            assert_bytes_equal(data[i], ref_data[i], f"step {step} data {i}")


def test_owner_scales_refuse_an_own_range_outside_the_enc_range_before_writing():
    shapes = [(32, 32)]
    amaxes, enc, ao = torch.rand(5), poison_(torch.empty(4)), torch.zeros(1)
    compact = poison_(torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="own range"):
        K.owner_scales(amaxes, shapes, [(0, 2)], [(1, 4)], compact, enc, [ao])
    with pytest.raises(ValueError, match="enc range"):
        K.owner_scales(amaxes, shapes, [(0, 5)], [(0, 0)], compact, enc, [ao])
    assert bool(enc.isnan().all()) and bool((compact == 0xA5).all()) and ao.item() == 0


def test_expand_scales_refuse_sources_that_miss_tile_zero_or_read_outside_the_gathered_bytes():
    shapes, si = [(32, 32)], [poison_(torch.empty(rowwise_scale_shape(32, 32), dtype=torch.uint8))]
    gathered = torch.arange(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="from 0"):
        K.expand_scales(gathered, shapes, [((1, 0),)], si)
    with pytest.raises(ValueError, match="outside"):
        K.expand_scales(gathered, shapes, [((0, 0), (2, 6))], si)
    assert bool((si[0] == 0xA5).all())
    K.expand_scales(gathered, shapes, [((0, 0), (2, 2))], si)  # tiles 0,1 <- bytes 0,1; tiles 2,3 <- bytes 4,5
    assert si[0][0, :4].tolist() == [0, 1, 0, 0] and si[0][16, :4].tolist() == [4, 5, 0, 0]
