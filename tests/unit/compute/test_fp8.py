"""The FP8 compute mode's operands and emulated GEMMs (`fp4_dist.compute.fp8`, `fp4_dist.kernels.fp8_rows_reference`):
1 x 128 quantization against the spec oracle's E4M3 search, the block-scaled GEMM against float64 products of the
same operands, and the linear's forward and backward against the same formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist
from fp4_dist.compute.fp8 import Fp8Operand, fp8_linear
from fp4_dist.compute.fp8_gemm import emulated_mm
from fp4_dist.kernels.fp8_block_reference import fp8_block_values
from fp4_dist.kernels.fp8_rows_reference import quantize_rows_1x128, rows_1x128_values
from tests.unit import spec_oracle


def _oracle_rows(x: torch.Tensor):
    """Bits and scales by the docstring's rule, group by group in float64, E4M3 by the spec oracle's table search."""
    v = x.double().numpy()
    r, c = v.shape
    bits, scales = np.zeros((r, c), np.uint8), np.zeros((r, -(-c // 128)), np.float64)
    for i in range(r):
        for g in range(scales.shape[1]):
            group = v[i, g * 128:(g + 1) * 128]
            top = np.abs(group).max()
            k = 0
            if top > 0:
                k = math.frexp(top)[1] - 10
                while top > 448 * 2.0**k:
                    k += 1
            k = max(k, -126)
            scales[i, g] = 2.0**k
            codes = spec_oracle.e4m3_code(np.abs(group) / 2.0**k)
            bits[i, g * 128:(g + 1) * 128] = codes | ((group < 0).astype(np.uint8) << 7)
    return torch.from_numpy(bits), torch.from_numpy(scales).float()


@pytest.mark.parametrize("shape", [(5, 300), (3, 128), (1, 16)])
def test_1x128_quantization_equals_the_oracle(shape):
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 4)).to(torch.bfloat16)
    x[0, :5] = 0
    x[-1, -3:] = torch.tensor([1e-30, -1e-30, 3e30])  # a group far from the rest
    bits, scales = quantize_rows_1x128(x)
    want_bits, want_scales = _oracle_rows(x)
    assert torch.equal(bits, want_bits) and torch.equal(scales, want_scales)
    assert (rows_1x128_values(bits, scales) - x.float()).abs().max() <= x.float().abs().max() * 2.0**-4


def test_1x128_groups_of_zeros_and_of_non_finite_values():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, 130] = float("nan")
    x[1, 5] = 2.0
    bits, scales = quantize_rows_1x128(x)
    assert scales[0].tolist() == [1.0, 1.0] and not bits[0].any()
    assert scales[1, 0].item() == 2.0**-7 and math.isnan(scales[1, 1].item())  # 2 <= 448 * 2^-7
    with pytest.raises(ValueError, match="must be 2D"):
        quantize_rows_1x128(x.view(2, 2, 128))


def test_the_emulated_block_scaled_mm_is_the_product_of_its_operands_values():
    g = torch.Generator().manual_seed(1)
    a = Fp8Operand.rows(torch.randn(70, 400, generator=g).to(torch.bfloat16))
    lin = nn.Linear(400, 200, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin)
    w = Fp8Operand.weight(lin.weight)
    want = rows_1x128_values(a.bits, a.scales).double() @ fp8_block_values(w.bits, w.scales).double().t()
    got = emulated_mm(a, w)
    assert got.dtype == torch.float32 and got.shape == (70, 200)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    b = Fp8Operand.rows(torch.randn(90, 400, generator=g))
    want = rows_1x128_values(a.bits, a.scales).double() @ rows_1x128_values(b.bits, b.scales).double().t()
    assert ((emulated_mm(a, b).double() - want).norm() / want.norm()).item() < 1e-6
    with pytest.raises(ValueError, match="K differ"):
        emulated_mm(a, Fp8Operand.rows(torch.randn(4, 128)))
    with pytest.raises(ValueError, match="does not transpose"):
        a.t()


def test_the_fp8_linear_computes_forward_dgrad_and_wgrad_from_the_fp8_operands():
    torch.manual_seed(2)
    lin = nn.Linear(272, 144, bias=True).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin)
    w = lin.weight
    x = torch.randn(2, 65, 272, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x, w, lin.bias)
    dy = torch.randn_like(y)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(-1, 272), dy.reshape(-1, 144)
    copy = Fp8Operand.weight(w)
    assert torch.equal(y.detach(), (emulated_mm(Fp8Operand.rows(x2), copy).to(torch.bfloat16) + lin.bias.detach())
                       .view(2, 65, 144))  # fmt: skip
    assert torch.equal(x.grad.reshape(-1, 272), emulated_mm(Fp8Operand.rows(dy2), copy.t()).to(torch.bfloat16))
    wgrad = emulated_mm(Fp8Operand.rows(dy2.t()), Fp8Operand.rows(x2.t())).to(torch.bfloat16)
    assert type(w.grad) is torch.Tensor and torch.equal(w.grad, wgrad)
    assert torch.equal(lin.bias.grad, dy2.sum(0))

    # against the bf16 GEMMs on the NVFP4 values: FP8's rounding of activations and gradients, a few percent
    ref_x = x.detach().clone().requires_grad_()
    ref_w = w.dequantize(torch.bfloat16).detach().requires_grad_()
    F.linear(ref_x, ref_w, lin.bias.detach()).backward(dy)
    for got, ref in ((y.detach(), F.linear(ref_x, ref_w, lin.bias).detach()), (x.grad, ref_x.grad),
                     (w.grad, ref_w.grad)):  # fmt: skip
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 0.06


def test_the_fp8_linears_output_takes_in_place_ops_and_an_empty_input_gives_zero_gradients():
    # Megatron's MoE experts add their bias to their linear's output in place (a view made inside an autograd
    # Function refuses that), and an expert may get no tokens
    torch.manual_seed(3)
    lin = nn.Linear(272, 144, bias=True).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin)
    x = torch.randn(2, 65, 272, dtype=torch.bfloat16)
    dy = torch.randn(2, 65, 144, dtype=torch.bfloat16)
    grads = []
    for in_place in (False, True):
        xi = x.clone().requires_grad_()
        y = fp8_linear(xi, lin.weight, lin.bias)
        before = y.detach().clone()
        if in_place:
            y += 1.0
            assert torch.equal(y.detach(), before + 1.0)
        y.backward(dy)
        grads.append((before, xi.grad, lin.weight.grad, lin.bias.grad))
        lin.weight.grad = lin.bias.grad = None
    for plain, added in zip(*grads):  # the same output (less the 1.0) and the same gradients, bit for bit
        assert torch.equal(plain, added)

    empty = torch.zeros(0, 272, dtype=torch.bfloat16, requires_grad=True)
    out = fp8_linear(empty, lin.weight)
    out.sum().backward()
    assert out.shape == (0, 144) and empty.grad.shape == (0, 272)
    assert torch.equal(lin.weight.grad, torch.zeros(144, 272, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(200, 304), (131, 48), (1024, 640), (16, 1408)])
def test_a_weight_copys_prepared_cublas_scales_are_what_each_gemm_would_make_of_its_scales(shape):
    # a weight copy carries its block scales as cuBLAS reads them, for itself and its transpose (the dgrad's); a
    # GEMM reads those instead of laying the scales out again: they must be that layout, value for value and
    # stride for stride, or cuBLAS reads a scale from the wrong block
    from fp4_dist.compute.fp8_gemm import _ROWS_ALIGN, _cublas_operand
    from fp4_dist.kernels import reference
    from fp4_dist.kernels.fp8_block_reference import fp8_block_copy

    m, k = shape
    g = torch.Generator().manual_seed(m + k)
    data, scales, amax, _ = reference.quantize(torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k))
    plain = Fp8Operand(*fp8_block_copy(data, scales, amax), blocks=True)
    prepared = plain.with_cublas_scales()
    for a, b in ((plain, prepared), (plain.t(), prepared.t())):
        rows, k_groups = -(-a.bits.shape[0] // _ROWS_ALIGN) * _ROWS_ALIGN, -(-a.bits.shape[1] // 128)
        want, got = _cublas_operand(a, rows, k_groups)[1], _cublas_operand(b, rows, k_groups)[1]
        assert b.cublas_scales is got and torch.equal(got, want) and got.stride() == want.stride()
        assert torch.equal(a.scales, b.scales)  # what the emulation reads stays as it was
    with pytest.raises(ValueError, match="block operand"):
        Fp8Operand.rows(torch.randn(4, 128)).with_cublas_scales()


@pytest.mark.parametrize("m, k", [(40, 6), (48, 100), (1, 32), (16, 128), (131, 48), (200, 304), (130, 1408),
                                  (512, 16)])
def test_the_scales_handed_to_cublas_have_the_strides_torch_checks_also_along_a_dimension_of_one(m, k):
    # torch's sm_90 recipes check the scales' strides as numbers: 1 x 128 scales [rows, K groups] with strides
    # (1, rows), block scales [K blocks padded to 4, row blocks] with strides (1, K blocks padded to 4), also where
    # a dimension is 1 (one contraction group, one row block), where a contiguous tensor's stride is 1
    from fp4_dist.compute.fp8_gemm import _ROWS_ALIGN, _cublas_operand
    from fp4_dist.kernels import reference
    from fp4_dist.kernels.fp8_block_reference import fp8_block_copy

    g = torch.Generator().manual_seed(m * 1000 + k)
    rows, k_groups = -(-m // _ROWS_ALIGN) * _ROWS_ALIGN, -(-k // 128)
    a = Fp8Operand.rows(torch.randn(m, k, generator=g))
    _, scales, _ = _cublas_operand(a, rows, k_groups)
    assert scales.shape == (rows, k_groups) and scales.stride() == (1, rows)
    assert torch.equal(scales[:m], a.scales) and not scales[m:].any()  # padded rows read scale 0
    data, bscales, amax, _ = reference.quantize(torch.randn(m, k, generator=g))
    w = Fp8Operand(*fp8_block_copy(data, bscales, amax), blocks=True)
    for op, r, kg in ((w, rows, k_groups), (w.t(), -(-k // _ROWS_ALIGN) * _ROWS_ALIGN, -(-m // 128))):
        for s in (_cublas_operand(op, r, kg)[1], _cublas_operand(op.with_cublas_scales(), r, kg)[1]):
            padded_k = -(-kg // 4) * 4
            assert s.shape == (padded_k, -(-r // 128)) and s.stride() == (1, padded_k)
            held = op.scales.t()  # [K blocks, row blocks]: what the padding surrounds
            padding = s.clone()
            padding[: held.shape[0], : held.shape[1]] = 0
            assert torch.equal(s[: held.shape[0], : held.shape[1]], held) and not padding.any()
