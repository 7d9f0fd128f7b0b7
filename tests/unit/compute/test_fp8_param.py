"""Fp8Param (fp4_dist.compute.fp8_param): FSDP2's unsharded weight in the FP8 compute mode. F.linear on it is the
FP8 linear on the NVFP4 weight it was copied from, bit for bit; the ops FSDP2 and nn.Parameter apply keep it; any
other op reads the copy's values; its tensors can be freed and written again the way FSDP2 does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist
from fp4_dist.compute.fp8 import fp8_linear
from fp4_dist.compute.fp8_gemm import Fp8Operand
from fp4_dist.compute.fp8_param import Fp8Param, own, write


def _weight(m=200, k=304, seed=0):
    g = torch.Generator().manual_seed(seed)
    return fp4_dist.quantize(torch.randn(m, k, generator=g), dtype=torch.bfloat16)


def _param(w) -> nn.Parameter:
    return nn.Parameter(Fp8Param(own(Fp8Operand.weight(w)), torch.bfloat16))


def test_f_linear_on_it_is_the_fp8_linear_of_the_nvfp4_weight_bit_for_bit():
    w = _weight()
    nv = nn.Parameter(w)
    p = _param(w)
    bias = torch.randn(200, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 304, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = fp8_linear(xa, nv, bias, Fp8Operand.weight(w))
    got = F.linear(xb, p, bias)
    assert type(got) is torch.Tensor and torch.equal(got, want)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want.backward(dy)
    got.backward(dy)
    assert torch.equal(xb.grad, xa.grad)
    assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, nv.grad)
    layer = nn.Linear(304, 200, dtype=torch.bfloat16)
    layer.weight, layer.bias = p, nn.Parameter(bias)
    assert torch.equal(layer(x), want.detach())


def test_the_ops_fsdp2_and_parameters_apply_keep_the_copy_and_others_read_its_values():
    w = _weight(130, 48)
    p = _param(w)
    assert type(p) is Fp8Param and p.requires_grad and p.shape == (130, 48) and p.dtype == torch.bfloat16
    for same in (p.detach(), torch.as_strided(p, (130, 48), (48, 1), storage_offset=0), p.view(130, 48)):
        assert type(same) is Fp8Param and same.operand is p.operand
    values = p.values()
    e4m3 = p.operand.bits.view(torch.float8_e4m3fn).float()
    block = p.operand.scales[torch.arange(130)[:, None] // 128, torch.arange(48)[None, :] // 128]
    assert torch.equal(values, (e4m3 * block).to(torch.bfloat16))
    assert (values.float() - w.dequantize(torch.float32)).abs().max() < 0.5  # the copy of these values, not others
    flat = p.view(-1)  # another shape: a plain tensor of the values
    assert type(flat) is torch.Tensor and torch.equal(flat, values.reshape(-1))
    assert type(p.float()) is torch.Tensor and torch.equal(p.float(), values.float())
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    y = x @ p.t()  # not F.linear: computed on the values, and the gradient still reaches the parameter
    assert torch.equal(y, x @ values.t())
    y.float().sum().backward()
    assert torch.equal(p.grad, (torch.ones(4, 130, dtype=torch.bfloat16).t() @ x))


def test_its_tensors_are_its_own_and_are_written_again_in_place_after_fsdp2_frees_them():
    w, w2 = _weight(seed=3), _weight(seed=4)
    fresh = Fp8Operand.weight(w)
    kept = own(fresh)
    tensors = [t for t in kept if isinstance(t, torch.Tensor)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, [t for t in fresh if isinstance(t, torch.Tensor)]))
    p = Fp8Param(kept, torch.bfloat16)
    versions = [t._version for t in tensors]
    for t in tensors:  # what FSDP2 does when it reshards, then before the next gather
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(t.numel() * t.element_size())
    write(kept, Fp8Operand.weight(w2))
    assert [t._version for t in tensors] == versions  # a saved copy written again is no in-place change
    assert torch.equal(p.operand.bits, Fp8Operand.weight(w2).bits) and torch.equal(p.values(), _param(w2).values())


def test_a_deep_copy_holds_the_same_copy_in_tensors_of_its_own_and_a_freed_one_refuses():
    w = _weight(64, 48)
    layer = nn.Linear(48, 64, bias=False, dtype=torch.bfloat16)
    layer.weight = _param(w)
    twin = copy.deepcopy(layer)
    p, q = layer.weight, twin.weight
    assert type(q) is Fp8Param and isinstance(q, nn.Parameter) and q.requires_grad and q.dtype == p.dtype
    assert [n for n, _ in twin.named_parameters()] == ["weight"]
    twin.weight = q  # a module takes it back as a parameter
    for a, b in zip(p.operand, q.operand):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        else:
            assert a == b
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert torch.equal(twin(x), layer(x))
    for t in p.operand:
        if isinstance(t, torch.Tensor):
            t.untyped_storage().resize_(0)
    assert torch.equal(twin(x), F.linear(x, _param(w)))  # the twin's copy outlives the original's
    r = _param(w)
    a, b = copy.deepcopy([r, r.detach()])  # one copy shared by two weights stays one copy
    assert a.operand is b.operand and a.operand is not r.operand
    with pytest.raises(RuntimeError, match="freed when FSDP2 resharded"):
        copy.deepcopy(p)


def test_fully_shard_nvfp4_takes_the_compute_mode_by_name():
    from fp4_dist.fsdp import fully_shard_nvfp4

    with pytest.raises(ValueError, match="compute must be one of .*got 'fp4'"):
        fully_shard_nvfp4(nn.Linear(32, 32), compute="fp4")


def test_a_copy_fsdp2_freed_a_write_into_it_and_mismatched_dtypes_are_refused_with_a_sentence():
    p = _param(_weight(64, 48))
    x = torch.randn(2, 48, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="writes into an FP8 weight copy"):
        p.mul_(0)
    with pytest.raises(RuntimeError, match="input is torch.float16.*computes in torch.bfloat16"):
        F.linear(x.half(), p)
    for t in p.operand:  # FSDP2's reshard frees the copy's memory
        if isinstance(t, torch.Tensor):
            t.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="freed when FSDP2 resharded"):
        F.linear(x, p)
    with pytest.raises(RuntimeError, match="freed when FSDP2 resharded"):
        p.float()


def test_keywords_autocast_and_lists_of_weights_take_the_same_paths():
    w = _weight(64, 48)
    p = _param(w)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = fp8_linear(x, w, None, Fp8Operand.weight(w))
    assert torch.equal(F.linear(input=x, weight=p), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.linear(x.float(), p)  # as F.linear under autocast: the input taken in bf16
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    both = torch.cat([p, p])  # an op on a list of them reads their values
    assert type(both) is torch.Tensor and torch.equal(both, torch.cat([p.values(), p.values()]))


def test_a_first_gather_under_inference_mode_leaves_copies_later_gathers_can_write():
    w, w2 = _weight(seed=6), _weight(seed=7)
    with torch.inference_mode():
        kept = own(Fp8Operand.weight(w))
    assert not any(t.is_inference() for t in kept if isinstance(t, torch.Tensor))
    write(kept, Fp8Operand.weight(w2))
    assert torch.equal(kept.bits, Fp8Operand.weight(w2).bits)
