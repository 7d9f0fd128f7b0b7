"""The nvfp4 compute mode (`fp4_dist.compute.nvfp4`): every GEMM of a linear reads NVFP4 operands quantized as
TransformerEngine's recipe says (forward x to nearest even, dy stochastically, both wgrad operands through the
Hadamard transform), multiplied exactly up to the order of fp32 additions; the first and last linear keep bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.compute import nvfp4, nvfp4_gemm
from fp4_dist.compute.modes import DEFAULT, MODES
from fp4_dist.kernels import nvfp4_1d_reference as R

MODE = MODES["nvfp4"]


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return fp4_dist.quantize(torch.randn(n, k, generator=g) * 0.05)


def test_the_forward_is_the_exact_product_of_the_quantized_operands_to_fp32_accumulation():
    w = _weight(48, 64)
    x = torch.randn(3, 37, 64).to(torch.bfloat16)  # ragged tokens, 3D
    y = nvfp4.nvfp4_linear(x, w)
    assert y.shape == (3, 37, 48) and y.dtype == torch.bfloat16
    xq = R.quantize_rows_1x16(x.reshape(-1, 64))
    exact = R.values(xq).double() @ R.values(nvfp4.weight_rows(w)).double().t()
    torch.testing.assert_close(y.reshape(-1, 48).double(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    bf16 = torch.nn.functional.linear(x, w.dequantize().to(torch.bfloat16))
    assert not torch.equal(y, bf16), "the activations were not quantized"


def _backward(seed: int, recipe=nvfp4.DEFAULT_RECIPE):
    w = _weight(40, 32, seed=1)
    w.requires_grad_(True)
    x = torch.randn(21, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(21, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    torch.manual_seed(seed)
    nvfp4.nvfp4_linear(x, w, None, recipe).backward(dy)
    return w, x, dy


def test_dgrad_and_wgrad_read_the_recipes_operands_bit_for_bit_and_a_seed_reproduces_them():
    w, x, dy = _backward(seed=5)
    torch.manual_seed(5)  # the backward draws the dgrad's seed first, then the wgrad's
    dyq = R.quantize_rows_1x16_sr(dy, R.draw_seed())
    wq = nvfp4.weight_rows(w)
    dx = nvfp4.emulated_mm(R.unscaled_values(dyq), dyq.amax, R.unscaled_values(wq).t(), wq.amax, torch.bfloat16)
    dyt = nvfp4.wgrad_operand(dy, stochastic=True, rht=True)
    xt = nvfp4.wgrad_operand(x.detach(), stochastic=False, rht=True)
    assert dyt.cols == xt.cols == 32, "tokens padded to a multiple of 16 for the transform"
    dw = nvfp4.emulated_mm(R.unscaled_values(dyt), dyt.amax, R.unscaled_values(xt), xt.amax, torch.bfloat16)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)
    again = _backward(seed=5)
    other = _backward(seed=6)
    assert torch.equal(again[0].grad, w.grad) and torch.equal(again[1].grad, x.grad)
    assert not torch.equal(other[0].grad, w.grad) and not torch.equal(other[1].grad, x.grad)


def test_the_transform_cancels_in_the_weight_gradient_and_only_the_rounding_differs():
    plain = nvfp4.Nvfp4Recipe(stochastic_rounding=False, rht=False)
    w_rht, x, dy = _backward(0, nvfp4.Nvfp4Recipe(stochastic_rounding=False))
    w_plain, _, _ = _backward(0, plain)
    exact = dy.double().t() @ x.detach().double()
    for got in (w_rht.grad, w_plain.grad):
        assert (got.double() - exact).norm() / exact.norm() < 0.2  # two 4-bit operands: ~10% error
    assert not torch.equal(w_rht.grad, w_plain.grad)


def test_stochastic_rounding_makes_the_gradients_unbiased_over_seeds():
    # The mean of many dgrads with stochastic rounding of dy approaches dy @ W (W's NVFP4 values), where round to
    # nearest keeps its error whatever the seed.
    w_ref, x, dy = _backward(0, nvfp4.Nvfp4Recipe(stochastic_rounding=False))
    target = dy.double() @ R.values(nvfp4.weight_rows(w_ref)).double()
    rn_error = (x.grad.double() - target).norm()
    mean = sum(_backward(s)[1].grad.double() for s in range(24)) / 24
    assert (mean - target).norm() < 0.5 * rn_error


def test_convert_keeps_the_first_and_last_linear_in_bf16_by_default_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48),
                          nn.GELU(), nn.Linear(48, 16)).to(torch.bfloat16)  # fmt: skip
    report = fp4_dist.convert_linear_weights(model, compute="nvfp4")
    assert report.in_mode == ["2", "4"] and set(report.not_in_mode) == {"0", "6"}
    assert "Nvfp4Recipe.bf16_first" in report.not_in_mode["0"] and model[0].fp4_compute == DEFAULT
    assert model[2].fp4_compute == "nvfp4" and isinstance(model[2].fp4_options, nvfp4.Nvfp4Recipe)
    # SGD on fp32 masters, each NVFP4 weight re-quantized from its master after the step
    masters = [(p, p.dequantize(torch.float32) if fp4_dist.is_nvfp4_tensor(p) else p.detach().float())
               for p in model.parameters()]  # fmt: skip
    x, target = torch.randn(64, 32).to(torch.bfloat16), torch.randn(64, 16).to(torch.bfloat16)
    losses = []
    for _ in range(8):
        loss = (model(x).float() - target.float()).pow(2).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p, master in masters:
                assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                master -= 0.5 * p.grad.float()
                p.quantize_(master) if fp4_dist.is_nvfp4_tensor(p) else p.copy_(master)
        losses.append(float(loss.detach()))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_convert_takes_the_recipe_and_refuses_other_options():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    report = fp4_dist.convert_linear_weights(model, compute="nvfp4",
                                             options=nvfp4.Nvfp4Recipe(bf16_first=0, bf16_last=2))  # fmt: skip
    assert report.in_mode == ["0"] and set(report.not_in_mode) == {"1", "2"}
    with pytest.raises(TypeError, match="must be a Nvfp4Recipe"):
        fp4_dist.convert_linear_weights(nn.Linear(32, 16), compute="nvfp4", options={"rht": False})
    with pytest.raises(TypeError, match="it has no options"):
        fp4_dist.convert_linear_weights(nn.Linear(32, 16), options=nvfp4.Nvfp4Recipe())
    with pytest.raises(ValueError, match="bf16_last is a number of linears"):
        nvfp4.Nvfp4Recipe(bf16_last=-1)


def test_devices_where_the_mode_never_ran_are_refused(monkeypatch):
    assert MODE.check_device(torch.device("cpu")) is None
    why = MODE.check_device(torch.device("meta"))
    assert why is not None and "sm_80 to sm_90" in why
    monkeypatch.setattr(nvfp4_gemm, "DEVICES", {})
    for capability, words in (((10, 0), "native NVFP4 scaled_mm"), ((12, 0), "later drop-in"), ((7, 5), "sm_80")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        nvfp4_gemm.DEVICES.clear()
        why = MODE.check_device(torch.device("cuda:0"))
        assert why is not None and words in why and f"sm_{capability[0]}{capability[1]}" in why, why


def test_every_unscaled_value_is_exact_in_bf16_so_the_gpu_gemm_reads_bf16_operands():
    # all 16 signed E2M1 codes (a row) x all 127 finite E4M3 scales (zero included; one per row): what the GPU GEMM
    # reads in bf16
    nvfp4_gemm.check_bf16_exact()
    q = _all_codes_and_scales()
    u = R.unscaled_values(q)
    assert u.shape == (127, 16) and torch.equal(u.to(torch.bfloat16).float(), u)
    assert u.abs().max() == 6 * 448 and u[u != 0].abs().min() == 0.5 * 2**-9


def _all_codes_and_scales() -> R.Nvfp4Rows:
    """Rows r = 0..126 holding the codes 0..15 with the E4M3 scale byte r."""
    codes = torch.arange(16, dtype=torch.uint8)
    data = (codes[0::2] | codes[1::2] << 4).repeat(127, 1)
    return R.Nvfp4Rows(data, torch.arange(127, dtype=torch.uint8)[:, None], torch.ones(1), 16)


def test_a_weight_changed_between_forward_and_backward_is_refused():
    w = _weight(16, 32)
    w.requires_grad_(True)
    y = nvfp4.nvfp4_linear(torch.randn(4, 32).to(torch.bfloat16), w)
    with torch.no_grad():
        w.copy_(torch.randn(16, 32))
    with pytest.raises(RuntimeError):
        y.sum().backward()


def test_fsdp2_refuses_a_mode_without_an_unsharded_weight_of_its_own(monkeypatch):
    from fp4_dist.fsdp import fully_shard_nvfp4

    monkeypatch.setitem(MODES, "nvfp4", replace(MODES["nvfp4"], fsdp_unsharded=None))
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="nvfp4 compute mode has no FSDP2 unsharded weight"):
        fully_shard_nvfp4(model, compute="nvfp4")
    assert type(model[0].weight) is nn.Parameter


@pytest.mark.parametrize("gathered", ["tile-grid", "row-expanded"])
def test_fsdp2_unsharded_weight_is_an_nvfp4_tensor_on_the_gathered_bytes_written_in_place(gathered):
    """What FSDP2's post-gather makes in the mode (`nvfp4.FsdpUnsharded`): an NVFP4Tensor equal to the gathered
    weight, its bytes the gathered ones (no copy), and a later gather written into the same tensors without a
    version change (its layer's forward saved them for the backward); FSDP2's as_strided keeps it whole."""
    m, k = 48, 80
    first, later = (fp4_dist.quantize(torch.randn(m, k), numerics="te-2.14") for _ in range(2))

    def fields(q):  # as the gather gives them: tile grid (NVFP4 gather) or row-expanded (bf16 gather, quantized)
        if gathered == "row-expanded":
            return q.rowwise_data, q.rowwise_scale_inv, q.amax
        grid = q.rowwise_scale_inv[:m:16, : k // 16].contiguous()
        return q.rowwise_data, grid, q.amax.clone()

    gathered_fields = fields(first)
    held, param, tensors = nvfp4.FsdpUnsharded.make(gathered_fields, torch.bfloat16, "te-2.14")
    assert param is held and type(param) is fp4_dist.NVFP4Tensor and param.rowwise_data is first.rowwise_data
    assert param.numerics == "te-2.14"  # the weight's own formula, which the gathered bytes were made by
    for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
        assert torch.equal(getattr(param, f), getattr(first, f)), f
    own = [held.amax] if gathered == "row-expanded" else [held.rowwise_scale_inv, held.amax]
    assert [id(t) for t in tensors] == [id(t) for t in own]  # FSDP2 frees and allocates them; the bytes are its own
    same = torch.as_strided(param, (m, k), (k, 1), 0)
    assert type(same) is fp4_dist.NVFP4Tensor and same.rowwise_data is param.rowwise_data
    ids, versions = [id(getattr(held, f)) for f in ("rowwise_scale_inv", "amax")], held.amax._version
    # the next gather: FSDP2 gathers the bytes into the same buffer (a bf16 gather is quantized into its own)
    in_place = ("rowwise_data",) if gathered == "tile-grid" else ("rowwise_data", "rowwise_scale_inv", "amax")
    for f in in_place:
        getattr(first, f).copy_(getattr(later, f))
    nvfp4.FsdpUnsharded.write(held, (first.rowwise_data, *fields(later)[1:]) if gathered == "tile-grid" else
                              gathered_fields)  # fmt: skip
    assert [id(getattr(held, f)) for f in ("rowwise_scale_inv", "amax")] == ids and held.amax._version == versions
    for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
        assert torch.equal(getattr(held, f), getattr(later, f)), f
