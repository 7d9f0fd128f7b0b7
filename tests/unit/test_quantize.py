"""fp4_dist.quantize and NVFP4Tensor: fields, columnwise copy, bad input, and use as a trainable parameter."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp4_dist
from fp4_dist.format import rowwise_scale_shape
from fp4_dist.testing import assert_bytes_equal, random_weight
from tests.unit import spec_oracle as O

SHAPES = [(16, 16), (23, 48), (40, 80), (130, 64), (7, 144)]


@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "heavy"])
@pytest.mark.parametrize("m,k", SHAPES, ids=[f"M{m}-K{k}" for m, k in SHAPES])
def test_quantize_bf16_input_sets_every_field_like_the_spec(m, k, heavy):
    w = random_weight(m, k, heavy_tailed=heavy, generator=torch.Generator().manual_seed(m * k)).to(torch.bfloat16)
    q = fp4_dist.quantize(w)
    codes, scales, amax = O.quantize(w.float().numpy())
    assert q.shape == (m, k) and q.dtype == torch.bfloat16 and isinstance(q, fp4_dist.NVFP4Tensor)
    assert_bytes_equal(q.rowwise_data, torch.from_numpy(O.pack(codes)), "rowwise_data")
    assert q.rowwise_scale_inv.shape == rowwise_scale_shape(m, k)
    tk = scales.shape[1]
    assert_bytes_equal(q.rowwise_scale_inv[:m, :tk], torch.from_numpy(np.repeat(scales, 16, 0)[:m]), "scales")
    padding = q.rowwise_scale_inv.clone()
    padding[:m, :tk] = 0
    assert int(padding.count_nonzero()) == 0
    assert q.amax.dtype == torch.float32 and q.amax.shape == (1,) and float(q.amax) == float(amax)
    assert q.columnwise_data is None and q.columnwise_scale_inv is None
    err = ((q.dequantize() - w.float()).norm() / w.float().norm()).item()
    assert 0.02 < err < (0.3 if heavy else 0.15)


def test_quantize_of_fp32_equals_quantize_of_its_bf16_rounding():
    w = torch.randn(48, 64)
    a, b = fp4_dist.quantize(w), fp4_dist.quantize(w.to(torch.bfloat16))
    assert_bytes_equal(a.rowwise_data, b.rowwise_data)
    assert_bytes_equal(a.rowwise_scale_inv, b.rowwise_scale_inv)


def test_make_columnwise_matches_transposed_codes_and_scales():
    m, k = 34, 80
    w = random_weight(m, k, generator=torch.Generator().manual_seed(3))
    q = fp4_dist.quantize(w).make_columnwise()
    codes, scales, _ = O.quantize(w.to(torch.bfloat16).float().numpy())
    assert_bytes_equal(q.columnwise_data, torch.from_numpy(O.pack(np.ascontiguousarray(codes.T))), "columnwise_data")
    cs = q.columnwise_scale_inv
    assert cs.shape == (128, 4)
    want = np.zeros((128, 4), np.uint8)
    want[:k, :3] = np.repeat(scales.T, 16, axis=0)[:k]
    assert_bytes_equal(cs, torch.from_numpy(want), "columnwise_scale_inv")


@pytest.mark.parametrize(
    "x,exc,match",
    [
        (torch.randn(32), ValueError, "2D"),
        (torch.randn(2, 4, 16), ValueError, "2D"),
        (torch.randn(32, 24), ValueError, "multiple of 16"),
        (torch.randint(0, 5, (16, 16)), TypeError, "dtype"),
        (torch.randn(16, 16).to(torch.float8_e4m3fn), TypeError, "dtype"),
    ],
    ids=["1d", "3d", "k24", "int", "fp8"],
)
def test_quantize_rejects_bad_input_with_a_named_error(x, exc, match):
    with pytest.raises(exc, match=match):
        fp4_dist.quantize(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_and_leave_the_target_untouched(bad):
    with pytest.raises(ValueError, match="non-finite"):
        fp4_dist.quantize(torch.tensor([[bad] + [1.0] * 15]))
    q = fp4_dist.quantize(torch.randn(32, 32))
    before = {f: getattr(q, f).clone() for f in ("rowwise_data", "rowwise_scale_inv", "amax")}
    src = torch.randn(32, 32)
    src[31, 31] = bad
    with pytest.raises(ValueError, match="non-finite"):
        q.quantize_(src)
    for f, t in before.items():
        assert torch.equal(getattr(q, f), t), f"{f} was modified"


def test_odd_m_cannot_make_a_columnwise_copy():
    with pytest.raises(ValueError, match="even M"):
        fp4_dist.quantize(torch.randn(17, 32)).make_columnwise()


def test_numerics_option_is_validated_and_kept():
    assert fp4_dist.quantize(torch.randn(16, 16), numerics="te-2.14").numerics == "te-2.14"
    with pytest.raises(ValueError, match="numerics"):
        fp4_dist.quantize(torch.randn(16, 16), numerics="fast")


def test_empty_is_all_zero_with_the_right_shapes():
    t = fp4_dist.NVFP4Tensor.empty((40, 48))
    assert t.shape == (40, 48) and t.dtype == torch.bfloat16
    assert t.rowwise_data.shape == (40, 24) and int(t.rowwise_data.count_nonzero()) == 0
    assert t.rowwise_scale_inv.shape == (128, 4) and float(t.amax) == 0.0
    assert torch.equal(t.dequantize(), torch.zeros(40, 48))


def test_quantize_into_keeps_the_storage_of_every_field():
    q = fp4_dist.quantize(torch.randn(32, 32)).make_columnwise()
    ptrs = [getattr(q, f).data_ptr() for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data")]
    src = torch.randn(32, 32)
    q.quantize_(src)
    ref = fp4_dist.quantize(src).make_columnwise()
    assert [getattr(q, f).data_ptr() for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data")] == ptrs
    assert_bytes_equal(q.rowwise_data, ref.rowwise_data)
    assert_bytes_equal(q.columnwise_data, ref.columnwise_data)


def test_in_place_arithmetic_on_packed_weights_is_refused():
    q = fp4_dist.quantize(torch.randn(16, 16))
    with pytest.raises(NotImplementedError, match="re-quantize"):
        q.add_(1.0)


def test_compute_ops_run_on_the_dequantized_value():
    w = torch.randn(32, 48)
    q = fp4_dist.quantize(w)
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    deq = q.dequantize(torch.bfloat16)
    assert torch.equal(F.linear(x, q), F.linear(x, deq))
    assert torch.equal(q.t(), deq.t()) and torch.equal(x @ q.t(), x @ deq.t())
    assert torch.equal(q.float(), q.dequantize())


@pytest.mark.parametrize("like", [torch.empty_like, torch.zeros_like, torch.ones_like], ids=lambda f: f.__name__)
def test_like_constructors_give_plain_tensors_of_the_weight_shape_and_dtype(like):
    # torch.optim (Adam's exp_avg, ...) builds its state with zeros_like(param, memory_format=preserve_format)
    q = nn.Parameter(fp4_dist.quantize(torch.randn(34, 80)))
    r = like(q, memory_format=torch.preserve_format)
    assert type(r) is torch.Tensor and r.shape == (34, 80) and r.dtype == torch.bfloat16 and r.is_contiguous()
    assert torch.equal(torch.full_like(q, 2.0, dtype=torch.float32), torch.full((34, 80), 2.0))


def test_set_rowwise_storage_refuses_a_strided_view():
    q = fp4_dist.quantize(torch.randn(34, 80))
    before = q.rowwise_data.clone()
    with pytest.raises(ValueError, match="contiguous"):
        q.set_rowwise_storage(torch.zeros(34 * 80, dtype=torch.uint8)[::2])
    assert q.rowwise_data.is_contiguous() and torch.equal(q.rowwise_data, before)


def test_save_load_round_trips_the_packed_fields():
    q = fp4_dist.quantize(torch.randn(32, 48)).make_columnwise()
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    r = torch.load(buf, weights_only=False)["w"]
    assert isinstance(r, fp4_dist.NVFP4Tensor)
    for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv"):
        assert_bytes_equal(getattr(r, f), getattr(q, f), f)


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(F.relu(self.down(F.relu(self.up(x)))))


def test_model_with_nvfp4_linear_weights_trains_on_cpu_with_fp32_masters():
    torch.manual_seed(0)
    model = TinyMLP().to(torch.bfloat16)
    report = fp4_dist.convert_linear_weights(model, skip=("head",))
    assert report.converted == ["up", "down"] and "head" in report.skipped
    nvfp4 = [p for p in model.parameters() if isinstance(p, fp4_dist.NVFP4Tensor)]
    masters = [p.dequantize().clone().requires_grad_(False) for p in nvfp4]
    opt = torch.optim.SGD(masters, lr=0.5)
    x, y = torch.randn(64, 32, dtype=torch.bfloat16), torch.randint(0, 10, (64,))
    before = [p.rowwise_data.clone() for p in nvfp4]
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        for p, m in zip(nvfp4, masters):
            assert p.grad is not None and p.grad.shape == p.shape and type(p.grad) is torch.Tensor
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(nvfp4, masters):
                p.quantize_(m)
        model.head.weight.grad = model.head.bias.grad = None
        losses.append(loss.item())
    assert any(not torch.equal(b, p.rowwise_data) for b, p in zip(before, nvfp4)), "weights did not change"
    assert losses[-1] < losses[0]


def test_convert_linear_weights_says_which_weights_stay_high_precision():
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 10), nn.Linear(10, 16))
    with pytest.warns(UserWarning, match="in_features = 10"):
        report = fp4_dist.convert_linear_weights(model)
    assert report.converted == ["0", "1"] and list(report.skipped) == ["2"]
    assert isinstance(model[0].weight, fp4_dist.NVFP4Tensor) and not isinstance(model[2].weight, fp4_dist.NVFP4Tensor)


def test_default_weights_only_torch_load_restores_an_nvfp4_tensor():
    q = fp4_dist.quantize(torch.randn(32, 48))
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    r = torch.load(buf)["w"]  # weights_only=True is torch's default
    assert isinstance(r, fp4_dist.NVFP4Tensor)
    assert_bytes_equal(r.rowwise_data, q.rowwise_data)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8])
def test_nvfp4_tensor_refuses_a_model_dtype_it_cannot_compute_in(dtype):
    with pytest.raises(TypeError, match="model dtype"):
        fp4_dist.NVFP4Tensor.empty((16, 16), dtype=dtype)


class TiedLM(nn.Module):
    """An embedding tied to the output head (as in GPT-2 and Llama), with a linear between."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mid = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_tied_weights_stay_one_nvfp4_parameter_and_train_as_the_untied_reference():
    torch.manual_seed(0)
    model = TiedLM().to(torch.bfloat16)
    ref = TiedLM().to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    report = fp4_dist.convert_linear_weights(model)
    assert report.tied == {"head": ["emb.weight"]} and len(list(model.parameters())) == 2
    assert model.emb.weight is model.head.weight and isinstance(model.emb.weight, fp4_dist.NVFP4Tensor)
    # the reference: the same tied weight, its values replaced by the NVFP4 weights' dequantized values
    with torch.no_grad():
        ref.emb.weight.copy_(model.emb.weight.dequantize(torch.bfloat16))
        ref.mid.weight.copy_(model.mid.weight.dequantize(torch.bfloat16))
    ids = torch.randint(0, 64, (4, 8))
    out, want = model(ids), ref(ids)
    assert_bytes_equal(out, want, "logits")
    out.float().square().mean().backward()
    want.float().square().mean().backward()
    assert_bytes_equal(model.head.weight.grad, ref.head.weight.grad, "tied gradient (embedding + head)")
    assert_bytes_equal(model.mid.weight.grad, ref.mid.weight.grad, "linear gradient")


def test_a_second_conversion_changes_nothing_and_the_dtype_follows_each_linear():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16).to(torch.bfloat16))
    first = fp4_dist.convert_linear_weights(model)
    weights = [m.weight for m in model]
    assert [w.dtype for w in weights] == [torch.float32, torch.bfloat16]
    second = fp4_dist.convert_linear_weights(model)
    assert first.converted == ["0", "1"] and second.converted == [] and not second.skipped
    assert all(m.weight is w for m, w in zip(model, weights))
    assert fp4_dist.convert_linear_weights(nn.Linear(32, 16), dtype=torch.float16).converted == [""]
    with pytest.raises(TypeError, match="must be an nn.Module, got NoneType"):
        fp4_dist.convert_linear_weights(None)


def test_a_plain_torch_optimizer_on_nvfp4_weights_says_how_they_train():
    model = nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(NotImplementedError, match="Zero1Optimizer.*fully_shard_nvfp4"):
        opt.step()


def test_a_skip_entry_naming_no_linear_is_refused_and_a_block_name_keeps_its_linears():
    # A typo ("heads") left the head it meant in 4 bits with no word; a block's name matched nothing.
    model = nn.Sequential(TinyMLP(), nn.Linear(32, 16))  # (a container: no forward runs)
    with pytest.raises(ValueError, match=r"skip names no linear layer of this model: '0.heads' \(did you mean "
                                         r"'0.head'\?\)"):  # fmt: skip
        fp4_dist.convert_linear_weights(model, skip=("0.heads",))
    assert not any(isinstance(p, fp4_dist.NVFP4Tensor) for p in model.parameters()), "converted before refusing"
    report = fp4_dist.convert_linear_weights(model, skip=("0",))
    assert report.converted == ["1"] and sorted(report.skipped) == ["0.down", "0.head", "0.up"]


def test_shared_amax_patterns_that_form_no_group_are_said():
    with pytest.warns(UserWarning, match=r"shared_amax \[\('q', 'k'\)\] forms no group of sibling linears"):
        fp4_dist.convert_linear_weights(TinyMLP(), shared_amax=(("q", "k"),))


def test_a_shared_amax_group_with_a_member_kept_in_high_precision_is_said():
    from fp4_dist.export import VLLM_FUSED

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, 32) for _ in range(3))

    model = nn.Sequential(Attention())
    with pytest.warns(UserWarning, match=r"shared_amax groups are split.*0.k_proj \(of 0.q_proj.weight, "
                                         r"0.k_proj.weight, 0.v_proj.weight\)"):  # fmt: skip
        report = fp4_dist.convert_linear_weights(model, shared_amax=VLLM_FUSED, skip=("0.k_proj",))
    assert sorted(report.shared_amax) == ["0.q_proj.weight", "0.v_proj.weight"]
