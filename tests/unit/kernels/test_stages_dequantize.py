"""fp4_dist/kernels/stages.py dequantize on CUDA: the kernel (cuda/dequant.cu) gives the reference's bits (GPU only), for any list of weights in
one launch: ragged M, K % 64 != 0, bf16 / fp16 / fp32 outputs mixed, misaligned pointers, every scale byte
and extreme amaxes, outputs poisoned first. The reference is run on the same GPU (torch's CUDA ops) and on the
CPU; NaN outputs (only from NaN scale bytes or an amax so large that (s * A) overflows) must sit at the same
places, every other bit must be equal."""

import random

import pytest
import torch

import fp4_dist
import fp4_dist.kernels as K
from fp4_dist.format import rowwise_scale_shape, tile_grid
from fp4_dist.kernels import reference as R
from fp4_dist.testing import assert_bytes_equal, poison_, random_weight

pytestmark = pytest.mark.gpu

DEV = "cuda"
KS = (16, 48, 80, 144, 272, 4096, 5120, 16, 48, 80, 128)
DTYPES = (torch.bfloat16, torch.bfloat16, torch.float16, torch.float32)


def assert_same_values(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    got, want = got.cpu(), want.cpu()
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"{label}: NaN at different places ({int(nan_g.sum())} vs {int(nan_w.sum())})"
    assert_bytes_equal(got[~nan_g], want[~nan_w], label)


def _placed(t: torch.Tensor, offset_elems: int) -> torch.Tensor:
    """`t` on the GPU at `offset_elems` elements into a fresh buffer (misaligned when offset != 0)."""
    buf = torch.empty(t.numel() + offset_elems, dtype=t.dtype, device=DEV)
    out = buf[offset_elems:].view(t.shape)
    out.copy_(t)
    return out


def _weight(rng: random.Random, gen: torch.Generator, m: int, k: int, kind: str):
    """(rowwise_data, rowwise_scale_inv, amax) on the CPU: a quantizer's output, or random bytes."""
    if kind == "quantized":
        q = fp4_dist.quantize(random_weight(m, k, heavy_tailed=rng.random() < 0.5, generator=gen))
        return q.rowwise_data, q.rowwise_scale_inv, q.amax
    data = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, rowwise_scale_shape(m, k), dtype=torch.uint8, generator=gen)
    if kind == "random-positive":
        scales &= 0x7F
        scales[scales == 0x7F] = 0x7E
    amax = torch.tensor([rng.choice([0.0, 1.0, 2688.0, 3.3e-3, 1e-30, 1e36, 3.4e38, abs(rng.gauss(0, 30))])])
    return data, scales, amax


def _case(seed: int, count: int, ks=KS, compact: float = 0.0):
    """`compact`: the share of weights given their scales as the compact tile grid (what FSDP2 gathers): the
    first row of each band of the row-expanded bytes."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cpu, gpu, outs, dtypes = [], [], [], []
    for i in range(count):
        k = rng.choice(ks)
        m = rng.randint(1, 40) if k >= 4096 else rng.randint(1, 90)
        kind = rng.choice(["quantized", "quantized", "random-positive", "random"])
        data, scales, amax = _weight(rng, gen, m, k, kind)
        if compact and (i == 0 or rng.random() < compact):  # the first always, so every case has one
            scales = scales[:m:16, : tile_grid(m, k)[1]].contiguous()
        dtype = rng.choice(DTYPES)
        cpu.append((data, scales, amax))
        gpu.append((_placed(data, rng.choice([0, 0, 0, 1, 2, 3])), scales.to(DEV), amax.to(DEV)))
        out = poison_(torch.empty(m * k + 8, dtype=dtype, device=DEV))
        off = rng.choice([0, 0, 0, 1, 3])  # 1, 3: output rows not 16-byte aligned
        outs.append(out[off: off + m * k].view(m, k))
        dtypes.append(dtype)
    return cpu, gpu, outs, dtypes


def _check(cpu, gpu, outs, dtypes, label):
    for i, ((d, s, a), (gd, gs, ga), out, dt) in enumerate(zip(cpu, gpu, outs, dtypes)):
        m, k = out.shape
        where = f"{label} weight {i} M{m}-K{k} {dt}"
        assert_same_values(out, R.dequantize(gd, gs, ga, dt), f"{where} vs reference on the GPU")
        assert_same_values(out, R.dequantize(d, s, a, dt), f"{where} vs reference on the CPU")


@pytest.mark.parametrize("seed", range(40))
def test_dequantize_matches_reference_on_random_lists(seed):
    cpu, gpu, outs, dtypes = _case(seed, random.Random(seed).randint(1, 8))
    K.dequantize(*zip(*gpu), outs)
    _check(cpu, gpu, outs, dtypes, f"seed {seed}")


@pytest.mark.parametrize("seed", range(20))
def test_compact_tile_scales_give_the_reference_values_mixed_with_row_expanded_ones(seed):
    cpu, gpu, outs, dtypes = _case(5000 + seed, random.Random(seed).randint(1, 8), compact=0.5)
    assert tuple(cpu[0][1].shape) == tile_grid(*outs[0].shape)
    K.dequantize(*zip(*gpu), outs)
    _check(cpu, gpu, outs, dtypes, f"seed {seed}, compact scales")


@pytest.mark.parametrize("count", [500, 137])
def test_hundreds_of_weights_take_one_launch(count, launches):
    keys = launches
    cpu, gpu, outs, dtypes = _case(9000 + count, count, ks=(16, 48, 80, 128, 144), compact=0.3)
    K.dequantize(*zip(*gpu), outs)
    assert keys == ["dequantize"]
    _check(cpu, gpu, outs, dtypes, f"{count} weights")


def test_every_scale_byte_and_code_with_extreme_amaxes():
    """A [16 * 256, 32] weight: row band b uses scale byte b, every byte holds all 16 codes x 16."""
    m, k = 16 * 256, 32
    codes = torch.arange(16, dtype=torch.uint8).repeat(m * k // 16)
    data = R.pack_nibbles(codes.view(m, k))
    scales = torch.zeros(rowwise_scale_shape(m, k), dtype=torch.uint8)
    scales[:m, :2] = torch.arange(256, dtype=torch.int64).repeat_interleave(16).view(-1, 1).to(torch.uint8)
    for amax in (0.0, 1.0, 2688.0, 1e-38, 1e-45, 5e36, 3.4028235e38):
        a = torch.tensor([amax])
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            out = poison_(torch.empty(m, k, dtype=dt, device=DEV))
            K.dequantize([data.to(DEV)], [scales.to(DEV)], [a.to(DEV)], [out])
            assert_same_values(out, R.dequantize(data.to(DEV), scales.to(DEV), a.to(DEV), dt), f"amax {amax} {dt}")
            assert_same_values(out, R.dequantize(data, scales, a, dt), f"amax {amax} {dt} (CPU reference)")


def test_bound_dequantize_matches_and_bumps_the_output_version():
    cpu, gpu, outs, dtypes = _case(4242, 30)
    run = K.bind_dequantize(*zip(*gpu), outs)
    before = [o._version for o in outs]
    run()
    assert all(o._version > b for o, b in zip(outs, before)), "a kernel write must bump the output's version"
    _check(cpu, gpu, outs, dtypes, "bound")


def test_weights_on_the_gpu_compute_on_their_copy_and_refresh_in_one_launch(launches):
    from fp4_dist.buffers import ShardBuffer, build_layout
    from fp4_dist.cast.sharded import ShardedCast
    from fp4_dist.tensor import NVFP4Tensor

    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    shapes = [(rng.randint(1, 40) * 2, rng.choice((16, 48, 80, 144, 4096))) for _ in range(60)]
    masters = [random_weight(m, k, generator=gen) for m, k in shapes]
    buf = ShardBuffer(build_layout([m * k for m, k in shapes], 1, align=64), 0, packed=True, device=DEV)
    ws = [NVFP4Tensor.empty(s, device=DEV) for s in shapes]
    for i, w in enumerate(ws):
        w.set_rowwise_storage(buf.param_view(i))
        buf.master_piece(i).copy_(masters[i].view(-1))
    cast = ShardedCast.from_buffer(ws, buf, columnwise=False)
    keys = launches
    keys.clear()
    for _ in range(2):
        keys.clear()
        cast.cast()
        cast.gather_scales()
        cast.after_gather()
        assert keys == ["partial_amax", "owner_scales", "partial_cast", "expand_scales", "dequantize"]
    keys.clear()
    x = torch.randn(8, shapes[0][1], device=DEV, dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, ws[0])
    assert keys == [], "a forward on a refreshed weight launches no dequantize"
    for i in range(0, len(ws), 7):
        ref = fp4_dist.quantize(masters[i].to(DEV).to(torch.bfloat16))
        assert_bytes_equal(ws[i].compute_value(), ref.dequantize(torch.bfloat16), f"weight {i} {shapes[i]} copy")
    assert_bytes_equal(y, x @ ws[0].dequantize(torch.bfloat16).t(), "forward on the copy")
