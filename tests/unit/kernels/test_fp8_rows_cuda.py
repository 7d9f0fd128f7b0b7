"""The CUDA 1 x 128 FP8 quantization (kernels/cuda/fp8_rows.cu) against its PyTorch reference, bit for bit (GPU only):
ragged rows and groups, bf16 / fp16 / fp32, row-major and transposed views, magnitudes from subnormal to near
FLT_MAX, zeros, negative zero, inf and NaN; outputs poisoned before the kernel runs, so unwritten bytes show."""

from __future__ import annotations

import random

import pytest
import torch

from fp4_dist.kernels import _launch, fp8_rows
from fp4_dist.kernels.fp8_rows_reference import quantize_rows_1x128

pytestmark = pytest.mark.gpu

COLS = (1, 16, 100, 127, 128, 129, 272, 300, 1000, 1040, 4096, 4101)  # multiples of 16: the 16-byte path


def _case(seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows, cols = rng.randint(1, 90), rng.choice(COLS)
    # one magnitude per row, 2^-140 (subnormal) to 2^120
    x = torch.randn(rows, cols, generator=g) * torch.ldexp(torch.ones(rows, 1), torch.randint(-140, 121, (rows, 1),
                                                                                            generator=g))  # fmt: skip
    for _ in range(rng.randint(0, 4)):  # specials, each somewhere
        x[rng.randrange(rows), rng.randrange(cols)] = rng.choice([0.0, -0.0, float("inf"), -float("inf"),
                                                                  float("nan"), 3.0e38, 1e-45])  # fmt: skip
    if rng.random() < 0.3:
        x[rng.randrange(rows)] = 0.0
    return x.to(rng.choice([torch.bfloat16, torch.float16, torch.float32]))


def _poisoned(rows: int, cols: int):
    bits = torch.full((rows, cols), 0xA5, dtype=torch.uint8, device="cuda")
    scales = fp8_rows.scales_buffer(rows, cols, "cuda").fill_(-1.25)
    return bits, scales


@pytest.mark.parametrize("seed", range(40))
def test_every_kernel_gives_the_references_bits(seed):
    xg = _case(seed).cuda()
    # row-major (the aligned fast path where it applies), the transpose (the weight gradient's operands, through
    # shared memory), and an unaligned slice; each also through the any-strides kernel
    views = [xg, xg.t()] + ([xg[:, 1:]] if xg.shape[1] > 1 else [])
    for view in views:
        want_bits, want_scales = quantize_rows_1x128(view.cpu())
        for name in sorted({fp8_rows.path(view), "strided"}):
            bits, scales = _poisoned(*view.shape)
            fp8_rows.LAUNCHERS[name](view, bits, scales)
            label = (seed, name, view.dtype, list(view.shape), view.stride())
            assert torch.equal(bits.cpu(), want_bits), label
            assert torch.equal(scales.cpu().view(torch.int32), want_scales.view(torch.int32)), label


def test_each_layout_takes_its_kernel():
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    assert fp8_rows.path(x) == "rows" and fp8_rows.path(x.t()) == "transposed"
    assert fp8_rows.path(x[:, 1:]) == "strided" and fp8_rows.path(x[:, :100]) == "strided"
    assert fp8_rows.path(x[::2]) == "rows"  # rows 512 elements apart: still aligned


VARIANTS = sorted(_launch.BOTH_1X128_VARIANTS)  # every both-ways kernel, the default and the others


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", range(40))
def test_both_ways_in_one_read_give_the_references_bits(seed, variant):
    # an activation's forward and weight-gradient operands (or an output gradient's) from one read of it
    x = _case(seed)
    if x.dtype == torch.float32:
        x = x.to(random.Random(seed).choice([torch.bfloat16, torch.float16]))
    for xg in (x.cuda(), torch.cat([x, x], dim=1).cuda()[:, : x.shape[1]]):  # contiguous, and rows strided apart
        (bits, scales), (bits_t, scales_t) = _poisoned(*x.shape), _poisoned(x.shape[1], x.shape[0])
        _launch.launch_both_1x128(xg, bits, scales, bits_t, scales_t, variant=variant)
        for got_bits, got_scales, view in ((bits, scales, x), (bits_t, scales_t, x.t())):
            want_bits, want_scales = quantize_rows_1x128(view)
            assert torch.equal(got_bits.cpu(), want_bits), (seed, list(view.shape), xg.stride())
            assert torch.equal(got_scales.cpu().view(torch.int32), want_scales.view(torch.int32)), seed
    assert fp8_rows.quantize_both(x.float().cuda())[1][0].shape == (x.shape[1], x.shape[0])  # fp32: two launches


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", range(16))
def test_both_ways_over_whole_tiles_give_the_references_bits(seed, variant):
    # whole 128 x 128 tiles of an aligned x are read in 16-byte loads (and, but for "tile", quantized 16 values a
    # thread), the ragged edge and unaligned x element by element: both, side by side in one launch
    rng = random.Random(seed)
    rows, cols = rng.choice([128, 256, 264, 300, 2048]), rng.choice([128, 384, 400, 1024, 1040])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.ldexp(torch.ones(rows, 1), torch.randint(-30, 30, (rows, 1),
                                                                                            generator=g))  # fmt: skip
    for _ in range(rng.randint(1, 6)):  # specials in whole tiles: NaN and inf groups, signed zeros, extremes
        x[rng.randrange(rows), rng.randrange(cols)] = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0,
                                                                  -0.0, 6.0e4, -3.0e38, 1e-45, -1e-40])  # fmt: skip
    x[rng.randrange(rows)] = -0.0  # a row of negative zeros: groups along it and across it
    x[:, rng.randrange(cols)] *= 2.0**-120  # a column of tiny values (subnormal E4M3 codes, and zeros)
    x = x.to(rng.choice([torch.bfloat16, torch.float16]))
    wide = torch.cat([x, x], dim=1).cuda()
    for xg in (x.cuda(), wide[:, :cols], wide[:, 8:8 + cols], wide[:, 1:1 + cols]):  # aligned; rows apart; 16 B off;
        (bits, scales), (bits_t, scales_t) = _poisoned(rows, cols), _poisoned(cols, rows)  # 2 B off: unaligned
        _launch.launch_both_1x128(xg, bits, scales, bits_t, scales_t, variant=variant)
        values = xg.cpu()  # what each view holds (the shifted ones: other columns of x)
        for got_bits, got_scales, view in ((bits, scales, values), (bits_t, scales_t, values.t())):
            want_bits, want_scales = quantize_rows_1x128(view)
            assert torch.equal(got_bits.cpu(), want_bits), (seed, list(view.shape), xg.stride(), xg.data_ptr() % 16)
            assert torch.equal(got_scales.cpu().view(torch.int32), want_scales.view(torch.int32)), seed


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_ways_over_more_tiles_than_resident_blocks_give_the_references_bits(variant):
    # 4096 x 2048: 512 tiles, more than the "stream" kernel's blocks, so each of its blocks takes several (and
    # loads each next one while it quantizes the current one)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(4096, 2048, generator=g) * torch.logspace(-6, 6, 2048)).to(torch.bfloat16)
    x[17, 300], x[1000, 5], x[4000, 2047] = float("nan"), -float("inf"), -0.0
    (bits, scales), (bits_t, scales_t) = _poisoned(4096, 2048), _poisoned(2048, 4096)
    _launch.launch_both_1x128(x.cuda(), bits, scales, bits_t, scales_t, variant=variant)
    for got_bits, got_scales, view in ((bits, scales, x), (bits_t, scales_t, x.t())):
        want_bits, want_scales = quantize_rows_1x128(view)
        assert torch.equal(got_bits.cpu(), want_bits), (variant, list(view.shape))
        assert torch.equal(got_scales.cpu().view(torch.int32), want_scales.view(torch.int32)), variant
