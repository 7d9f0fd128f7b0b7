"""fp4_dist/kernels/stages.py on CUDA: the stage kernels give the same bytes as the PyTorch reference on fresh random data (GPU only).

Every output is poisoned before the kernel runs. Cases mix ragged M, K in {16, 48, 80, 4096, 5120} (and a few
others), fp32 and bf16 shards, shards cut mid-tile and mid-row, odd shard ends, empty shards, misaligned shard
and fragment pointers, and lists of up to 500 weights in one launch. Case counts: 60 amax + 40 scale + 60 cast
+ 40 transpose + 16 end-to-end + 2 many-weights, plus the rounding functions on ~10^7 values each.
"""

import random

import pytest
import torch

import fp4_dist.kernels as K
from fp4_dist.format import columnwise_data_shape, columnwise_scale_shape, rowwise_scale_shape
from fp4_dist.kernels import _launch, stages
from fp4_dist.kernels import reference as R
from fp4_dist.testing import assert_bytes_equal, poison_, random_weight

pytestmark = pytest.mark.gpu

KS = (16, 48, 80, 4096, 5120, 16, 48, 80, 128, 144, 272)
DEV = "cuda"


def _shape(rng: random.Random) -> tuple[int, int]:
    k = rng.choice(KS)
    return (rng.randint(1, 40) if k >= 4096 else rng.randint(1, 90)), k


def _range(rng: random.Random, numel: int, even_start: bool) -> tuple[int, int]:
    """A shard [start, end): full, empty, tiny, or cut at random points (mid-tile, mid-row, odd end)."""
    kind = rng.choice(["cut", "cut", "cut", "full", "empty", "tiny", "tail"])
    if kind == "full":
        s, e = 0, numel
    elif kind == "empty":
        s = rng.randint(0, numel)
        e = s
    elif kind == "tiny":
        s = rng.randint(0, numel - 1)
        e = min(numel, s + rng.randint(1, 3))
    elif kind == "tail":
        s, e = rng.randint(0, numel - 1), numel
    else:
        s, e = sorted((rng.randint(0, numel), rng.randint(0, numel)))
    if even_start and s % 2:
        s -= 1
    return s, e


def _placed(values: torch.Tensor, offset: int) -> torch.Tensor:
    """`values` copied to the GPU at `offset` elements into a fresh buffer (offset != 0: misaligned vectors)."""
    buf = torch.empty(values.numel() + offset, dtype=values.dtype, device=DEV)
    out = buf[offset:]
    out.copy_(values)
    return out


def _weights(rng, gen, shapes, heavy_every=2):
    return [random_weight(m, k, heavy_tailed=(i % heavy_every == 0), generator=gen) for i, (m, k) in enumerate(shapes)]


def _shards(rng, weights, even_start):
    """GPU shards (mixed fp32 / bf16, some misaligned, some None), their starts, and CPU twins for the reference."""
    shards, starts, cpu = [], [], []
    for w in weights:
        s, e = _range(rng, w.numel(), even_start)
        src = w.reshape(-1)[s:e]
        if rng.random() < 0.3:
            src = src.to(torch.bfloat16)
        if e == s and rng.random() < 0.5:
            shards.append(None)
            cpu.append(None)
        else:
            shards.append(_placed(src, rng.choice([0, 0, 0, 1, 2, 3])))
            cpu.append(src.clone())
        starts.append(s)
    return shards, starts, cpu


# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(60))
def test_partial_amax_matches_reference_on_random_shards(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    weights = _weights(rng, gen, shapes)
    if seed % 7 == 0:  # non-finite masters must surface as an inf amax
        weights[0].view(-1)[rng.randrange(weights[0].numel())] = float("nan")
    shards, starts, cpu = _shards(rng, weights, even_start=False)
    round_to = [torch.bfloat16, torch.bfloat16, torch.float16, torch.float32][seed % 4]
    layout = K.amax_layout(shapes)
    out = poison_(torch.empty(layout.total, dtype=torch.float32, device=DEV))
    K.partial_amax(shards, starts, shapes, round_to=round_to, out=out)
    ref = K.partial_amax(cpu, starts, shapes, round_to=round_to, device="cpu")
    assert_bytes_equal(out, ref, f"amax buffer (seed {seed}, shapes {shapes}, starts {starts})")


def _amax_buffer(rng, gen, shapes):
    """A reduced amax buffer as training produces it, with crafted extremes mixed in."""
    ws = _weights(rng, gen, shapes)
    buf = K.partial_amax([w.reshape(-1) for w in ws], [0] * len(ws), shapes, device="cpu")
    n = len(shapes)
    tiles = buf[n:]
    pick = torch.rand(tiles.shape, generator=gen)
    tiles[pick < 0.05] = 0.0  # all-zero tiles: scale 0, e_t = FLT_MAX
    tiny = (pick >= 0.05) & (pick < 0.12)  # scales in the E4M3 subnormal range
    tiles[tiny] = buf[0] * torch.rand(int(tiny.sum()), generator=gen) * 1e-3
    if rng.random() < 0.2:
        buf[0] = 0.0  # A == 0: S = 1
    return buf


@pytest.mark.parametrize("seed", range(40))
def test_fused_scale_matches_reference_including_padding_and_amax(seed):
    rng, gen = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    numerics = "te" if seed % 2 == 0 else "te-2.14"
    amaxes = _amax_buffer(rng, gen, shapes)
    ref_si = [torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8) for m, k in shapes]
    ref_ao = [torch.empty(1) for _ in shapes]
    ref_enc = K.fused_scale(amaxes, shapes, ref_si, ref_ao, numerics=numerics)
    si = [poison_(torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    ao = [poison_(torch.empty(1, device=DEV)) for _ in shapes]
    enc = K.fused_scale(amaxes.to(DEV), shapes, si, ao, numerics=numerics)
    assert_bytes_equal(enc, ref_enc, f"encode multipliers ({numerics}, {shapes})")
    for i in range(len(shapes)):
        assert_bytes_equal(si[i], ref_si[i], f"rowwise_scale_inv {i} {shapes[i]}")
        assert_bytes_equal(ao[i], ref_ao[i], f"amax {i}")


def _fragments(rng, shapes, shards, starts, cpu):
    """Per weight: a rowwise_data buffer of random old bytes (some misaligned) and the shard's byte fragment."""
    frags, cpu_frags = [], []
    for (m, k), shard, s in zip(shapes, shards, starts):
        old = torch.randint(0, 256, (m * k // 2,), dtype=torch.uint8)
        if shard is None or shard.numel() == 0:
            frags.append(None)
            cpu_frags.append(None)
            continue
        lo, hi = s >> 1, (s + shard.numel() + 1) >> 1
        data = _placed(old, rng.choice([0, 0, 1, 2]))
        frags.append(data[lo:hi])
        cpu_frags.append(old[lo:hi].clone())
    return frags, cpu_frags


@pytest.mark.parametrize("seed", range(60))
def test_partial_cast_writes_only_owned_nibbles_like_reference(seed):
    rng, gen = random.Random(2000 + seed), torch.Generator().manual_seed(2000 + seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    weights = _weights(rng, gen, shapes)
    shards, starts, cpu = _shards(rng, weights, even_start=True)
    round_to = [torch.bfloat16, torch.bfloat16, torch.float16, torch.float32][seed % 4]
    amaxes = K.partial_amax([w.reshape(-1) for w in weights], [0] * len(weights), shapes, round_to=round_to)
    enc = K.fused_scale(amaxes, shapes, [torch.empty(rowwise_scale_shape(*s), dtype=torch.uint8) for s in shapes],
                        [torch.empty(1) for _ in shapes])  # fmt: skip
    frags, cpu_frags = _fragments(rng, shapes, shards, starts, cpu)
    K.partial_cast(shards, starts, shapes, enc.to(DEV), frags, round_to=round_to)
    K.partial_cast(cpu, starts, shapes, enc, cpu_frags, round_to=round_to)
    for i, (f, rf) in enumerate(zip(frags, cpu_frags)):
        if f is not None:
            assert_bytes_equal(f, rf, f"fragment {i} shape {shapes[i]} shard [{starts[i]}, +{shards[i].numel()})")


@pytest.mark.parametrize("seed", range(40))
def test_transposes_match_reference_and_write_every_byte(seed):
    rng = random.Random(3000 + seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    shapes = [(m + (m % 2), k) for m, k in shapes]  # columnwise data needs an even M
    rows = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8) for m, k in shapes]
    scales = [torch.randint(0, 256, rowwise_scale_shape(m, k), dtype=torch.uint8) for m, k in shapes]
    off = rng.choice([0, 0, 1, 4])  # misaligned columnwise rows take the byte path
    cols = [poison_(torch.empty(columnwise_data_shape(m, k)[0] * columnwise_data_shape(m, k)[1] + off,
                                dtype=torch.uint8, device=DEV))[off:].view(columnwise_data_shape(m, k))
            for m, k in shapes]  # fmt: skip
    cscales = [poison_(torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    K.nibble_transpose([r.to(DEV) for r in rows], cols)
    K.scale_transpose([s.to(DEV) for s in scales], cscales, shapes)
    for i, (m, k) in enumerate(shapes):
        assert_bytes_equal(cols[i], R.transpose_nibbles(rows[i]), f"columnwise_data {i} M{m}-K{k}")
        assert_bytes_equal(cscales[i], R.transpose_scales(scales[i], m, k), f"columnwise_scale_inv {i} M{m}-K{k}")


# --------------------------------------------------------------------------------------------------------------


def _even_cuts(rng, numel, dp):
    cuts = sorted(rng.randint(0, numel) & ~1 for _ in range(dp - 1))
    return list(zip([0, *cuts], [*cuts, numel]))


@pytest.mark.parametrize("seed", range(16))
def test_sharded_cast_on_gpu_equals_whole_tensor_quantize(seed):
    """dp ranks' partial amax -> MAX merge -> scales -> partial casts into one buffer == R.quantize of W."""
    rng, gen = random.Random(4000 + seed), torch.Generator().manual_seed(4000 + seed)
    dp = [1, 2, 3, 5][seed % 4]
    shapes = [_shape(rng) for _ in range(rng.randint(1, 5))]
    shapes = [(m + (m % 2), k) for m, k in shapes]
    ws = _weights(rng, gen, shapes)
    flat = [w.reshape(-1).to(DEV) for w in ws]
    cuts = [_even_cuts(rng, w.numel(), dp) for w in ws]
    bufs = [K.partial_amax([f[c[r][0]:c[r][1]] for f, c in zip(flat, cuts)], [c[r][0] for c in cuts], shapes)
            for r in range(dp)]  # fmt: skip
    amaxes = torch.stack(bufs).amax(dim=0)
    si = [poison_(torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    ao = [poison_(torch.empty(1, device=DEV)) for _ in shapes]
    enc = K.fused_scale(amaxes, shapes, si, ao)
    data = [poison_(torch.empty(m, k // 2, dtype=torch.uint8, device=DEV)) for m, k in shapes]
    for r in range(dp):
        frags = [d.view(-1)[c[r][0] >> 1 : (c[r][1] + 1) >> 1] for d, c in zip(data, cuts)]
        K.partial_cast([f[c[r][0]:c[r][1]] for f, c in zip(flat, cuts)], [c[r][0] for c in cuts], shapes, enc, frags)
    cols = [poison_(torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    cscales = [poison_(torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    K.nibble_transpose(data, cols)
    K.scale_transpose(si, cscales, shapes)
    for i, w in enumerate(ws):
        ref_data, ref_si, ref_amax, _ = R.quantize(w)
        label = f"weight {i} {shapes[i]} dp={dp}"
        assert_bytes_equal(data[i], ref_data, f"{label} rowwise_data")
        assert_bytes_equal(si[i], ref_si, f"{label} rowwise_scale_inv")
        assert_bytes_equal(ao[i], ref_amax, f"{label} amax")
        assert_bytes_equal(cols[i], R.transpose_nibbles(ref_data), f"{label} columnwise_data")
        assert_bytes_equal(cscales[i], R.transpose_scales(ref_si, *shapes[i]), f"{label} columnwise_scale_inv")


@pytest.mark.parametrize("count", [500, 137])
def test_hundreds_of_weights_take_one_launch_per_stage(count, launches):
    rng, gen = random.Random(count), torch.Generator().manual_seed(count)
    shapes = [(rng.randint(1, 40) * 2, rng.choice((16, 48, 80, 128, 144))) for _ in range(count)]
    ws = _weights(rng, gen, shapes, heavy_every=3)
    shards, starts, cpu = _shards(rng, ws, even_start=True)
    out = poison_(torch.empty(K.amax_layout(shapes).total, device=DEV))
    K.partial_amax(shards, starts, shapes, out=out)
    assert_bytes_equal(out, K.partial_amax(cpu, starts, shapes, device="cpu"), "amax of many weights")
    si = [poison_(torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    ao = [poison_(torch.empty(1, device=DEV)) for _ in shapes]
    enc = K.fused_scale(out, shapes, si, ao)
    frags, cpu_frags = _fragments(rng, shapes, shards, starts, cpu)
    K.partial_cast(shards, starts, shapes, enc, frags)
    K.partial_cast(cpu, starts, shapes, enc.cpu(), cpu_frags)
    for i, (f, rf) in enumerate(zip(frags, cpu_frags)):
        if f is not None:
            assert_bytes_equal(f, rf, f"fragment {i}")
    data = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=DEV) for m, k in shapes]
    cols = [poison_(torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    cscales = [poison_(torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    K.nibble_transpose(data, cols)
    K.scale_transpose(si, cscales, shapes)
    for i in range(0, count, 7):
        assert_bytes_equal(cols[i], R.transpose_nibbles(data[i].cpu()), f"columnwise_data {i}")
        assert_bytes_equal(cscales[i], R.transpose_scales(si[i].cpu(), *shapes[i]), f"columnwise_scale_inv {i}")
    assert launches == ["partial_amax", "fused_scale", "partial_cast", "nibble_transpose", "scale_transpose"]


def test_repeated_calls_reuse_the_plan_and_stay_correct():
    """The second call with the same buffers hits the plan cache; new data still gives new, right bytes."""
    stages.PLANS.clear()
    shapes = [(33, 80), (18, 4096)]
    flat = [torch.randn(m * k, device=DEV) for m, k in shapes]
    shards, starts = [flat[0][10:2000], flat[1][4000:50000]], [10, 4000]
    out = torch.empty(K.amax_layout(shapes).total, device=DEV)
    K.partial_amax(shards, starts, shapes, out=out)
    plans = len(stages.PLANS)
    for s in shards:
        s.normal_()
    poison_(out)
    K.partial_amax(shards, starts, shapes, out=out)
    assert len(stages.PLANS) == plans == 1
    ref = K.partial_amax([s.cpu() for s in shards], starts, shapes, device="cpu")
    assert_bytes_equal(out, ref, "amax after reuse")


# --------------------------------------------------------------------------------------------------------------
# The rounding functions themselves, on many values at once.


def e2m1_codes(y: torch.Tensor, variant: str) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 CUDA `y`, computed by common.cuh's E2M1 rounding `variant`."""
    y = y.contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    _launch.launch_pointwise(y.device.index, "e2m1_codes", (y.data_ptr(), out.data_ptr()), y.numel(), variant)
    return out


def e4m3_codes(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 bits, fp32 decoded value) of fp32 CUDA `d` >= 0, by common.cuh's e4m3 functions."""
    d = d.contiguous()
    out = torch.empty(d.shape, dtype=torch.uint8, device=d.device)
    dec = torch.empty(d.shape, dtype=torch.float32, device=d.device)
    _launch.launch_pointwise(d.device.index, "e4m3_codes", (d.data_ptr(), out.data_ptr(), dec.data_ptr()), d.numel())
    return out, dec


def _around(points: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    bits = points.to(torch.float32).view(torch.int32)
    return torch.cat([(bits + d).view(torch.float32) for d in range(-ulps, ulps + 1)])


@pytest.mark.parametrize("variant", _launch._E2M1)
def test_device_e2m1_rounding_matches_reference_on_ties_neighbours_and_random_values(variant):
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 7.0, 8.0])
    sweep = torch.arange(0, 0x7F800000, 1237, dtype=torch.int64).to(torch.int32).view(torch.float32)
    nan_bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001], dtype=torch.int64).to(torch.int32)
    y = torch.cat([_around(ties, 40), -_around(ties, 40), torch.randn(4_000_000) * 3, torch.randn(1_000_000) * 1e3,
                   sweep, -sweep, nan_bits.view(torch.float32),
                   torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 3.4e38, 1e-45, -1e-45, 2.0**22,
                                 2.0**23, 2.0**24])]).to(DEV)  # fmt: skip
    assert_bytes_equal(e2m1_codes(y, variant), R.e2m1_codes(y), f"E2M1 codes ({variant})")


def test_device_e4m3_rounding_matches_torch_float8_including_subnormals_ties_and_saturation():
    table = R.e4m3_to_float(torch.arange(0, 127, dtype=torch.uint8))
    mids = (table[1:].double() + table[:-1].double()).div(2).float()  # exact ties (representable in fp32)
    strided = torch.arange(0, 0x44000000, 97, dtype=torch.int32).view(torch.float32)  # every 97th float < 512
    d = torch.cat([_around(table, 3), _around(mids, 3), strided,
                   torch.tensor([448.0, 464.0, 480.0, 1e30, float("inf"), 3.4e38, float("nan")])]).abs().to(DEV)  # fmt: skip
    codes, decoded = e4m3_codes(d)
    assert_bytes_equal(codes, R.e4m3_rne_satfinite(d), "E4M3 codes")
    finite = codes != 0x7F  # NaN payloads may differ; the code byte above already covers NaN
    assert_bytes_equal(decoded[finite], R.e4m3_to_float(codes)[finite], "E4M3 decode")


# --------------------------------------------------------------------------------------------------------------
# Bad input: a clear error before any launch, and nothing written.


def test_odd_shard_start_is_refused_before_any_byte_is_written(launches):
    shapes = [(16, 32)]
    x = torch.randn(512, device=DEV)
    data = torch.randint(0, 256, (16, 16), dtype=torch.uint8, device=DEV)
    before = data.clone()
    frag = data.view(-1)[101 >> 1 : (300 + 1) >> 1]
    enc = torch.ones(4, device=DEV)
    with pytest.raises(ValueError, match="odd|even"):
        K.partial_cast([x[101:300]], [101], shapes, enc, [frag])
    with pytest.raises(ValueError, match="odd|even"):
        K.bind_partial_cast([x[101:300]], [101], shapes, enc, [frag])
    assert launches == [] and torch.equal(data, before)


def test_bad_shards_raise_clear_errors_before_launch(launches):
    shapes = [(16, 32)]
    x = torch.randn(512, device=DEV)
    with pytest.raises(TypeError, match="dtype"):
        K.partial_amax([x.half()], [0], shapes)
    with pytest.raises(ValueError, match="contiguous"):
        K.partial_amax([x[::2]], [0], shapes)
    with pytest.raises(ValueError, match="outside"):
        K.partial_amax([x[:100]], [500], shapes)
    with pytest.raises(ValueError, match="device"):
        K.partial_amax([x.cpu()], [0], shapes, out=torch.empty(3, device=DEV))
    with pytest.raises(ValueError, match="fp32"):
        K.partial_amax([x], [0], shapes, out=torch.empty(5, device=DEV))
    data = torch.zeros(16, 16, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="fragment"):
        K.partial_cast([x[0:100]], [0], shapes, torch.ones(2, device=DEV), [data.view(-1)[:10]])
    with pytest.raises(ValueError, match="enc"):
        K.partial_cast([x[0:100]], [0], shapes, torch.ones(3, device=DEV), [data.view(-1)[:50]])
    assert launches == []


# --------------------------------------------------------------------------------------------------------------
# Compact scale exchange, bound stages, launch variants (the bind_* forms, owner/expand_scales).


@pytest.mark.parametrize("seed", range(12))
def test_cut_tile_exchange_on_gpu_gives_whole_weight_quantize_bytes(seed):
    from .test_stages import simulate_ranks

    rng, gen = random.Random(5000 + seed), torch.Generator().manual_seed(5000 + seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 6))]
    shapes = [(m + (m % 2), k) for m, k in shapes]
    ws = _weights(rng, gen, shapes)
    dp = [1, 2, 3, 5][seed % 4]
    kw = dict(align=rng.choice([2, 2, 64]), bucket_numel=rng.choice([None, 3000, 40000]))
    data, scale_invs, amaxes = simulate_ranks(shapes, ws, dp, kw, device=DEV, numerics=["te", "te-2.14"][seed % 2])
    for i, w in enumerate(ws):
        ref_data, _, ref_amax, ref_scales = R.quantize(w, numerics=["te", "te-2.14"][seed % 2])
        label = f"weight {i} {shapes[i]} dp={dp} {kw}"
        assert_bytes_equal(data[i], ref_data, f"{label} rowwise_data")
        assert_bytes_equal(scale_invs[i], R.expand_rowwise_scales(ref_scales, *shapes[i]), f"{label} scales")
        assert_bytes_equal(amaxes[i], ref_amax, f"{label} amax")


def test_bound_stages_on_gpu_take_one_launch_each_and_match_the_reference(launches):
    rng, gen = random.Random(77), torch.Generator().manual_seed(77)
    shapes = [(rng.randint(1, 40) * 2, rng.choice((16, 48, 80, 128, 144, 4096))) for _ in range(300)]
    ws = _weights(rng, gen, shapes, heavy_every=3)
    shards, starts, cpu = _shards(rng, ws, even_start=True)
    n, total = len(shapes), K.amax_layout(shapes).total
    amax = poison_(torch.empty(total, device=DEV))
    si = [poison_(torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    ao = [poison_(torch.empty(1, device=DEV)) for _ in shapes]
    enc = poison_(torch.empty(total - n, device=DEV))
    frags, cpu_frags = _fragments(rng, shapes, shards, starts, cpu)
    cols = [poison_(torch.empty(columnwise_data_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    cscales = [poison_(torch.empty(columnwise_scale_shape(m, k), dtype=torch.uint8, device=DEV)) for m, k in shapes]
    data = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device=DEV) for m, k in shapes]
    runs = [K.bind_partial_amax(shards, starts, shapes, amax), K.bind_fused_scale(amax, shapes, si, ao, enc),
            K.bind_partial_cast(shards, starts, shapes, enc, frags), K.bind_nibble_transpose(data, cols),
            K.bind_scale_transpose(si, cscales, shapes)]  # fmt: skip
    for run in runs:
        run()
    assert launches == ["partial_amax", "fused_scale", "partial_cast", "nibble_transpose", "scale_transpose"]
    ref_amax = K.partial_amax(cpu, starts, shapes, device="cpu")
    ref_si = [torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8) for m, k in shapes]
    ref_enc = K.fused_scale(ref_amax, shapes, ref_si, [torch.empty(1) for _ in shapes])
    K.partial_cast(cpu, starts, shapes, ref_enc, cpu_frags)
    assert_bytes_equal(amax, ref_amax, "bound amax")
    assert_bytes_equal(enc, ref_enc, "bound enc")
    for i in range(0, n, 5):
        assert_bytes_equal(si[i], ref_si[i], f"bound scale_inv {i}")
        if frags[i] is not None:
            assert_bytes_equal(frags[i], cpu_frags[i], f"bound fragment {i}")
        assert_bytes_equal(cols[i], R.transpose_nibbles(data[i].cpu()), f"bound columnwise_data {i}")
        assert_bytes_equal(cscales[i], R.transpose_scales(ref_si[i], *shapes[i]), f"bound columnwise_scale_inv {i}")


@pytest.mark.parametrize("grid", ["resident", "units"])
@pytest.mark.parametrize("tile", ["64x512", "128x256"])
def test_nibble_transpose_unit_shapes_and_grids_match_reference(tile, grid, monkeypatch):
    from fp4_dist.kernels import cuda_plans

    monkeypatch.setitem(_launch.GRID, "nibble_transpose", grid)
    rng = random.Random(hash((tile, grid)) % 1000)
    shapes = [_shape(rng) for _ in range(30)] + [(130, 4096), (258, 272), (2, 16)]
    shapes = [(m + (m % 2), k) for m, k in shapes]
    rows = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8) for m, k in shapes]
    off = rng.choice([0, 1, 4])
    cols = [poison_(torch.empty(columnwise_data_shape(m, k)[0] * columnwise_data_shape(m, k)[1] + off,
                                dtype=torch.uint8, device=DEV))[off:].view(columnwise_data_shape(m, k))
            for m, k in shapes]  # fmt: skip
    src = [r.to(DEV) for r in rows]
    plan = cuda_plans.nibble_plan(0, src, cols, tile=tile)
    _launch.launch_nibble_transpose(plan)
    for i, (m, k) in enumerate(shapes):
        assert_bytes_equal(cols[i], R.transpose_nibbles(rows[i]), f"{tile}/{grid} columnwise_data {i} M{m}-K{k}")


@pytest.mark.parametrize("seed", range(8))
def test_partial_cast_launch_variants_match_reference(seed, monkeypatch):
    """One block per unit (grid) and the other E2M1 rounding give the reference bytes too."""
    monkeypatch.setitem(_launch.GRID, "partial_cast", ["units", "resident"][seed % 2])
    monkeypatch.setattr(_launch, "CAST_E2M1", _launch._E2M1[(seed // 2) % 2])
    rng, gen = random.Random(6000 + seed), torch.Generator().manual_seed(6000 + seed)
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    weights = _weights(rng, gen, shapes)
    shards, starts, cpu = _shards(rng, weights, even_start=True)
    amaxes = K.partial_amax([w.reshape(-1) for w in weights], [0] * len(weights), shapes)
    enc = K.fused_scale(amaxes, shapes, [torch.empty(rowwise_scale_shape(*s), dtype=torch.uint8) for s in shapes],
                        [torch.empty(1) for _ in shapes])  # fmt: skip
    frags, cpu_frags = _fragments(rng, shapes, shards, starts, cpu)
    K.partial_cast(shards, starts, shapes, enc.to(DEV), frags)
    K.partial_cast(cpu, starts, shapes, enc, cpu_frags)
    for i, (f, rf) in enumerate(zip(frags, cpu_frags)):
        if f is not None:
            assert_bytes_equal(f, rf, f"fragment {i} shape {shapes[i]}")


def test_stage_api_checks_arguments_once_per_plan(monkeypatch):
    from fp4_dist.kernels import checks

    stages.PLANS.clear()  # a freed address of an earlier test could otherwise already have a plan
    calls = []
    real = checks.check_shards
    monkeypatch.setattr(checks, "check_shards", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    shapes = [(32, 48)]
    x = torch.randn(32 * 48, device=DEV)
    out = torch.empty(K.amax_layout(shapes).total, device=DEV)
    for _ in range(3):
        K.partial_amax([x], [0], shapes, out=out)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="contiguous"):
        K.partial_amax([torch.randn(2 * 32 * 48, device=DEV)[::2]], [0], shapes, out=out)


def test_sharded_cast_on_gpu_equals_quantize_for_hundreds_of_weights(launches):
    from fp4_dist.buffers import ShardBuffer, build_layout
    from fp4_dist.cast.sharded import ShardedCast
    from fp4_dist.tensor import NVFP4Tensor

    rng, gen = random.Random(88), torch.Generator().manual_seed(88)
    shapes = [(rng.randint(1, 40) * 2, rng.choice((16, 48, 80, 128, 144))) for _ in range(200)] + [(258, 4096)]
    masters = _weights(rng, gen, shapes, heavy_every=3)
    buf = ShardBuffer(build_layout([m * k for m, k in shapes], 1, align=64), 0, packed=True, device=DEV)
    ws = [NVFP4Tensor.empty(s, device=DEV) for s in shapes]
    for i, w in enumerate(ws):
        poison_(w.rowwise_scale_inv)
        w.set_rowwise_storage(buf.param_view(i))
        buf.master_piece(i).copy_(masters[i].view(-1))
    cast = ShardedCast.from_buffer(ws, buf)
    cast.cast()
    cast.gather_scales()
    cast.after_gather()
    assert launches == ["partial_amax", "owner_scales", "partial_cast", "expand_scales", "nibble_transpose",
                            "scale_transpose", "dequantize"]  # fmt: skip
    for i in range(0, len(ws), 9):
        ref = fp4_dist_quantize(masters[i])
        for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv"):
            assert_bytes_equal(getattr(ws[i], f), getattr(ref, f), f"weight {i} {shapes[i]} {f}")


def fp4_dist_quantize(master):
    import fp4_dist

    ref = fp4_dist.quantize(master.to(torch.bfloat16))
    ref.make_columnwise()
    return ref
