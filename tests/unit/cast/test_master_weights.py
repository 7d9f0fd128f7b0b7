"""`fp4_dist.cast.master_weights` in one process: cast of master shards, validation, post-all-gather processing.

The multi-rank parity (amaxes merged by the all-reduce) is in tests/distributed/suite_cast.py.
"""

import random

import pytest
import torch

import fp4_dist
from fp4_dist.cast import cast_master_weights_to_nvfp4, post_all_gather_processing, quantize_master_weights
from fp4_dist.cast import master_weights as cast_mod
from fp4_dist.cast.core import BINDINGS
from fp4_dist.tensor import NVFP4Tensor
from fp4_dist.testing import assert_bytes_equal, awkward_shapes, poison_, random_weight

FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


def poisoned_weights(shapes, dtype=torch.bfloat16):
    ws = [NVFP4Tensor.empty(s, dtype=dtype) for s in shapes]
    for w in ws:
        for f in FIELDS:
            poison_(getattr(w, f))
    return ws


def snapshot(ws):
    return [{f: getattr(w, f).clone() for f in FIELDS} for w in ws]


def assert_untouched(ws, snap):
    for i, (w, s) in enumerate(zip(ws, snap)):
        for f in FIELDS:
            assert_bytes_equal(getattr(w, f), s[f], f"weight {i} {f}")


def masters_for(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [random_weight(m, k, generator=g, heavy_tailed=i % 2 == 1) for i, (m, k) in enumerate(shapes)]


def test_full_shards_cast_equals_quantize_of_bf16_master_for_awkward_shapes():
    shapes = awkward_shapes(random.Random(1), 8) + [(272, 80), (16, 16), (1, 48)]
    masters = masters_for(shapes)
    ws = poisoned_weights(shapes)
    cast_master_weights_to_nvfp4(ws, [m.view(-1) for m in masters], [0] * len(ws))
    for i, (w, m) in enumerate(zip(ws, masters)):
        ref = fp4_dist.quantize(m.to(torch.bfloat16))
        for f in FIELDS:
            assert_bytes_equal(getattr(w, f), getattr(ref, f), f"weight {i} {shapes[i]} {f}")


def test_partial_shard_writes_only_its_byte_range():
    m, k = 40, 48
    master = random_weight(m, k).view(-1)
    (w,) = poisoned_weights([(m, k)])
    start, end = 2 * 137, 2 * 611  # mid-tile, mid-row
    cast_master_weights_to_nvfp4([w], [master[start:end]], [start])
    data = w.rowwise_data.view(-1)
    assert (data[: start // 2] == 0xA5).all() and (data[end // 2:] == 0xA5).all()
    assert not (data[start // 2:end // 2] == 0xA5).all()


def test_quantize_master_weights_is_the_same_function():
    assert quantize_master_weights is cast_master_weights_to_nvfp4
    assert fp4_dist.cast_master_weights_to_nvfp4 is cast_master_weights_to_nvfp4


def test_fsdp_fragment_receives_the_bytes_instead_of_rowwise_data():
    m, k = 33, 80
    master = random_weight(m, k).view(-1)
    (w,) = poisoned_weights([(m, k)])
    rowwise_before = w.rowwise_data.clone()
    frag = torch.full((m * k // 2,), 0xA5, dtype=torch.uint8)
    cast_master_weights_to_nvfp4([w], [master], [0], fsdp_shard_model_weights=[frag])
    ref = fp4_dist.quantize(master.view(m, k).to(torch.bfloat16))
    assert_bytes_equal(frag, ref.rowwise_data.view(-1), "fragment")
    assert_bytes_equal(w.rowwise_data, rowwise_before, "rowwise_data")
    assert_bytes_equal(w.rowwise_scale_inv, ref.rowwise_scale_inv, "scales")


def test_weights_without_a_shard_still_get_scales_and_amax():
    shapes = [(32, 16), (48, 48)]
    masters = masters_for(shapes)
    ws = poisoned_weights(shapes)
    cast_master_weights_to_nvfp4(ws, [masters[0].view(-1), None], [0, None])
    assert (ws[1].amax == 0).all() and (ws[1].rowwise_scale_inv == 0).all()
    assert (ws[1].rowwise_data == 0xA5).all()


def test_empty_master_with_no_start_offset_owns_nothing():
    shapes = [(32, 16), (48, 48)]
    masters = masters_for(shapes)
    ws = poisoned_weights(shapes)
    cast_master_weights_to_nvfp4(ws, [masters[0].view(-1), torch.empty(0)], [0, None])
    assert (ws[1].rowwise_data == 0xA5).all() and (ws[1].amax == 0).all()


def test_manual_false_drops_stale_columnwise_copies():
    (w,) = poisoned_weights([(32, 32)])
    w.make_columnwise()
    cast_master_weights_to_nvfp4([w], [random_weight(32, 32).view(-1)], [0], manual_post_all_gather_processing=False)
    assert w.columnwise_data is None and w.columnwise_scale_inv is None


def test_the_cast_is_bound_once_per_set_of_tensors_and_again_for_new_ones(monkeypatch):
    shapes = ((32, 16), (48, 48))
    BINDINGS.clear()
    built = []
    real = cast_mod.BoundCast.__init__
    monkeypatch.setattr(cast_mod.BoundCast, "__init__", lambda self, *a, **k: (built.append(1), real(self, *a, **k))[1])
    ws = poisoned_weights(shapes)
    masters = [torch.randn(m * k) for m, k in shapes]
    for _ in range(3):
        for m in masters:
            m.normal_()
        cast_master_weights_to_nvfp4(ws, masters, [0, 0])
        for w, m, shape in zip(ws, masters, shapes):
            assert_bytes_equal(w.rowwise_data, fp4_dist.quantize(m.view(shape)).rowwise_data, "rowwise_data")
    assert len(built) == 1
    cast_master_weights_to_nvfp4(poisoned_weights(shapes), masters, [0, 0])
    assert len(built) == 2


def test_mixed_model_dtypes_and_numerics_share_one_call():
    shapes = [(40, 48), (24, 80), (16, 32)]
    masters = masters_for(shapes, seed=3)
    ws = poisoned_weights(shapes[:2]) + poisoned_weights(shapes[2:], dtype=torch.float16)
    ws[1].numerics = "te-2.14"
    cast_master_weights_to_nvfp4(ws, [m.view(-1) for m in masters], [0, 0, 0])
    for i, (w, m) in enumerate(zip(ws, masters)):
        ref = fp4_dist.quantize(m, numerics=w.numerics, dtype=w.dtype)
        for f in FIELDS:
            assert_bytes_equal(getattr(w, f), getattr(ref, f), f"weight {i} {f}")


# ----------------------------------------------------------------------------------------------- bad input
def _bad_cases():
    m, k = 40, 48
    good = random_weight(m, k).view(-1)
    nan = good.clone()
    nan[1000] = float("nan")
    inf = good.clone()
    inf[7] = -float("inf")
    return {
        "odd-start": ([good[3:101]], [3], ValueError, "odd boundary"),
        "odd-end": ([good[0:101]], [0], ValueError, "odd boundary"),
        "past-the-end": ([good[100:]], [102], ValueError, "does not match"),
        "negative-start": ([good[:100]], [-2], ValueError, "does not match"),
        "fp16-master": ([good.half()], [0], TypeError, "fp32"),
        "fp64-master": ([good.double()], [0], TypeError, "fp32"),
        "meta-device": ([torch.empty(m * k, device="meta")], [0], ValueError, "device|is on"),
        "2d-master": ([good.view(m, k)], [0], ValueError, "flat"),
        "non-contiguous": ([good[::2]], [0], ValueError, "flat contiguous"),
        "missing-start": ([good], [None], TypeError, "start offset"),
        "nan-master": ([nan], [0], ValueError, "not finite"),
        "inf-master": ([inf], [0], ValueError, "not finite"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_naming_the_weight_and_leaves_every_weight_untouched(case):
    masters, starts, exc, match = _bad_cases()[case]
    ws = poisoned_weights([(16, 16), (40, 48)])
    snap = snapshot(ws)
    with pytest.raises(exc, match=match) as info:
        cast_master_weights_to_nvfp4(ws, [random_weight(16, 16).view(-1)] + masters, [0] + starts)
    assert "model_weights[1] (40x48)" in str(info.value)
    assert_untouched(ws, snap)


def test_non_nvfp4_model_weight_is_refused_by_type():
    with pytest.raises(TypeError, match="model_weights\\[0\\].*NVFP4Tensor"):
        cast_master_weights_to_nvfp4([torch.zeros(16, 16)], [torch.zeros(256)], [0])


def test_list_length_mismatch_is_refused():
    ws = poisoned_weights([(16, 16)])
    with pytest.raises(ValueError, match="one of each per weight"):
        cast_master_weights_to_nvfp4(ws, [torch.zeros(256)], [0, 0])


def test_bad_fsdp_fragment_is_refused_before_writing():
    ws = poisoned_weights([(16, 16)])
    snap = snapshot(ws)
    with pytest.raises(ValueError, match="FSDP fragment"):
        cast_master_weights_to_nvfp4(ws, [torch.randn(256)], [0], fsdp_shard_model_weights=[torch.zeros(3, dtype=torch.uint8)])
    assert_untouched(ws, snap)



@pytest.mark.parametrize("fragment", [torch.zeros(256, dtype=torch.uint8)[::2], torch.zeros(8, 16, dtype=torch.uint8)],
                         ids=["strided", "2d"])
def test_fsdp_fragment_of_the_right_size_but_not_flat_contiguous_is_refused_naming_the_weight(fragment):
    # Checked with the other per-rank checks (so the rank still joins the all-reduce), not first in the kernels.
    ws = poisoned_weights([(16, 16)])
    snap = snapshot(ws)
    with pytest.raises(ValueError, match=r"model_weights\[0\] \(16x16\): FSDP fragment .*flat contiguous"):
        cast_master_weights_to_nvfp4(ws, [torch.randn(256)], [0], fsdp_shard_model_weights=[fragment])
    assert_untouched(ws, snap)

# ----------------------------------------------------------------------------------- post all-gather
def test_post_all_gather_processing_builds_columnwise_like_make_columnwise():
    shapes = [(32, 48), (18, 80), (33, 16)]  # the odd-M weight stays rowwise-only
    masters = masters_for(shapes, seed=5)
    ws = poisoned_weights(shapes)
    cast_master_weights_to_nvfp4(ws, [m.view(-1) for m in masters], [0, 0, 0])
    post_all_gather_processing(ws + [torch.zeros(3)])
    for w, m in zip(ws[:2], masters):
        ref = fp4_dist.quantize(m).make_columnwise()
        assert_bytes_equal(w.columnwise_data, ref.columnwise_data, "columnwise_data")
        assert_bytes_equal(w.columnwise_scale_inv, ref.columnwise_scale_inv, "columnwise_scale_inv")
    assert ws[2].columnwise_data is None


def test_a_call_after_a_numerics_change_casts_with_the_new_numerics_not_the_cached_binding():
    from fp4_dist.testing import numerics_sensitive_weight

    master = numerics_sensitive_weight()
    (w,) = poisoned_weights([tuple(master.shape)])
    cast_master_weights_to_nvfp4([w], [master.view(-1)], [0])  # binds the launches with numerics "te"
    w.numerics = "te-2.14"
    cast_master_weights_to_nvfp4([w], [master.view(-1)], [0])
    ref = fp4_dist.quantize(master.to(torch.bfloat16), numerics="te-2.14")
    assert not torch.equal(ref.rowwise_scale_inv, fp4_dist.quantize(master.to(torch.bfloat16)).rowwise_scale_inv)
    for f in FIELDS:
        assert_bytes_equal(getattr(w, f), getattr(ref, f), f"{f} after te -> te-2.14")


def test_errors_name_a_converted_weight_by_its_module_path():
    model = torch.nn.Sequential(torch.nn.Linear(48, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
    fp4_dist.convert_linear_weights(model)
    masters = [p.dequantize(torch.float32).reshape(-1).clone() for p in model.parameters()]
    masters[1][5] = float("nan")
    with pytest.raises(ValueError, match=r"model_weights\[1\] \(16x32\) = 1\.weight master"):
        cast_master_weights_to_nvfp4(list(model.parameters()), masters, [0, 0])


def _deferred_case(device):
    shapes = [(40, 48), (33, 80)]
    masters = [m.to(device) for m in masters_for(shapes, seed=3)]
    ws = [w.to(device) for w in poisoned_weights(shapes)]
    return ws, [m.view(-1) for m in masters], masters


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_deferred_check_writes_the_same_bytes_and_reports_a_nan_master_at_resolve(device):
    ws, flat, masters = _deferred_case(device)
    check = cast_master_weights_to_nvfp4(ws, flat, [0, 0], defer_check=True)
    check.resolve()  # finite masters: nothing to report
    for w, m in zip(ws, masters):
        ref = fp4_dist.quantize(m.to(torch.bfloat16))
        for f in FIELDS:
            assert_bytes_equal(getattr(w, f), getattr(ref, f), f)
    flat[1][77] = float("nan")
    check = cast_master_weights_to_nvfp4(ws, flat, [0, 0], defer_check=True)  # no raise: nothing read yet
    for _ in range(2):  # resolving again reports again
        with pytest.raises(ValueError, match=r"model_weights\[1\] \(33x80\) master.*resume from a checkpoint"):
            check.resolve()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_unresolved_deferred_check_is_resolved_by_the_next_cast_of_the_same_tensors(device):
    # The verdict's host flag is reused by the next cast: it must not overwrite a NaN verdict nobody read.
    ws, flat, _ = _deferred_case(device)
    flat[0][5] = float("inf")
    cast_master_weights_to_nvfp4(ws, flat, [0, 0], defer_check=True)
    flat[0][5] = 1.0
    with pytest.raises(ValueError, match=r"model_weights\[0\] \(40x48\) master"):
        cast_master_weights_to_nvfp4(ws, flat, [0, 0], defer_check=True)
    cast_master_weights_to_nvfp4(ws, flat, [0, 0], defer_check=True).resolve()  # reported once, then clean


def test_without_defer_check_the_cast_returns_nothing_and_raises_at_once():
    ws, flat, _ = _deferred_case("cpu")
    assert cast_master_weights_to_nvfp4(ws, flat, [0, 0]) is None
    flat[0][0] = float("nan")
    with pytest.raises(ValueError, match="No weight, scale or amax was written"):
        cast_master_weights_to_nvfp4(ws, flat, [0, 0])
