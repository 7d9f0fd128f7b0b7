"""NVFP4 parameters keep their Python attributes through every nn.Module._apply route.

torch moves a tensor-subclass parameter with `swap_tensors(param, nn.Parameter(fn(param)))`, which swaps the two
objects' `__dict__`s: the parameter ends up with exactly the attributes of the new one. A parameter that lost
Megatron's tensor-parallel attributes or `get_high_precision_init_val` trains worse without a word (masters start
from the NVFP4 values, per-slice amaxes under tensor parallelism), so every route is checked, for NVFP4Linear (what
`convert_linear_weights` makes of nn.Linear) and for an nn.Linear subclass (which keeps its own `_apply`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4_dist

ATTRS = {"tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1, "allreduce": True,
         "my_own_tag": "kept"}


class MyLinear(nn.Linear):
    """A user's subclass: convert_linear_weights keeps its class, so no fp4_dist `_apply` override runs."""


def _model(cls):
    torch.manual_seed(0)
    model = nn.Sequential(cls(64, 48, bias=False), nn.GELU(), cls(48, 32))
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    init = {}
    for i in (0, 2):
        w = model[i].weight
        for k, v in ATTRS.items():
            setattr(w, k, v)
        init[i] = w.dequantize(torch.bfloat16)
        w.get_high_precision_init_val = (lambda v: (lambda: v))(init[i])  # as Megatron's probe calls it
    return model, init


def _routes():
    routes = [
        ("cpu()", lambda m: m.cpu()),
        ("to('cpu')", lambda m: m.to("cpu")),
        ("to(torch.device('cpu'))", lambda m: m.to(torch.device("cpu"))),
        ("bfloat16()", lambda m: m.bfloat16()),
        ("to(torch.bfloat16)", lambda m: m.to(torch.bfloat16)),
        ("to_empty(device='cpu')", lambda m: m.to_empty(device="cpu")),
        ("float()", lambda m: m.float()),
        ("half()", lambda m: m.half()),
    ]
    if torch.cuda.is_available():
        routes += [("cuda()", lambda m: m.cuda()), ("to('cuda')", lambda m: m.to("cuda")),
                   ("cuda() then cpu()", lambda m: m.cuda().cpu())]
    return routes


@pytest.mark.parametrize("cls", [nn.Linear, MyLinear], ids=["NVFP4Linear", "subclass"])
@pytest.mark.parametrize("name,route", _routes(), ids=[r[0] for r in _routes()])
def test_module_apply_keeps_every_python_attribute_of_an_nvfp4_parameter(cls, name, route):
    model, init = _model(cls)
    before = {i: model[i].weight for i in (0, 2)}
    rowwise = {i: model[i].weight.rowwise_data.clone() for i in (0, 2)}
    route(model)
    for i in (0, 2):
        w = model[i].weight
        assert isinstance(w, nn.Parameter) and fp4_dist.is_nvfp4_tensor(w), (name, type(w))
        assert w is before[i], f"{name}: the parameter object is swapped in place, not replaced"
        for k, v in ATTRS.items():
            assert getattr(w, k, "<missing>") == v, f"{name}: lost {k}"
        assert w.get_high_precision_init_val() is init[i], f"{name}: lost get_high_precision_init_val"
        if "empty" not in name:  # to_empty leaves the bytes unspecified, as for any tensor
            assert torch.equal(w.rowwise_data.cpu(), rowwise[i]), f"{name}: bytes changed"


@pytest.mark.parametrize("cls", [nn.Linear, MyLinear], ids=["NVFP4Linear", "subclass"])
def test_a_moved_model_still_trains_and_its_gradient_reaches_the_parameter(cls):
    model, _ = _model(cls)
    model.bfloat16()
    model.cpu()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    model(x).float().square().sum().backward()
    for i in (0, 2):
        g = model[i].weight.grad
        assert g is not None and g.shape == model[i].weight.shape and torch.isfinite(g).all()


def test_an_alias_carries_the_attributes_but_is_no_parameter():
    model, _ = _model(nn.Linear)
    w = model[0].weight
    for alias in (w.detach(), w.data):
        assert not isinstance(alias, nn.Parameter) and "_is_param" not in vars(alias)
        assert all(getattr(alias, k) == v for k, v in ATTRS.items())
        assert alias.rowwise_data is w.rowwise_data
