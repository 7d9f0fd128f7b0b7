"""The FP8 compute mode of converted layers (``convert_linear_weights(compute="fp8")``) on the CPU: what a layer
computes, when its FP8 copy is made and dropped, and what the mode refuses (`fp4_dist.compute.fp8_gemm`)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.compute import fp8_copy
from fp4_dist.compute.fp8 import Fp8Operand
from fp4_dist.compute.fp8_gemm import emulated_mm, fp8_gemm_missing
from fp4_dist.compute.fp8_copy import fp8_copy_bytes, weight_operand


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(272, 144), nn.GELU(), nn.Linear(144, 80, bias=False)).to(torch.bfloat16)


def test_a_layer_computes_its_gemms_from_the_fp8_copy_and_fp8_operands():
    model = _model()
    report = fp4_dist.convert_linear_weights(model, compute="fp8")
    assert report.compute == "fp8" and report.fp8 == ["0", "2"] and not report.not_fp8
    assert "FP8 compute: 2 linears, 0 with NVFP4 weights in bf16" in str(report)
    lin = model[0]
    x = torch.randn(3, 50, 272, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(-1, 272), dy.reshape(-1, 144)
    w = Fp8Operand.weight(lin.weight)
    want_y = emulated_mm(Fp8Operand.rows(x2), w).to(torch.bfloat16) + lin.bias.detach()
    assert torch.equal(y.detach().reshape(-1, 144), want_y)
    assert torch.equal(x.grad.reshape(-1, 272), emulated_mm(Fp8Operand.rows(dy2), w.t()).to(torch.bfloat16))
    want_dw = emulated_mm(Fp8Operand.rows(dy2.t()), Fp8Operand.rows(x2.t())).to(torch.bfloat16)
    assert type(lin.weight.grad) is torch.Tensor and torch.equal(lin.weight.grad, want_dw)
    assert torch.equal(lin.bias.grad, dy2.sum(0))

    # and it is not what the bf16 mode computes, which reads the NVFP4 values in bf16
    bf16 = _model()
    fp4_dist.convert_linear_weights(bf16)
    assert torch.equal(bf16[0].weight.rowwise_data, lin.weight.rowwise_data)
    assert not torch.equal(bf16[0](x.detach()), y.detach())


def test_the_copy_is_made_once_per_change_of_the_weights_bytes():
    model = _model()
    fp4_dist.convert_linear_weights(model, compute="fp8")
    lin, x = model[0], torch.randn(8, 272, dtype=torch.bfloat16)
    lin(x)
    first = weight_operand(lin, lin.weight)
    lin(x)
    assert weight_operand(lin, lin.weight) is first  # kept: no new copy for the next use
    assert fp8_copy_bytes(model) == 144 * 272 + 4 * 2 * 3  # one layer used: E4M3 values, fp32 per 128 x 128 block

    before = first.bits.clone()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(144, 272) * 3)  # new bytes (quantized in place)
    second = weight_operand(lin, lin.weight)
    # remade in place: the tensors a captured CUDA graph reads keep their addresses, and hold the new copy
    assert [t.data_ptr() for t in second if isinstance(t, torch.Tensor)] == \
        [t.data_ptr() for t in first if isinstance(t, torch.Tensor)]
    assert not torch.equal(second.bits, before)
    assert torch.equal(second.bits, Fp8Operand.weight(lin.weight).bits)

    # pending (bytes cast, their all-gather not processed): nothing proves a copy current, each use makes its own
    lin.weight.copy_state.pending = True
    try:
        assert weight_operand(lin, lin.weight) is not weight_operand(lin, lin.weight)
        assert lin.__dict__[fp8_copy._ATTR] is None
    finally:
        lin.weight.copy_state.pending = False


def test_a_weight_changed_between_forward_and_backward_makes_the_backward_raise():
    model = _model()
    fp4_dist.convert_linear_weights(model, compute="fp8")
    lin = model[0]
    y = lin(torch.randn(4, 272, dtype=torch.bfloat16, requires_grad=True))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(144, 272))
    with pytest.raises(RuntimeError, match="changed between the forward and the backward"):
        y.sum().backward()


def test_copies_are_not_carried_by_deepcopy_pickle_or_a_move():
    model = _model()
    fp4_dist.convert_linear_weights(model, compute="fp8")
    x = torch.randn(4, 272, dtype=torch.bfloat16)
    want = model(x)
    assert fp8_copy_bytes(model) > 0
    twin = copy.deepcopy(model)
    assert fp8_copy_bytes(twin) == 0 and twin[0].fp4_compute == "fp8" and torch.equal(twin(x), want)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert fp8_copy_bytes(loaded) == 0 and torch.equal(loaded(x), want)
    assert pickle.loads(pickle.dumps(model[0].__dict__[fp8_copy._ATTR])) is None
    model.to(torch.device("cpu"))  # _apply: the copy goes with the weight's old storage
    assert fp8_copy_bytes(model) == 0


def test_the_mode_names_what_it_leaves_in_bf16_and_refuses_what_it_cannot_do():
    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(64, 32), OwnForward(32, 32), nn.Linear(32, 32)).to(torch.bfloat16)
    model.append(nn.Linear(32, 32, bias=False).to(torch.bfloat16))
    model[3].weight = model[2].weight  # a plain owner of a tied weight: it stays nn.Linear
    report = fp4_dist.convert_linear_weights(model, compute="fp8")
    assert report.fp8 == ["0", "2"] and list(report.not_fp8) == ["1", "3"]
    assert "OwnForward keeps its own forward" in report.not_fp8["1"] and "sharing" in report.not_fp8["3"]
    assert "FP8 compute: 2 linears, 2 with NVFP4 weights in bf16" in str(report)
    assert model[0].fp4_compute == "fp8" and model(torch.randn(2, 64, dtype=torch.bfloat16)).shape == (2, 32)

    # a model converted before: the call converts nothing more, and its layers now compute in FP8
    earlier = _model()
    fp4_dist.convert_linear_weights(earlier)
    assert earlier[0].fp4_compute == "bf16"
    report = fp4_dist.convert_linear_weights(earlier, compute="fp8")
    assert not report.converted and report.fp8 == ["0", "2"] and earlier[2].fp4_compute == "fp8"

    # a layer in FP8 whose weight is no longer NVFP4 says so instead of computing in bf16
    earlier[0].weight = nn.Parameter(torch.randn(144, 272, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="computes in FP8.*not an NVFP4Tensor"):
        earlier[0](torch.randn(2, 272, dtype=torch.bfloat16))
    from fp4_dist.fsdp import fully_shard_nvfp4

    with pytest.raises(ValueError, match="compute must be one of"):  # before any process group or sharding
        fully_shard_nvfp4(earlier, compute="fp4")

    with pytest.raises(ValueError, match="compute must be one of"):
        fp4_dist.convert_linear_weights(_model(), compute="fp4")
    plain = _model()
    with pytest.raises(ValueError, match="leave compute_copy False"):
        fp4_dist.convert_linear_weights(plain, compute="fp8", compute_copy=True)
    assert type(plain[0].weight) is nn.Parameter and type(plain[0].weight.data) is torch.Tensor  # nothing converted


def test_devices_without_the_fp8_gemms_are_refused_with_what_they_need():
    assert fp8_gemm_missing("cpu", None, False) is None
    assert fp8_gemm_missing("cuda", (9, 0), True) is None
    ampere = fp8_gemm_missing("cuda", (8, 0), True)
    assert "compute capability 9.0 (Hopper" in ampere and "this GPU is 8.0" in ampere
    assert "this GPU is 10.0" in fp8_gemm_missing("cuda", (10, 0), True)  # Blackwell: torch's recipes are sm_90's
    assert "torch.nn.functional.scaled_mm" in fp8_gemm_missing("cuda", (9, 0), False)
    assert "not on mps" in fp8_gemm_missing("mps", None, True)


def test_the_documented_snippet_runs(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "fp8.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", doc, flags=re.S)[0]
    exec(snippet, {"fp4_dist": fp4_dist, "model": _model()})
    assert "FP8 compute: 2 linears" in capsys.readouterr().out


def test_cublas_operands_are_padded_and_laid_out_as_torchs_sm90_recipes_read_them():
    import torch.nn.functional as F

    from fp4_dist.compute.fp8_gemm import _cublas_operand

    a = Fp8Operand.rows(torch.randn(300, 70).t())  # a transposed activation, as the wgrad quantizes it
    bits, scales, recipe = _cublas_operand(a, 72, 3)
    assert recipe == F.ScalingType.BlockWise1x128 and bits.dtype == torch.float8_e4m3fn and bits.is_contiguous()
    assert bits.shape == (72, 384) and scales.shape == (72, 3) and scales.stride() == (1, 72)  # outer-dim-major
    assert torch.equal(bits.view(torch.uint8)[:70, :300], a.bits) and not bits.view(torch.uint8)[70:].any()
    assert not bits.view(torch.uint8)[:, 300:].any() and torch.equal(scales[:70], a.scales)

    lin = nn.Linear(304, 200, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin)
    w = Fp8Operand.weight(lin.weight)
    for op, rows, row_blocks in ((w, 200, 2), (w.t(), 304, 3)):  # forward's copy, and the dgrad's transposed one
        bits, scales, recipe = _cublas_operand(op, rows, 3 if op is w else 2)
        assert recipe == F.ScalingType.BlockWise128x128 and bits.is_contiguous()
        assert torch.equal(bits.view(torch.uint8)[:, : op.bits.shape[1]], op.bits)
        assert scales.shape == (4, row_blocks)  # [K blocks padded to 4, row blocks], transposed
        assert torch.equal(scales.t()[:, : op.scales.shape[1]], op.scales)


def test_the_device_check_sees_a_scale_read_from_the_wrong_place():
    from fp4_dist.compute.fp8_gemm import check_cases, disagreement

    for name, (left, right, out_dtype) in check_cases("cpu").items():
        right_value = emulated_mm(left, right)
        assert disagreement(right_value, left, right, out_dtype) is None, name
        # the same values with one operand's scales misread: flipped along the rows, along K, or transposed
        misreads = [right.scales.flip(0), right.scales.flip(1), left.scales.flip(1)]
        if right.blocks and right.scales.shape[0] == right.scales.shape[1]:
            misreads.append(right.scales.t())
        for i, scales in enumerate(misreads):
            wrong_left = Fp8Operand(left.bits, scales, left.blocks) if i == 2 else left
            wrong_right = Fp8Operand(right.bits, scales, right.blocks) if i != 2 else right
            assert disagreement(emulated_mm(wrong_left, wrong_right), left, right, out_dtype) is not None, (name, i)


def test_the_modes_options_reach_each_layer_and_other_modes_options_are_refused():
    from fp4_dist.compute.fp8 import Fp8Options
    from fp4_dist.compute.nvfp4 import Nvfp4Recipe

    model = _model()
    options = Fp8Options(keep_transpose=False)
    fp4_dist.convert_linear_weights(model, compute="fp8", options=options)
    assert model[0].fp4_options is options and model[2].fp4_options is options
    x = torch.randn(5, 272, dtype=torch.bfloat16)
    want = _model()
    fp4_dist.convert_linear_weights(want, compute="fp8")
    assert torch.equal(model(x), want(x))  # the CPU keeps no transpose either way: the same GEMMs
    with pytest.raises(TypeError, match="must be a Fp8Options, got Nvfp4Recipe"):
        fp4_dist.convert_linear_weights(_model(), compute="fp8", options=Nvfp4Recipe())
    with pytest.raises(ValueError, match="keep_transpose is a bool"):
        Fp8Options(keep_transpose="no")
