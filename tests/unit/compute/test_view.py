"""fp4_dist/compute/view.py: a layer computes with a cached plain view of its NVFP4 weight's compute copy. Same
values and gradients as the dispatch path, never stale (every route that changes the bytes, seen by the layer's
own forward first), no dispatch in a steady-state step, and no leak (CPU)."""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist
from fp4_dist.compute.linear import NVFP4Linear
from fp4_dist.compute.view import compute_view, forget
from fp4_dist.megatron import adapter, layers
from fp4_dist.cast import cast_master_weights_to_nvfp4, post_all_gather_processing
from fp4_dist.tensor import NVFP4Tensor
from fp4_dist.testing import assert_bytes_equal, random_weight

M, K = 40, 48  # ragged M (not a multiple of 16), K % 64 != 0


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def nvfp4_linear(seed=0, bias=False, device="cpu", **kw):
    """A converted linear; with a kept compute copy (whose view this file tests) unless `compute_copy=False`."""
    torch.manual_seed(seed)
    lin = nn.Linear(K, M, bias=bias).to(device=device, dtype=torch.bfloat16)
    fp4_dist.convert_linear_weights(lin, **{"compute_copy": True, **kw})
    return lin


def x_in(seed=1, rows=8, device="cpu"):
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=torch.bfloat16)


def other_values(seed=7, device="cpu"):
    return random_weight(M, K, generator=torch.Generator().manual_seed(seed), device=device)


def _other(lin):
    return other_values(device=lin.weight.device)


def test_convert_makes_plain_linears_nvfp4_linears_and_leaves_subclasses_alone():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(K, M), MyLinear(K, M), nn.Linear(M, 24))  # in_features 40: stays bf16
    with pytest.warns(UserWarning, match="kept 2: in_features = 40"):
        fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    assert type(model[0]) is NVFP4Linear and isinstance(model[0], nn.Linear)
    assert type(model[1]) is MyLinear
    assert type(model[2]) is nn.Linear


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [8, 33])
def test_view_path_gives_the_dispatch_paths_outputs_and_gradients_bit_for_bit(bias, rows, device):
    lin = nvfp4_linear(seed=3, bias=bias, device=device)
    w = lin.weight
    x1 = x_in(rows=rows, device=device).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    dy = torch.randn(rows, M, generator=torch.Generator().manual_seed(9)).to(device=device, dtype=torch.bfloat16)
    for _ in range(2):  # the second pass uses the cached view
        y1 = lin(x1)
        y1.backward(dy)
        g1, gb1 = w.grad.clone(), (lin.bias.grad.clone() if bias else None)
        w.grad = None
        if bias:
            lin.bias.grad = None
        y2 = F.linear(x2, w, lin.bias)  # the parameter itself: every op through NVFP4Tensor's dispatch
        y2.backward(dy)
        assert_bytes_equal(y1, y2, "forward")
        assert_bytes_equal(w.grad, g1, "weight gradient")
        assert type(w.grad) is torch.Tensor
        if bias:
            assert_bytes_equal(lin.bias.grad, gb1, "bias gradient")
            lin.bias.grad = None
        w.grad = None
    assert_bytes_equal(x1.grad, x2.grad, "input gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_the_view_shares_the_copys_memory_and_outlives_refreshes_with_its_version_bumped(device):
    lin = nvfp4_linear(device=device)
    w = lin.weight
    v = compute_view(lin, w)
    assert type(v) is torch.Tensor and v.shape == w.shape and v.dtype == w.dtype
    assert v.data_ptr() == w._compute_copy.value.data_ptr()
    node = v.grad_fn
    assert node is not None and node.next_functions[0][0].variable is w
    assert not v._is_view(), "an autograd view of the weight would have its node replayed after every refresh"
    before = v._version
    _cast_and_gather(lin)
    assert v._version > before, "a refresh must bump the version autograd checks saved tensors against"
    assert compute_view(lin, w) is v and v.grad_fn is node, "the same view and node serve across steps"
    assert_bytes_equal(v, w.dequantize(torch.bfloat16), "the view after the refresh")


@pytest.mark.parametrize("device", DEVICES)
def test_a_steady_state_forward_and_backward_never_enter_the_weights_dispatch(dispatches, device):
    lin = nvfp4_linear(device=device)
    x = x_in(device=device)
    lin(x).sum().backward()  # first use: builds the view (one dispatch)
    assert dispatches, "the fixture must see the view being made"
    dispatches.clear()
    for _ in range(3):
        lin(x).sum().backward()
    assert dispatches == []
    # and the parameter path still dispatches (so the check above can fail)
    F.linear(x, lin.weight).sum().backward()
    assert dispatches


@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_never_enter_the_weights_dispatch(dispatches, device):
    lin = nvfp4_linear(device=device)
    x = x_in(device=device)
    lin(x).sum().backward()  # makes the layer's alias (one dispatch)
    master = lin.weight.dequantize(torch.float32).view(-1)
    dispatches.clear()
    for step in range(3):
        lin.weight.grad = None
        for _ in range(2):  # microbatches
            lin(x).sum().backward()
        master.sub_(lin.weight.grad.float().view(-1), alpha=0.01)
        cast_master_weights_to_nvfp4([lin.weight], [master], [0])
        post_all_gather_processing([lin.weight])
        assert dispatches == [], f"step {step} dispatched {dispatches}"
    assert_bytes_equal(lin(x), x @ lin.weight.dequantize(torch.bfloat16).t(), "forward after the last step")


def _copy_fp32(lin):
    with torch.no_grad():
        lin.weight.copy_(_other(lin))


def _copy_nvfp4(lin):
    with torch.no_grad():
        lin.weight.copy_(fp4_dist.quantize(_other(lin)))


def _quantize(lin):
    lin.weight.quantize_(_other(lin))


def _load_state_dict(lin):
    lin.load_state_dict(nvfp4_linear(seed=5, device=lin.weight.device).state_dict())


def _checkpoint(lin):
    buf = io.BytesIO()
    torch.save(nvfp4_linear(seed=5, device=lin.weight.device).state_dict(), buf)
    buf.seek(0)
    lin.load_state_dict(torch.load(buf, weights_only=True))


def _amax_in_place(lin):
    lin.weight.amax.mul_(2)


def _bytes_in_place(lin):
    lin.weight.rowwise_data.view(-1)[:7].fill_(0x5A)


def _scales_in_place(lin):
    lin.weight.rowwise_scale_inv[:16, 0].fill_(0x31)


def _cast_and_gather(lin):
    cast_master_weights_to_nvfp4([lin.weight], [_other(lin).view(-1)], [0])
    post_all_gather_processing([lin.weight])


def _field_replaced(lin):
    lin.weight.rowwise_data = fp4_dist.quantize(_other(lin)).rowwise_data


def _compute_copy_off_and_on(lin):
    lin.weight.quantize_(_other(lin))
    lin.weight.compute_copy = False
    lin.weight.compute_copy = True


ROUTES = [_copy_fp32, _copy_nvfp4, _quantize, _load_state_dict, _checkpoint, _amax_in_place, _bytes_in_place,
          _scales_in_place, _cast_and_gather, _field_replaced, _compute_copy_off_and_on]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_the_layers_next_forward_sees_bytes_changed_by_any_route(route, device):
    lin = nvfp4_linear(device=device)
    x = x_in(device=device)
    lin(x).sum().backward()
    old = lin(x)
    route(lin)
    got = lin(x)  # the layer's own forward first: its view must notice, not a compute_value() call before it
    want = x @ lin.weight.dequantize(torch.bfloat16).t()
    assert_bytes_equal(got, want, f"forward after {route.__name__}")
    assert not torch.equal(got, old), "the route must have changed the values (else this test cannot fail)"


def test_between_a_cast_and_its_gather_the_layer_computes_with_the_fresh_bytes():
    lin = nvfp4_linear()
    x = x_in()
    lin(x)
    master = other_values()
    cast_master_weights_to_nvfp4([lin.weight], [master.view(-1)], [0])
    assert_bytes_equal(lin(x), x @ fp4_dist.quantize(master.to(torch.bfloat16)).dequantize(torch.bfloat16).t())
    post_all_gather_processing([lin.weight])
    assert_bytes_equal(lin(x), x @ lin.weight.dequantize(torch.bfloat16).t())


def _forgotten_then_gathered(lin):
    forget(lin)  # the layer lets go of its view; only the recorded graph still holds it
    _cast_and_gather(lin)


@pytest.mark.parametrize("refresh", [_cast_and_gather, _forgotten_then_gathered, lambda lin: lin.weight.quantize_(
    other_values())], ids=["cast_and_gather", "forgotten_then_gathered", "quantize_then_next_use"])
def test_backward_through_a_graph_recorded_before_a_refresh_raises(refresh):
    lin = nvfp4_linear()
    x = x_in().requires_grad_()
    y = lin(x)
    refresh(lin)
    lin(x)  # the layer's next use (which refreshes the copy the first graph saved after quantize_)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_remade_views_do_not_pile_up_on_the_weight():
    lin = nvfp4_linear()
    x = x_in().requires_grad_()
    for i in range(50):  # each freeze or thaw makes the view again; nothing ever refreshes the copy
        lin.weight.requires_grad_(i % 2 == 0)
        lin(x).sum().backward()
    gc.collect()
    assert len(lin.weight._compute_copy.aliases) <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_uses_and_reentrant_checkpointing_keep_the_view(dispatches, device):
    from torch.utils.checkpoint import checkpoint

    lin = nvfp4_linear(device=device)
    ref = nvfp4_linear(device=device)
    x = x_in(device=device).requires_grad_()
    lin(x).sum().backward()
    dispatches.clear()
    for _ in range(3):  # forward under no_grad, recomputed with grad in the backward
        checkpoint(lin, x, use_reentrant=True).sum().backward()
        with torch.no_grad():
            lin(x)
    assert dispatches == []
    lin.weight.grad = ref.weight.grad = None
    checkpoint(lin, x, use_reentrant=True).sum().backward()
    ref(x).sum().backward()
    assert_bytes_equal(lin.weight.grad, ref.weight.grad, "weight gradient through the checkpoint")


def test_no_grad_inference_mode_and_frozen_weights():
    lin = nvfp4_linear()
    x = x_in()
    want = x @ lin.weight.dequantize(torch.bfloat16).t()
    with torch.no_grad():
        assert_bytes_equal(lin(x), want, "no_grad")
    with torch.inference_mode():
        assert_bytes_equal(lin(x), want, "inference_mode")
    y = lin(x)  # a view made under no_grad must not be reused with grad on
    assert y.requires_grad
    y.sum().backward()
    assert lin.weight.grad is not None
    lin.weight.requires_grad_(False)
    lin.weight.grad = None
    y = lin(x.requires_grad_())
    y.sum().backward()
    assert lin.weight.grad is None and x.grad is not None


def test_a_dropped_layer_frees_its_weight():
    lin = nvfp4_linear()
    lin(x_in()).sum().backward()
    ref = weakref.ref(lin.weight)
    value = weakref.ref(lin.weight._compute_copy.value)
    del lin
    gc.collect()
    assert ref() is None and value() is None


def test_turning_the_copy_off_frees_it_at_once():
    lin = nvfp4_linear()
    x = x_in()
    lin(x)
    value = weakref.ref(lin.weight._compute_copy.value)
    lin.weight.compute_copy = False
    gc.collect()
    assert value() is None, "the layer's view must not keep the dropped copy alive"
    assert_bytes_equal(lin(x), x @ lin.weight.dequantize(torch.bfloat16).t())


def test_deepcopy_and_pickle_of_a_layer_after_a_forward():
    lin = nvfp4_linear()
    x = x_in()
    lin(x).sum().backward()
    twin = copy.deepcopy(lin)
    assert twin.weight is not lin.weight
    assert_bytes_equal(twin(x), lin(x), "deep copy")
    twin.weight.quantize_(other_values())
    assert not torch.equal(twin(x), lin(x)), "the copy must compute with its own weight"
    loaded = pickle.loads(pickle.dumps(lin))
    assert_bytes_equal(loaded(x), lin(x), "pickled")
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    assert_bytes_equal(torch.load(buf, weights_only=False)(x), lin(x), "torch.save of the module")


def test_a_plain_weight_put_back_is_used_as_is():
    lin = nvfp4_linear()
    x = x_in()
    lin(x)
    lin.weight = nn.Parameter(torch.randn(M, K).to(torch.bfloat16))
    assert_bytes_equal(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize("kwargs, passes_view", [
    ({"gradient_accumulation_fusion": False, "gtp_remat_size": 1}, True),
    ({"gradient_accumulation_fusion": True, "gtp_remat_size": 1}, False),
    ({"gradient_accumulation_fusion": False, "gtp_remat_size": 2}, False),
])
def test_megatron_hook_passes_the_view_unless_megatrons_function_reads_the_parameter(kwargs, passes_view):
    # The replacement's decision only; real Megatron layers run through it in tests/distributed/test_megatron.py.
    lin = nvfp4_linear()
    seen = []
    impl = layers.make_forward_impl(lambda self, input, weight, *a, **kw: seen.append(weight))
    impl(lin, input=x_in(), weight=lin.weight, bias=None, **kwargs)
    assert (type(seen[0]) is torch.Tensor) is passes_view
    assert passes_view or seen[0] is lin.weight


@pytest.mark.parametrize("move", ["to_cpu", "bfloat16", "float", "to_meta"])
def test_moving_or_casting_the_layer_after_a_forward_works_and_computes_in_the_new_dtype(move):
    lin = nvfp4_linear()
    x = x_in()
    lin(x).sum().backward()
    {"to_cpu": lambda: lin.to("cpu"), "bfloat16": lin.bfloat16, "float": lin.float,
     "to_meta": lambda: lin.to("meta")}[move]()  # fmt: skip
    w = lin.weight
    assert type(w) is NVFP4Tensor
    if move == "to_meta":
        assert w.device.type == "meta"
        return
    x = x.to(w.dtype)
    assert_bytes_equal(lin(x), x @ w.dequantize(w.dtype).t(), f"forward after {move}")
