"""The CUDA NVFP4 1 x 16 quantization (kernels/cuda/nvfp4_1d.cu) against its PyTorch reference, bit for bit (GPU only):
codes, E4M3 scales and amax of rows and of wgrad operands (the padded transpose, read in place), round to nearest and
stochastic with a fixed seed (the CPU's bits), with and without the Hadamard transform; ragged shapes (1 row,
columns and tokens not multiples of 16, 64 or 128), bf16 / fp16 / fp32, strided views, amax 0, -0.0, inf and NaN;
the unscaled bf16 values of every code and scale. Outputs are poisoned before each kernel runs, so unwritten bytes
show."""

from __future__ import annotations

import random

import pytest
import torch

from fp4_dist.kernels import _launch, nvfp4_1d
from fp4_dist.kernels import nvfp4_1d_reference as R

pytestmark = pytest.mark.gpu

COLS = (1, 7, 16, 24, 40, 100, 127, 128, 144, 272, 1000, 1040, 4101)
ROWS = (1, 2, 3, 17, 37, 64, 130, 300)


def _case(seed: int, specials: bool = False) -> torch.Tensor:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows, cols = rng.choice(ROWS), rng.choice(COLS)
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    span = 10 if dtype == torch.float16 else 60  # a magnitude per row, 2^-span .. 2^span (fp16 stays finite)
    x = torch.randn(rows, cols, generator=g) * torch.ldexp(torch.ones(rows, 1), torch.randint(-span, span + 1,
                                                                                            (rows, 1), generator=g))
    if rng.random() < 0.3:
        x[rng.randrange(rows)] = 0.0  # all-zero blocks: scale 0, multiplier FLT_MAX
    if rng.random() < 0.3:
        x[rng.randrange(rows), rng.randrange(cols)] = -0.0
    if specials:
        x[rng.randrange(rows), rng.randrange(cols)] = rng.choice([float("inf"), -float("inf"), float("nan")])
    return x.to(dtype)


def _poisoned(rows: int, cols: int):
    data = torch.full((rows, -(-cols // 2)), 0xA5, dtype=torch.uint8, device="cuda")
    scales = torch.full((rows, -(-cols // 16)), 0x5A, dtype=torch.uint8, device="cuda")
    return data, scales


def _run(op: nvfp4_1d.Operand, flags: int, seed: int = 0, amax=None) -> R.Nvfp4Rows:
    """The two kernels on `op`, straight through the launchers, into poisoned outputs."""
    if amax is None:
        amax = torch.zeros(1, dtype=torch.float32, device="cuda")  # the amax kernel's contract: zero before
        if op.rows * op.out_cols:
            _launch.launch_amax_1x16(op, flags & ~nvfp4_1d.SR | (nvfp4_1d.Q_FAST if op.q_fast else 0), amax)
    data, scales = _poisoned(op.rows, op.out_cols)
    if op.rows * op.out_cols:
        _launch.launch_quantize_1x16(op, flags | (nvfp4_1d.Q_FAST if op.q_fast else 0), seed, amax, data, scales)
    return R.Nvfp4Rows(data, scales, amax, op.out_cols)


def _assert_same(got: R.Nvfp4Rows, want: R.Nvfp4Rows, label) -> None:
    assert got.cols == want.cols and got.data.shape == want.data.shape, label
    assert torch.equal(got.data.cpu(), want.data), (label, _first_difference(got.data.cpu(), want.data))
    assert torch.equal(got.scales.cpu(), want.scales), (label, _first_difference(got.scales.cpu(), want.scales))
    a, b = got.amax.cpu(), want.amax.reshape(1)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)) or (a.isnan().all() and b.isnan().all()), (label, a, b)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    return f"{len(diff)}/{a.numel()} bytes differ, first at {diff[0].tolist()}: {int(a[tuple(diff[0])])} vs " \
           f"{int(b[tuple(diff[0])])}" if len(diff) else "equal"  # fmt: skip


def _views(x: torch.Tensor) -> list[torch.Tensor]:
    """x on the GPU contiguous, with rows strided apart, shifted off 16-byte alignment, and transposed."""
    xg = x.cuda()
    wide = torch.cat([x, x], dim=1).cuda()
    views = [xg, wide[:, : x.shape[1]], xg.t()]
    if x.shape[1] > 1:
        views.append(wide[:, 1 : 1 + x.shape[1]])
    return views


@pytest.mark.parametrize("seed", range(32))
def test_rows_to_nearest_and_stochastic_give_the_references_bits(seed):
    x = _case(seed)
    for view in _views(x):
        cpu = view.cpu()
        label = (seed, view.dtype, list(view.shape), view.stride())
        _assert_same(_run(nvfp4_1d.rows_operand(view), 0), R.quantize_rows_1x16(cpu), label)
        _assert_same(_run(nvfp4_1d.rows_operand(view), nvfp4_1d.SR, seed=1000 + seed),
                     R.quantize_rows_1x16_sr(cpu, 1000 + seed), label)  # fmt: skip
        _assert_same(nvfp4_1d.quantize_rows_1x16(view), R.quantize_rows_1x16(cpu), label)  # the public call


@pytest.mark.parametrize("seed", range(32))
def test_wgrad_operands_with_and_without_the_transform_give_the_references_bits(seed):
    t = _case(seed)  # [tokens, cols]: the operand is pad16(t)^T, read in place
    for view in _views(t):
        cpu = view.cpu()
        for rht in (False, True):
            flags = nvfp4_1d.RHT if rht else 0
            label = (seed, rht, view.dtype, list(view.shape), view.stride())
            _assert_same(_run(nvfp4_1d.cols_operand(view), flags), R.quantize_cols_1x16(cpu, rht), label)
            _assert_same(_run(nvfp4_1d.cols_operand(view), flags | nvfp4_1d.SR, seed=seed),
                         R.quantize_cols_1x16_sr(cpu, rht, seed), label)  # fmt: skip
            _assert_same(nvfp4_1d.quantize_cols_1x16_sr(view, rht, seed), R.quantize_cols_1x16_sr(cpu, rht, seed),
                         label)  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_rows_through_the_transform_give_the_references_bits(seed):
    x = _case(seed)
    x = x.repeat(1, 16)[:, : 16 * max(1, x.shape[1] // 16)]  # whole 16-element groups
    for view in (x.cuda(), torch.cat([x, x], dim=1).cuda()[:, : x.shape[1]]):
        label = (seed, view.dtype, list(view.shape))
        want = R.rht_16(view.cpu().contiguous())
        _assert_same(_run(nvfp4_1d.rows_operand(view), nvfp4_1d.RHT), R.quantize_rows_1x16(want), label)
        _assert_same(_run(nvfp4_1d.rows_operand(view), nvfp4_1d.RHT | nvfp4_1d.SR, seed=3),
                     R.quantize_rows_1x16_sr(want, 3), label)  # fmt: skip


@pytest.mark.parametrize("seed", range(16))
def test_inf_nan_and_negative_zero_give_the_references_bits(seed):
    # one non-finite value makes the amax inf or NaN: every scale and code then follows the reference's NaN chain
    x = _case(seed, specials=True)
    cpu = x
    xg = x.cuda()
    _assert_same(_run(nvfp4_1d.rows_operand(xg), 0), R.quantize_rows_1x16(cpu), seed)
    _assert_same(_run(nvfp4_1d.rows_operand(xg), nvfp4_1d.SR, seed=seed), R.quantize_rows_1x16_sr(cpu, seed), seed)
    for rht in (False, True):
        flags = nvfp4_1d.RHT if rht else 0
        _assert_same(_run(nvfp4_1d.cols_operand(xg), flags), R.quantize_cols_1x16(cpu, rht), (seed, rht))
        _assert_same(_run(nvfp4_1d.cols_operand(xg), flags | nvfp4_1d.SR, seed=seed),
                     R.quantize_cols_1x16_sr(cpu, rht, seed), (seed, rht))  # fmt: skip


def test_an_all_zero_tensor_has_amax_zero_and_zero_codes_and_scales():
    for shape in ((1, 16), (5, 40), (33, 7)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.zeros(shape, dtype=dtype)
            x[0, 0] = -0.0
            _assert_same(_run(nvfp4_1d.rows_operand(x.cuda()), nvfp4_1d.SR, seed=1), R.quantize_rows_1x16_sr(x, 1),
                         shape)  # fmt: skip
            _assert_same(_run(nvfp4_1d.cols_operand(x.cuda()), nvfp4_1d.RHT), R.quantize_cols_1x16(x, True), shape)
    assert nvfp4_1d.quantize_rows_1x16(torch.zeros(0, 32, device="cuda")).data.shape == (0, 16)
    assert nvfp4_1d.quantize_cols_1x16(torch.zeros(0, 32, device="cuda"), True).data.shape == (32, 0)


def test_a_given_amax_is_used_as_the_reference_uses_it():
    x = _case(3).float()
    for amax in (float(x.abs().max()) * 4, float(x.abs().max()) / 8, 0.0):  # an all-reduced one, say
        a = torch.tensor([amax])
        _assert_same(nvfp4_1d.quantize_rows_1x16(x.cuda(), a.cuda()), R.quantize_rows_1x16(x, a), amax)
        _assert_same(nvfp4_1d.quantize_rows_1x16_sr(x.cuda(), 11, a.cuda()), R.quantize_rows_1x16_sr(x, 11, a), amax)


def test_one_amax_launch_and_one_quantize_launch_per_tensor_and_no_host_sync():
    t = torch.randn(300, 272, device="cuda", dtype=torch.bfloat16)
    nvfp4_1d.quantize_cols_1x16_sr(t, True, 1)  # compiled before the sync check
    with _launch.LaunchCounter() as counter:
        torch.cuda.set_sync_debug_mode("error")
        try:
            q = nvfp4_1d.quantize_cols_1x16_sr(t, True, 1)
            nvfp4_1d.quantize_rows_1x16(t)
            u = nvfp4_1d.unscaled_values(q)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert counter.keys == ["amax_1x16", "quantize_1x16", "amax_1x16", "quantize_1x16", "unscaled_bf16"]
    assert u.shape == (272, 304) and u.dtype == torch.bfloat16


def _all_codes_and_scales() -> R.Nvfp4Rows:
    """Rows r = 0..127 holding the codes 0..15 with the E4M3 scale byte r (127: NaN)."""
    codes = torch.arange(16, dtype=torch.uint8)
    data = (codes[0::2] | codes[1::2] << 4).repeat(128, 1)
    return R.Nvfp4Rows(data, torch.arange(128, dtype=torch.uint8)[:, None], torch.ones(1), 16)


def _assert_unscaled(q: R.Nvfp4Rows, label, scale_pad: int = 0) -> None:
    want = R.unscaled_values(q).to(torch.bfloat16)
    out = torch.full((q.data.shape[0], q.cols), -7.0, dtype=torch.bfloat16, device="cuda")  # poisoned
    dg = q.data.cuda()
    # scale_pad: the scales read through a longer row stride, as a weight's padded rowwise_scale_inv is
    sg = torch.cat([q.scales, q.scales[:, :1].expand(-1, scale_pad)], dim=1).cuda()[:, : q.scales.shape[1]]
    _launch.launch_unscaled_bf16(dg, sg, q.data.shape[0], q.cols, out)
    got = out.cpu()
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert same.all(), (label, _first_difference(got.view(torch.int16), want.view(torch.int16)))


def test_the_unscaled_values_of_every_code_and_scale_are_exact_in_bf16():
    q = _all_codes_and_scales()
    _assert_unscaled(q, "all")
    assert torch.equal(R.unscaled_values(q)[:127].to(torch.bfloat16).float(), R.unscaled_values(q)[:127])


@pytest.mark.parametrize("seed", range(12))
def test_the_unscaled_values_of_quantized_tensors_equal_the_references(seed):
    x = _case(seed)
    q = R.quantize_rows_1x16_sr(x, seed)
    _assert_unscaled(q, seed)
    _assert_unscaled(q, (seed, "strided scales"), scale_pad=3)
    u = nvfp4_1d.unscaled_values(R.Nvfp4Rows(q.data.cuda(), q.scales.cuda(), q.amax.cuda(), q.cols))
    assert torch.equal(u.cpu().float().nan_to_num(7.0), R.unscaled_values(q).nan_to_num(7.0))
