"""The nvfp4 compute mode on a GPU (GPU only): the device check passes on Hopper, and `nvfp4_linear`'s forward and
backward equal the CPU emulation's: the quantized operands (what the forward keeps for the backward included) bit
for bit with the same seeds, the outputs and gradients within the order of the fp32 additions."""

from __future__ import annotations

import pytest
import torch

import fp4_dist
from fp4_dist.compute import nvfp4, nvfp4_gemm
from fp4_dist.compute.modes import MODES, prepare
from fp4_dist.kernels import nvfp4_1d_reference as R

pytestmark = pytest.mark.gpu

MODE = MODES["nvfp4"]


def test_the_mode_runs_on_this_gpu_where_it_is_hopper_or_ampere():
    major, _ = torch.cuda.get_device_capability()
    why = MODE.check_device(torch.device("cuda"))
    if 8 <= major <= 9:
        assert why is None and prepare(MODE, ["cuda:0"]) is None
    else:
        assert why is not None


def _linear(device: str, seed: int, shape: tuple, recipe, bias: bool):
    """(y, x.grad, w.grad, the forward's saved operands) of one forward and backward on `device`."""
    tokens, n, k = shape
    g = torch.Generator().manual_seed(shape[0] * 7 + n)
    w = fp4_dist.quantize((torch.randn(n, k, generator=g) * 0.05).to(device))
    w.requires_grad_(True)
    x = (torch.randn(tokens, k, generator=g) * torch.logspace(-2, 2, k)).to(torch.bfloat16).to(device)
    x.requires_grad_(True)
    dy = torch.randn(tokens, n, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(n, generator=g).to(torch.bfloat16).to(device) if bias else None
    y = nvfp4.nvfp4_linear(x, w, b, recipe)
    saved = [t.detach().cpu() for t in y.grad_fn.saved_tensors]
    torch.manual_seed(seed)  # the backward's seeds: the dgrad's, then the wgrad's
    y.backward(dy)
    return y.detach().cpu(), x.grad.cpu(), w.grad.cpu(), saved


def _close_to_one_rounding(got: torch.Tensor, want: torch.Tensor, label) -> None:
    """Equal up to the order of fp32 additions before one rounding to bf16: within a bf16 ulp of each value (atol
    for sums that cancel), and bitwise equal nearly everywhere."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * float(want.float().abs().max()),
                               msg=lambda m: f"{label}: {m}")  # fmt: skip
    assert (got == want).float().mean() > 0.9, label


SHAPES = [(37, 48, 64), (1, 16, 32), (130, 80, 112), (300, 144, 272)]  # tokens not 16 | T; K % 64 != 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-N{}-K{}".format(*s))
@pytest.mark.parametrize("rht,sr", [(True, True), (False, False), (True, False)])
def test_forward_and_backward_on_the_gpu_equal_the_cpu_emulation(shape, rht, sr):
    recipe = nvfp4.Nvfp4Recipe(stochastic_rounding=sr, rht=rht)
    y, dx, dw, saved = _linear("cuda", 5, shape, recipe, bias=True)
    y_cpu, dx_cpu, dw_cpu, saved_cpu = _linear("cpu", 5, shape, recipe, bias=True)
    for i, (a, b) in enumerate(zip(saved, saved_cpu)):  # x^T's wgrad operand and the weight, as kept
        assert a.dtype == b.dtype and torch.equal(a, b), f"saved tensor {i} differs"
    _close_to_one_rounding(y, y_cpu, "y")
    _close_to_one_rounding(dx, dx_cpu, "dx")
    _close_to_one_rounding(dw, dw_cpu, "dw")


def test_the_gradient_operands_are_the_cpus_bits_with_the_same_seeds():
    tokens, n, k = 70, 48, 96
    dy = torch.randn(tokens, n).to(torch.bfloat16)
    for device in ("cpu", "cuda"):
        torch.manual_seed(9)
        recipe = nvfp4.DEFAULT_RECIPE
        dyq = recipe.gradient_rows(dy.to(device))
        dyt = nvfp4.wgrad_operand(dy.to(device), recipe.stochastic_rounding, recipe.rht)
        if device == "cpu":
            want = (dyq, dyt)
    for got, ref in zip((dyq, dyt), want):
        assert torch.equal(got.data.cpu(), ref.data) and torch.equal(got.scales.cpu(), ref.scales)
        assert torch.equal(got.amax.cpu(), ref.amax)


def test_the_gpu_gemm_is_the_exact_product_to_fp32_accumulation():
    a = R.quantize_rows_1x16(torch.randn(200, 336).to(torch.bfloat16))
    b = R.quantize_rows_1x16_sr(torch.randn(96, 336).to(torch.bfloat16), 4)
    exact = (R.unscaled_values(a).double() @ R.unscaled_values(b).double().t()) * R.gemm_alpha(a.amax, b.amax).double()
    ag = R.Nvfp4Rows(a.data.cuda(), a.scales.cuda(), a.amax.cuda(), a.cols)
    bg = R.Nvfp4Rows(b.data.cuda(), b.scales.cuda(), b.amax.cuda(), b.cols)
    y = nvfp4_gemm.emulated_mm(nvfp4_gemm.unscaled_values(ag), ag.amax, nvfp4_gemm.unscaled_values(bg), bg.amax,
                               torch.float32)  # fmt: skip
    torch.testing.assert_close(y.cpu().double(), exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()))


def test_a_model_trains_on_the_gpu_in_the_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 32)).to(torch.bfloat16).cuda()  # fmt: skip
    report = fp4_dist.convert_linear_weights(model, compute="nvfp4", options=nvfp4.Nvfp4Recipe(bf16_first=0,
                                                                                              bf16_last=0))
    assert report.in_mode == ["0", "2", "4"]
    masters = [(p, p.dequantize(torch.float32) if fp4_dist.is_nvfp4_tensor(p) else p.detach().float())
               for p in model.parameters()]  # fmt: skip
    x = torch.randn(256, 64, device="cuda")
    target = x @ torch.randn(64, 32, device="cuda") / 8  # learnable: a linear map of the input
    x = x.to(torch.bfloat16)
    losses = []
    for _ in range(12):
        loss = (model(x).float() - target).pow(2).sum(1).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p, master in masters:
                master -= 0.1 * p.grad.float()
                p.quantize_(master) if fp4_dist.is_nvfp4_tensor(p) else p.copy_(master)
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses  # the same loop on the CPU: 30.8 -> 17.4
