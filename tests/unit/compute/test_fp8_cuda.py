"""The FP8 compute mode on a GPU (GPU only): on Hopper, cuBLAS's block-scaled GEMMs against the CPU emulation of
the same operands on ragged shapes, and a converted layer's forward and backward against the same layer on the
CPU; on any other GPU, the refusal."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.compute import fp8_gemm
from fp4_dist.compute.fp8 import Fp8Operand
from fp4_dist.compute.fp8_gemm import cublas_mm, disagreement, emulated_mm, require_fp8_gemm

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="cuBLAS's 1 x 128 / 128 x 128 FP8 GEMMs run on sm_90 only")


@needs_hopper
@pytest.mark.parametrize("seed", range(12))
def test_cublas_block_scaled_gemms_equal_the_emulation_on_ragged_shapes(seed):
    rng = random.Random(seed)
    m, n, k = rng.randint(1, 300), rng.randint(1, 300), rng.choice([16, 128, 144, 272, 384, 1008])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin)
    cases = [(Fp8Operand.rows(x), Fp8Operand.weight(lin.weight)),  # forward
             (Fp8Operand.rows(torch.randn(m, n, generator=g)), Fp8Operand.weight(lin.weight).t()),  # dgrad
             (Fp8Operand.rows(x.t().contiguous()), Fp8Operand.rows(torch.randn(n, m, generator=g)))]  # wgrad-shaped
    w = Fp8Operand.weight(lin.weight)
    prepared = Fp8Operand(w.bits.cuda(), w.scales.cuda(), True).with_cublas_scales()  # as a copy on a GPU is
    for (a, b), b_prepared in zip(cases, (prepared, prepared.t(), None)):
        want = emulated_mm(a, b)
        a_gpu = Fp8Operand(*(t.cuda() for t in a[:2]), a.blocks)
        got = cublas_mm(a_gpu, Fp8Operand(*(t.cuda() for t in b[:2]), b.blocks), torch.bfloat16)
        assert got.shape == want.shape and disagreement(got.cpu(), a, b, torch.bfloat16) is None
        if b_prepared is not None:  # the scales laid out once with the copy: the same GEMM, the same bits
            assert torch.equal(cublas_mm(a_gpu, b_prepared, torch.bfloat16), got)


# one contraction group for the weight gradient (tokens <= 128) with rows padded to 16 (40 -> 48): the scales'
# strides torch checks along a dimension of size 1
@needs_hopper
@pytest.mark.parametrize("k, n, tokens", [(272, 200, (3, 45)), (96, 40, (6,)), (48, 24, (1, 5)), (128, 16, (130,))])
def test_a_converted_layer_on_hopper_computes_what_the_cpu_emulation_does(k, n, tokens):
    require_fp8_gemm("cuda")
    here = torch.device("cuda", torch.cuda.current_device())
    report = fp8_gemm.DEVICES[here]
    assert report.rows_kernel and report.block_kernel  # the kernels quantize and copy here
    torch.manual_seed(0)
    cpu = nn.Linear(k, n).to(torch.bfloat16)
    gpu = nn.Linear(k, n).to(torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    fp4_dist.convert_linear_weights(cpu, compute="fp8")
    fp4_dist.convert_linear_weights(gpu.cuda(), compute="fp8")
    assert torch.equal(cpu.weight.rowwise_data, gpu.weight.rowwise_data.cpu())
    x = torch.randn(*tokens, k, dtype=torch.bfloat16)
    dy = torch.randn(*tokens, n, dtype=torch.bfloat16)
    outs = {}
    for name, layer, dev in (("cpu", cpu, "cpu"), ("gpu", gpu, "cuda")):
        xi = x.to(dev).detach().requires_grad_()  # a leaf on each device
        y = layer(xi)
        y.backward(dy.to(dev))
        outs[name] = (y.detach().cpu(), xi.grad.cpu(), layer.weight.grad.cpu())
    # the same operands; only the order of additions and a bf16 rounding differ (a misread scale is off by far more)
    for got, want in zip(outs["gpu"], outs["cpu"]):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or HOPPER, reason="a GPU other than sm_90")
def test_other_gpus_refuse_the_mode_before_converting_anything():
    lin = nn.Linear(64, 32).cuda().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        fp4_dist.convert_linear_weights(lin, compute="fp8")
    assert type(lin.weight.data) is torch.Tensor


@needs_hopper
def test_on_hopper_the_output_takes_in_place_ops_and_an_expert_without_tokens_gets_zero_gradients():
    # Megatron's MoE experts add their bias to the linear's output in place; an expert may get no tokens (cuBLAS
    # is not asked for an empty product)
    torch.manual_seed(4)
    lin = nn.Linear(272, 144, bias=False).cuda().to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin, compute="fp8")
    x = torch.randn(2, 65, 272, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    y = lin(x)
    want = y.detach().clone()
    y += 1.0
    y.backward(torch.ones_like(y))
    assert torch.equal(y.detach(), want + 1.0) and x.grad.shape == x.shape
    lin.weight.grad = None
    empty = torch.zeros(0, 272, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = lin(empty)
    out.sum().backward()
    assert out.shape == (0, 144) and empty.grad.shape == (0, 272)
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight.grad)) and lin.weight.grad.shape == (144, 272)


@needs_hopper
def test_under_deterministic_mode_a_layer_launches_no_fills_and_computes_the_same_bits():
    # Megatron's --deterministic-mode makes torch.empty fill new memory; the mode's quantization, transposes and
    # GEMMs write their outputs whole, so they skip that fill (9 ms of a GPT 4096 step) and give the same bits.
    # Every contraction here is a multiple of 128: a ragged one is zero-padded for cuBLAS, a fill that is data.
    torch.manual_seed(5)
    lin = nn.Linear(384, 256, bias=False).cuda().to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin, compute="fp8")
    x = torch.randn(2, 64, 384, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(2, 64, 256, dtype=torch.bfloat16, device="cuda")

    def step():
        xi = x.detach().requires_grad_()
        lin.weight.grad = None
        y = lin(xi)
        y.backward(dy)
        return y.detach(), xi.grad, lin.weight.grad

    want = step()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        step()  # the weight's copy is made at its first use; the next call is the steady state
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = step()
            torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    fills = [e.name for e in prof.events() if "Fill" in e.name and e.device_type == torch.autograd.DeviceType.CUDA]
    assert fills == [], fills[:3]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_hopper
@pytest.mark.parametrize("k, n", [(272, 200), (4096, 1024), (160, 48)])
def test_without_a_kept_transpose_the_dgrad_transposes_per_use_and_computes_the_same_bits(k, n):
    # Fp8Options(keep_transpose=False): the kept copy holds no transpose (1 byte per weight less), each dgrad makes
    # one; the GEMMs read the same bits, so the outputs and gradients are equal bit for bit, and after a weight
    # update the copy is rewritten in place by the same one launch
    from fp4_dist.compute import fp8_copy
    from fp4_dist.compute.fp8 import Fp8Options

    torch.manual_seed(6)
    layers = [nn.Linear(k, n, bias=False).to(torch.bfloat16).cuda() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    fp4_dist.convert_linear_weights(layers[0], compute="fp8")
    fp4_dist.convert_linear_weights(layers[1], compute="fp8", options=Fp8Options(keep_transpose=False))
    master = layers[0].weight.dequantize(torch.float32)
    x = torch.randn(300, k, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(300, n, dtype=torch.bfloat16, device="cuda")
    for step in range(2):
        outs = []
        for layer in layers:
            xi = x.detach().requires_grad_()
            y = layer(xi)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, layer.weight.grad))
            layer.weight.grad = None
        for got, want in zip(outs[1], outs[0]):
            assert torch.equal(got, want), step
        kept = [fp8_copy.kept_operand(layer, layer.weight) for layer in layers]
        assert kept[0].bits_t is not None and kept[1].bits_t is None
        assert fp8_copy.fp8_copy_bytes(layers[0]) - fp8_copy.fp8_copy_bytes(layers[1]) == k * n
        addresses = kept[1].bits.data_ptr()
        master -= 0.01 * outs[0][2].float()
        for layer in layers:
            layer.weight.quantize_(master)
        layers[1](x)  # the next use rewrites the copy in place
        assert fp8_copy.kept_operand(layers[1], layers[1].weight).bits.data_ptr() == addresses
