"""The CUDA FP8 block copy of an NVFP4 weight (kernels/cuda/fp8_block.cu) against its PyTorch reference, bit for bit
(GPU only): ragged weights (M and K not multiples of 128, K % 64 != 0), blocks of every magnitude with normal,
subnormal and zero tile scales, compact and row-expanded tile scales, weights that trained; outputs poisoned before
the kernel runs, so unwritten bytes show."""

from __future__ import annotations

import random

import pytest
import torch

from fp4_dist.compute.fp8_gemm import _block_scales
from fp4_dist.format import FP8_BLOCK, ceil_div
from fp4_dist.kernels import _launch, fp8_block
from fp4_dist.kernels import reference as nvfp4
from fp4_dist.kernels.fp8_block_reference import fp8_block_copy, pow2
from fp4_dist.testing import extreme_nvfp4_bytes

pytestmark = pytest.mark.gpu

SIDES = (16, 32, 48, 112, 128, 144, 272, 400, 1040)


def _weight(seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    m, k = rng.choice(SIDES) + rng.choice((0, 1, 7)), rng.choice(SIDES)
    w = torch.randn(m, k, generator=g)
    if rng.random() < 0.7:  # one magnitude per 16 x 16 tile, 2^-20 to 2^20: some tile scales subnormal or zero
        e = torch.randint(-20, 21, (ceil_div(m, 16), ceil_div(k, 16)), generator=g)
        w = w * pow2(e).repeat_interleave(16, 0)[:m].repeat_interleave(16, 1)[:, :k]
    if rng.random() < 0.2:
        w[: rng.randrange(m + 1)] = 0.0  # whole zero blocks
    return w.to(rng.choice([torch.bfloat16, torch.float32]))


def _poisoned(m: int, k: int):
    bits = torch.full((m, k), 0xA5, dtype=torch.uint8, device="cuda")
    scales = torch.full((ceil_div(m, FP8_BLOCK), ceil_div(k, FP8_BLOCK)), -1.25, dtype=torch.float32, device="cuda")
    return bits, scales


def _check(data, scale_inv, amax, label):
    want_bits, want_scales = fp8_block_copy(data, scale_inv, amax)
    m, k = want_bits.shape
    bits, scales = _poisoned(m, k)
    tile_rows = scale_inv if scale_inv.shape[0] < m else scale_inv[::16]  # as the wrapper passes them
    _launch.launch_fp8_block_copy(data.cuda(), tile_rows.cuda(), 16, m, k, amax.float().cuda(), bits, scales)
    assert torch.equal(bits.cpu(), want_bits), label
    assert torch.equal(scales.cpu().view(torch.int32), want_scales.view(torch.int32)), label
    for variant in VARIANTS:  # the whole operand a weight update makes: copy, transpose, cuBLAS's scales
        out = _poisoned_operand(m, k)
        got = fp8_block.fp8_block_operand(data.cuda(), scale_inv.cuda(), amax.float().cuda(), out=out,
                                          variant=variant)  # fmt: skip
        assert all(g is o for g, o in zip(got, out)), "written in place"
        _assert_operand(got, want_bits, want_scales, (label, variant))


VARIANTS = ("fused", "split")


def _poisoned_operand(m: int, k: int) -> fp8_block.BlockOperand:
    out = fp8_block.block_operand_empty(m, k, "cuda")
    for t in out:
        t.fill_(0xA5 if t.dtype == torch.uint8 else -1.25)
    return out


def _assert_operand(got: fp8_block.BlockOperand, want_bits, want_scales, label) -> None:
    m, k = want_bits.shape
    kg, rg = ceil_div(k, FP8_BLOCK), ceil_div(m, FP8_BLOCK)
    assert torch.equal(got.bits.cpu(), want_bits), label
    assert torch.equal(got.scales.cpu().view(torch.int32), want_scales.view(torch.int32)), label
    assert torch.equal(got.bits_t.cpu(), want_bits.t()), label
    laid_out = (_block_scales(want_scales, m, kg), _block_scales(want_scales.t(), k, rg))
    for g, w in zip((got.cublas_scales, got.cublas_scales_t), laid_out):
        assert g.shape == w.shape and g.stride() == w.stride(), label
        assert torch.equal(g.cpu().view(torch.int32), w.view(torch.int32)), label


@pytest.mark.parametrize("seed", range(30))
def test_the_kernel_gives_the_references_bits(seed):
    w = _weight(seed)
    data, expanded, amax, compact = nvfp4.quantize(w.float())
    for form, scales in (("expanded", expanded), ("tile grid", compact)):
        _check(data, scales, amax, (seed, form, list(w.shape)))


def test_the_wrapper_serves_both_scale_forms_and_refuses_what_it_cannot_read():
    w = torch.randn(300, 400)
    data, expanded, amax, compact = nvfp4.quantize(w)
    want = fp8_block_copy(data, expanded, amax)
    for scales in (expanded, compact):
        got = fp8_block.fp8_block_copy(data.cuda(), scales.cuda(), amax.cuda())
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    with pytest.raises(ValueError, match="do not cover"):
        fp8_block.fp8_block_copy(data.cuda(), compact[:-1].cuda(), amax.cuda())
    with pytest.raises(ValueError, match="CUDA"):
        fp8_block.fp8_block_copy(data, expanded, amax)


def test_a_trained_weight_gives_the_references_bits():
    # weights as training leaves them: heavy-tailed rows and columns, a few outliers
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1024, 1040, generator=g) * torch.randn(1, 1040, generator=g).abs() * 0.02
    w[torch.randint(0, 1024, (20,), generator=g), torch.randint(0, 1040, (20,), generator=g)] = 0.5
    data, expanded, amax, _ = nvfp4.quantize(w)
    _check(data, expanded, amax, "trained-like")


@pytest.mark.parametrize("seed", range(6))
def test_bytes_of_every_kind_give_the_references_bits(seed):
    # random codes under tile scales from the smallest subnormal to 448, ragged edges: the largest and the finest
    # values of the format in one block, where the errors' sums span the most bits
    data, tiles = extreme_nvfp4_bytes(seed, 272, 400)
    amax = torch.tensor([0.0 if seed == 0 else float(2.0 ** (seed * 9 - 30))])  # zero, tiny (subnormal scales), large
    _check(data[:263], tiles[:17], amax, seed)


@pytest.mark.parametrize("shape", [(16, 16), (48, 4096), (4096, 48), (208, 336), (1040, 272)])
def test_the_byte_transpose_equals_torchs(shape):
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    out = torch.full((shape[1], shape[0]), 0xA5, dtype=torch.uint8, device="cuda")  # poisoned
    _launch.launch_transpose_bytes(x, out)
    assert torch.equal(out, x.t().contiguous())


@pytest.mark.parametrize("shape", [(512, 384), (300, 272), (131, 48), (1040, 4096)])
def test_the_operand_is_rewritten_in_place_as_a_new_one(shape):
    # a kept copy remade after a weight update: the same addresses, the bytes of a copy made anew
    g = torch.Generator().manual_seed(shape[0])
    first, second = (nvfp4.quantize(torch.randn(*shape, generator=g) * s) for s in (1.0, 1e-3))
    out = fp8_block.fp8_block_operand(*(t.cuda() for t in (first[0], first[1], first[2])))
    addresses = [t.data_ptr() for t in out]
    data, scales, amax = (t.cuda() for t in (second[0], second[3], second[2]))  # the compact tile grid this time
    fp8_block.fp8_block_operand(data, scales, amax, out=out)
    assert [t.data_ptr() for t in out] == addresses
    _assert_operand(out, *fp8_block_copy(second[0], second[3], second[2]), shape)
    with pytest.raises(ValueError, match="out.bits_t"):
        fp8_block.fp8_block_operand(data, scales, amax, out=out._replace(bits_t=out.bits_t.t()))
