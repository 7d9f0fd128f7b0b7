"""`fp4_dist.tensor.copy`: ops on an NVFP4 weight read a copy made once per change of its bytes, never a
stale one, whatever route changed the bytes (CPU; the GPU kernel's bytes are in kernels/test_stages_dequantize.py)."""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist
from fp4_dist.tensor.copy import compute_copy_bytes, refresh_compute_copies
from fp4_dist.optim import Zero1Config, Zero1Optimizer
from fp4_dist.cast import cast_master_weights_to_nvfp4, post_all_gather_processing
from fp4_dist.testing import assert_bytes_equal, random_weight

M, K = 40, 48


def nvfp4_linear(seed=0, **kw):
    """A converted linear; with a kept compute copy (what this file tests) unless `compute_copy=False`."""
    torch.manual_seed(seed)
    lin = nn.Linear(K, M, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(lin, **{"compute_copy": True, **kw})
    return lin


def x_in(seed=1):
    return torch.randn(8, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def assert_uses_current_bytes(lin, label):
    """The forward equals x @ dequantize(current bytes)^T, and the weight's value equals that dequantization."""
    w = lin.weight
    deq = w.dequantize(w.dtype)
    assert_bytes_equal(w.compute_value(), deq, f"{label}: compute value")
    x = x_in()
    assert_bytes_equal(lin(x), x @ deq.t(), f"{label}: forward")


def other_values(seed=7):
    return random_weight(M, K, generator=torch.Generator().manual_seed(seed))


def test_value_is_made_once_and_reused_until_the_bytes_change():
    lin = nvfp4_linear()
    w = lin.weight
    v = w.compute_value()
    assert w.compute_value() is v
    lin(x_in()).sum().backward()
    assert w.compute_value() is v, "a forward + backward must not remake the copy"
    assert_uses_current_bytes(lin, "fresh")
    assert compute_copy_bytes(lin) == M * K * 2


def test_copy_from_high_precision_values_is_seen():
    lin = nvfp4_linear()
    lin(x_in())
    with torch.no_grad():
        lin.weight.copy_(other_values())
    assert_bytes_equal(lin.weight.rowwise_data, fp4_dist.quantize(other_values().to(torch.bfloat16)).rowwise_data)
    assert_uses_current_bytes(lin, "copy_ from fp32")


def test_copy_from_another_nvfp4_weight_is_seen():
    lin = nvfp4_linear()
    lin(x_in())
    with torch.no_grad():
        lin.weight.copy_(fp4_dist.quantize(other_values()))
    assert_uses_current_bytes(lin, "copy_ from NVFP4")


def test_quantize_in_place_is_seen():
    lin = nvfp4_linear()
    lin(x_in())
    lin.weight.quantize_(other_values())
    assert_uses_current_bytes(lin, "quantize_")


def test_load_state_dict_is_seen():
    lin, src = nvfp4_linear(seed=0), nvfp4_linear(seed=5)
    lin(x_in())
    lin.load_state_dict(src.state_dict())
    assert_bytes_equal(lin.weight.rowwise_data, src.weight.rowwise_data, "loaded bytes")
    assert_uses_current_bytes(lin, "load_state_dict")


def test_checkpoint_save_and_load_is_seen():
    lin, src = nvfp4_linear(seed=0), nvfp4_linear(seed=5)
    lin(x_in())
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    lin.load_state_dict(torch.load(buf, weights_only=True))
    assert_uses_current_bytes(lin, "torch.load + load_state_dict")


def test_direct_writes_into_the_fields_are_seen():
    lin = nvfp4_linear()
    lin(x_in())
    lin.weight.amax.mul_(2)
    assert_uses_current_bytes(lin, "amax written in place")
    lin.weight.rowwise_data.view(-1)[:7].fill_(0x5A)
    assert_uses_current_bytes(lin, "rowwise bytes written in place")
    lin.weight.rowwise_scale_inv[:16, 0].fill_(0x31)
    assert_uses_current_bytes(lin, "scales written in place")


def test_cast_then_post_all_gather_processing_refreshes_in_one_go():
    lin = nvfp4_linear()
    lin(x_in())
    master = other_values()
    cast_master_weights_to_nvfp4([lin.weight], [master.view(-1)], [0])
    post_all_gather_processing([lin.weight])
    assert_bytes_equal(lin.weight.rowwise_data, fp4_dist.quantize(master.to(torch.bfloat16)).rowwise_data)
    v = lin.weight._compute_copy.value
    assert lin.weight.compute_value() is v
    assert_uses_current_bytes(lin, "cast + post_all_gather_processing")


def test_between_cast_and_gather_every_use_dequantizes_afresh_and_says_so():
    lin = nvfp4_linear()
    lin(x_in())
    buffer = torch.zeros(M * K // 2, dtype=torch.uint8)
    lin.weight.set_rowwise_storage(buffer)
    master = other_values()
    cast_master_weights_to_nvfp4([lin.weight], [master.view(-1)[: M * K // 2]], [0])  # half the weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_uses_current_bytes(lin, "pending")
    said = [c for c in caught if "post_all_gather_processing" in str(c.message)]
    assert said and said[0].filename == __file__, "the warning points at the user's line"
    # The "gather" writes through the buffer, which the weight's own version counter does not see.
    buffer[M * K // 4:] = fp4_dist.quantize(master.to(torch.bfloat16)).rowwise_data.view(-1)[M * K // 4:]
    assert_uses_current_bytes(lin, "after the gather, still pending")
    post_all_gather_processing([lin.weight])
    assert_uses_current_bytes(lin, "after post_all_gather_processing")


def test_set_rowwise_storage_keeps_the_bytes_and_gets_its_own_version_counter():
    lin = nvfp4_linear()
    before = lin.weight.compute_value().clone()
    buffer = torch.zeros(2 * M * K, dtype=torch.uint8)
    lin.weight.set_rowwise_storage(buffer[M * K : M * K + M * K // 2])
    assert_bytes_equal(lin.weight.compute_value(), before, "same values after moving the bytes")
    v0 = lin.weight.rowwise_data._version
    buffer[:16].fill_(1)  # another weight's bytes in the same buffer
    assert lin.weight.rowwise_data._version == v0
    assert lin.weight.rowwise_data.data_ptr() == buffer[M * K:].data_ptr()


def test_zero1_step_refreshes_every_copy_with_one_bulk_refresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 48, bias=False)).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16, compute_copy=True)
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=0.5), config=Zero1Config())
    x = torch.randn(4, 48).to(torch.bfloat16)
    for step in range(3):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for lin, inp in ((model[0], x), (model[2], torch.randn(4, 80).to(torch.bfloat16))):
            w = lin.weight
            assert w._compute_copy.value is not None and w._compute_copy.fresh_for(w), f"step {step}"
            assert_uses_current_bytes_module(lin, inp, f"zero1 step {step}")
            assert w.columnwise_data is None, "columnwise copies are off by default"


def assert_uses_current_bytes_module(lin, x, label):
    w = lin.weight
    deq = w.dequantize(w.dtype)
    assert_bytes_equal(w.compute_value(), deq, f"{label}: compute value")
    assert_bytes_equal(lin(x), F.linear(x, deq, lin.bias), f"{label}: forward")


def test_an_in_place_change_of_a_view_of_the_value_is_undone_at_the_next_use():
    lin = nvfp4_linear()
    w = lin.weight
    good = w.compute_value().clone()
    with torch.no_grad():
        w.t().mul_(3)  # a view of the copy, written in place
    assert_bytes_equal(w.compute_value(), good, "value after a stray in-place write")


def test_backward_through_a_graph_recorded_before_a_refresh_raises():
    lin = nvfp4_linear()
    x = x_in().requires_grad_()
    y = lin(x)
    lin.weight.quantize_(other_values())
    lin.weight.compute_value()  # the refresh overwrites the copy the graph saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compute_copy_off_keeps_no_copy_and_gives_the_same_values():
    on, off = nvfp4_linear(), nvfp4_linear(compute_copy=False)
    assert off.weight.compute_copy is False
    x = x_in()
    assert_bytes_equal(off(x), on(x), "forward without a copy")
    assert off.weight._compute_copy.value is None and compute_copy_bytes(off) == 0
    on.weight.compute_copy = False
    assert on.weight._compute_copy.value is None, "turning the copy off frees it"
    refresh_compute_copies([on.weight])
    assert on.weight._compute_copy.value is None


def test_aliases_share_one_copy_and_clones_get_their_own():
    lin = nvfp4_linear()
    w = lin.weight
    alias = w.detach()
    assert alias._compute_copy is w._compute_copy
    clone = w.clone()
    assert clone._compute_copy is not w._compute_copy
    assert_bytes_equal(clone.compute_value(), w.compute_value(), "clone's value")


def test_data_and_detach_share_every_field_and_the_parameters_python_attributes():
    lin = nvfp4_linear()
    w = lin.weight
    w.make_columnwise()
    w.tensor_model_parallel = True  # what Megatron hangs on a parameter; nn.Module._apply keeps exactly the
    # attributes of nn.Parameter(fn(param)), a detach, so an alias must carry them (test_module_apply below)
    for alias in (w.data, w.detach()):
        assert type(alias) is type(w) and not alias.requires_grad and alias.tensor_model_parallel is True
        assert not isinstance(alias, torch.nn.Parameter) and "_is_param" not in vars(alias)
        assert (alias.shape, alias.dtype, alias.device, alias.numerics) == (w.shape, w.dtype, w.device, w.numerics)
        for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv"):
            assert getattr(alias, f) is getattr(w, f), f
        assert alias._compute_copy is w._compute_copy
    # An alias is a weight in its own right: re-quantizing through it changes the parameter (same storage),
    # and the parameter's next use sees the new bytes.
    w.data.quantize_(other_values())
    assert_uses_current_bytes(lin, "after quantize_ through .data")


def test_ops_taking_lists_and_keywords_see_the_value():
    lin = nvfp4_linear()
    w = lin.weight
    deq = w.dequantize(w.dtype)
    assert_bytes_equal(torch.cat([w, w]), torch.cat([deq, deq]), "cat of a list")
    assert_bytes_equal(torch.add(deq, other=w, alpha=2), torch.add(deq, deq, alpha=2), "keyword argument")
    assert_bytes_equal(w.expand(-1, -1), deq, "expand")
    assert_bytes_equal(w.expand(2, M, K), deq.expand(2, M, K), "expand to a batch")
    assert_bytes_equal(torch.ops.aten.expand.default(w, [M, K], implicit=True), deq, "expand with a keyword")


def test_pickled_weight_keeps_its_compute_copy_setting():
    lin = nvfp4_linear(compute_copy=False)
    buf = io.BytesIO()
    torch.save(lin.weight, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded.compute_copy is False
    assert_bytes_equal(loaded.dequantize(), lin.weight.dequantize(), "values after a round trip")


def test_tes_manual_false_refreshes_the_copy_at_the_first_use_after_the_cast_once(monkeypatch):
    import fp4_dist.compute.view
    import fp4_dist.tensor

    refreshes = []
    for module in (fp4_dist.compute.view, fp4_dist.tensor.nvfp4):
        real = module.refresh_compute_copies
        monkeypatch.setattr(module, "refresh_compute_copies", lambda ws, real=real: (refreshes.append(1), real(ws)))
    lin = nvfp4_linear()
    lin(x_in())
    master = other_values()
    cast_master_weights_to_nvfp4([lin.weight], [master.view(-1)], [0], manual_post_all_gather_processing=False)
    refreshes.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "used N times between a cast and post_all_gather_processing"
        for _ in range(4):
            assert_uses_current_bytes(lin, "manual=False")
    assert len(refreshes) == 1, f"{len(refreshes)} refreshes for 4 uses after one cast"
    assert not lin.weight.copy_state.pending and lin.weight.columnwise_data is None
