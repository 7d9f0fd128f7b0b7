"""fp4_dist/optim/zero1.py in one process (the multi-rank parity runs in tests/distributed/suite_train.py)."""

import warnings

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.optim import Zero1Config, Zero1Optimizer


def mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 40, bias=False))
    init = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    return model, init


def adam(groups):
    return torch.optim.Adam(groups, lr=1e-2, foreach=False)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 48, generator=g).to(torch.bfloat16)


def loss_of(model, x):
    return model(x).float().pow(2).mean()


def test_one_process_training_equals_quantizing_full_masters_each_step():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init, config=Zero1Config(bucket_numel=1000))
    ref_model, _ = mlp()
    masters = [t.clone() for t in init]
    ref_opt = adam([{"params": masters}])
    for step in range(8):
        for (name, p), m in zip(list(ref_model.named_parameters()), masters):
            mod = ref_model.get_submodule(name.rsplit(".", 1)[0])
            if fp4_dist.is_nvfp4_tensor(p):
                setattr(mod, "weight", nn.Parameter(fp4_dist.quantize(m.to(torch.bfloat16))))
            else:
                p.data = m.to(torch.bfloat16)
        ref_params = list(ref_model.parameters())
        ref_loss = loss_of(ref_model, data(step))
        for m, g in zip(masters, torch.autograd.grad(ref_loss, ref_params)):
            m.grad = g.float()
        ref_opt.step()
        loss = loss_of(model, data(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.equal(loss, ref_loss), f"step {step}: {loss.item()} != {ref_loss.item()}"


def test_params_alias_the_gather_buffers():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    fp4_sec = next(s for s in opt._sections if s.packed)
    dense_sec = next(s for s in opt._sections if not s.packed)
    lo, hi = fp4_sec.buf.param.data_ptr(), fp4_sec.buf.param.data_ptr() + fp4_sec.buf.param.numel()
    assert all(lo <= w.rowwise_data.data_ptr() < hi for w in opt.nvfp4_params)
    bias = model[0].bias
    assert bias.data_ptr() == dense_sec.buf.param_view(0).data_ptr()


def test_full_masters_return_the_initial_values_before_any_step():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    for got, want in zip(opt.full_masters(), init):
        assert torch.equal(got, want)


def test_state_dict_round_trip_restores_masters_and_weights():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    loss_of(model, data(0)).backward()
    opt.step()
    state = {k: v for k, v in opt.local_state_dict().items()}
    state = {"optimizer": state["optimizer"], "masters": [m.clone() for m in state["masters"]]}
    saved = [w.rowwise_data.clone() for w in opt.nvfp4_params]
    for step in range(1, 3):
        loss_of(model, data(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.load_local_state_dict(state)
    for w, s in zip(opt.nvfp4_params, saved):
        assert torch.equal(w.rowwise_data, s)


def test_param_group_options_reach_the_inner_optimizer():
    model, init = mlp()
    groups = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
              {"params": [model[0].bias], "weight_decay": 0.0}]
    opt = Zero1Optimizer(groups, adam, master_init=[init[0], init[2], init[1]])
    assert [g["weight_decay"] for g in opt.optimizer.param_groups] == [0.1, 0.0]


def _state(opt):
    """Every byte a step may change: NVFP4 fields, dense params, masters, the inner optimizer's state."""
    out = [t.clone() for w in opt.nvfp4_params for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax)]
    out += [p.detach().clone() for p in opt.params if not isinstance(p, fp4_dist.NVFP4Tensor)]
    out += [m.clone() for m in opt.full_masters()]
    out += [v.clone() for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a, b):
    """Bitwise equal (NaN included)."""
    bits = lambda t: t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t  # noqa: E731
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradients_raise_naming_the_parameter_and_leave_every_state_as_it_was(bad):
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    loss_of(model, data(0)).backward()
    opt.step()  # the inner optimizer has state to damage now
    opt.zero_grad()
    before = _state(opt)
    loss_of(model, data(1)).backward()
    model[2].weight.grad[3, 5] = bad
    with pytest.raises(ValueError, match=r"gradients of 2\.weight hold inf or NaN .*masters, optimizer state and "
                                         r"weights are unchanged"):  # fmt: skip
        opt.step()
    assert _same(_state(opt), before)
    opt.zero_grad()
    loss_of(model, data(1)).backward()
    opt.step()  # a clean step after the error trains again
    assert not _same(_state(opt), before)


def test_skip_option_skips_the_step_with_a_warning_and_training_continues():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init, config=Zero1Config(nonfinite_grads="skip"))
    ref_model, _ = mlp()
    ref = Zero1Optimizer(ref_model.parameters(), adam, master_init=init)
    for step in range(3):
        loss_of(model, data(step)).backward()
        if step == 1:
            model[0].bias.grad[0] = float("nan")
            with pytest.warns(RuntimeWarning, match=r"skipped step .*gradients of parameter 1 \[80\]") as caught:
                opt.step()
            assert caught[0].filename == __file__, "the warning points at the user's line"
            assert opt.last_step_skipped and opt.skipped_steps == 1
        else:
            opt.step()
            loss_of(ref_model, data(step)).backward()
            ref.step()
            ref.zero_grad()
        opt.zero_grad()
    assert _same(_state(opt), _state(ref)), "the skipped step changed nothing; the others trained as usual"


def test_frozen_and_gradient_less_parameters_are_not_stepped_as_with_adamw():
    model, init = mlp()
    adamw = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False)  # noqa: E731
    opt = Zero1Optimizer(model.named_parameters(), adamw, master_init=init)
    model[0].weight.requires_grad_(False)
    masters = [m.clone() for m in opt.full_masters()]
    opt.step()  # no backward at all: nothing has a gradient, nothing changes (AdamW's own rule)
    assert all(torch.equal(a, b) for a, b in zip(opt.full_masters(), masters))
    ref_masters = [t.clone().requires_grad_(True) for t in init]
    ref = torch.optim.AdamW(ref_masters, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        loss_of(model, data(step)).backward()
        assert model[0].weight.grad is None
        grads = [None if p.grad is None else p.grad.float() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        for m, g in zip(ref_masters, grads):
            m.grad = g
        ref.step()
        ref.zero_grad()
        got = opt.full_masters()
        assert torch.equal(got[0], masters[0]), "the frozen weight changed (weight decay?)"
        for i in (1, 2):
            assert torch.equal(got[i], ref_masters[i].detach()), f"parameter {i} differs from plain AdamW"
    model[0].weight.requires_grad_(True)  # unfrozen: it joins the next step
    loss_of(model, data(9)).backward()
    opt.step()
    assert not torch.equal(opt.full_masters()[0], masters[0])


class _Overflowing(torch.optim.SGD):
    """An inner optimizer that makes the last master non-finite from finite gradients (a bug, an overflow)."""

    def step(self, closure=None):
        super().step()
        self.param_groups[0]["params"][-1].data[7] = float("inf")


def test_a_master_made_non_finite_by_the_inner_optimizer_is_reported_by_that_step_by_name():
    # Raised by the step that cast from it, before the caller's next forward can read those weights.
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), lambda g: _Overflowing(g, lr=1e-2), master_init=init)
    loss_of(model, data(0)).backward()
    with pytest.raises(ValueError, match=r"model_weights\[1\] \(40x80\) = 2\.weight master.*after this "
                                         r"optimizer step.*cast from these masters in that step"):  # fmt: skip
        opt.step()


@pytest.mark.parametrize("bad", [dict(grad_reduction="mean"), dict(align=3)])
def test_config_rejects_unknown_options(bad):
    with pytest.raises(ValueError):
        Zero1Config(**bad)


def test_closure_is_refused():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


def test_a_parameter_listed_twice_is_refused():
    model, _ = mlp()
    with pytest.raises(ValueError, match="more than once"):
        Zero1Optimizer([model[0].weight, model[0].weight], adam)


def test_a_step_after_a_numerics_change_casts_with_the_new_numerics():
    from fp4_dist.testing import numerics_sensitive_weight

    master = numerics_sensitive_weight()
    model = nn.Sequential(nn.Linear(32, 32, bias=False)).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=0.0), master_init=[master])
    w = model[0].weight
    w.numerics = "te-2.14"
    model(torch.ones(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    ref = fp4_dist.quantize(master.to(torch.bfloat16), numerics="te-2.14")
    for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
        assert torch.equal(getattr(w, f), getattr(ref, f)), f"{f} after te -> te-2.14"


def test_a_construction_that_raises_leaves_every_parameter_as_it_was():
    model, init = mlp()
    params = list(model.parameters())
    before = [{f: getattr(p, f) for f in ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data")}
              if fp4_dist.is_nvfp4_tensor(p) else p.data for p in params]
    copies = [{f: (t.clone() if t is not None else None) for f, t in b.items()} if isinstance(b, dict) else b.clone()
              for b in before]
    bad = [t.clone() for t in init]
    bad[2][1, 1] = float("nan")  # the second NVFP4 weight's master
    with pytest.raises(ValueError, match="not finite"):
        Zero1Optimizer(model.parameters(), adam, master_init=bad)
    for p, b, c in zip(params, before, copies):
        if isinstance(b, dict):
            for f, t in b.items():
                assert getattr(p, f) is t, f"{f} was replaced"
                if t is not None:
                    assert torch.equal(t, c[f]), f"{f} bytes changed"
        else:
            assert p.data.data_ptr() == b.data_ptr() and torch.equal(p.data, c)


def test_none_arguments_are_named():
    with pytest.raises(TypeError, match="params must be an iterable"):
        Zero1Optimizer(None, adam)


# ------------------------------------------------------------------------------------- torch.optim citizen
def test_it_is_a_torch_optimizer_whose_param_groups_hold_the_model_parameters():
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.defaults["lr"] == 1e-2
    with pytest.raises(NotImplementedError, match="param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_an_lr_scheduler_drives_the_inner_optimizer_like_a_plain_torch_optimizer():
    """Zero1 + StepLR over 6 steps == one process: AdamW + StepLR on the fp32 masters, quantized each step."""
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False), master_init=init)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_model, _ = mlp()
    masters = [t.clone() for t in init]
    ref_opt = torch.optim.AdamW([{"params": masters}], lr=1e-2, foreach=False)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(6):
        _reference_step(ref_model, masters, ref_opt, data(step))
        ref_sched.step()
        loss_of(model, data(step)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for got, want in zip(opt.full_masters(), masters):
        assert torch.equal(got, want)


def _reference_step(ref_model, masters, ref_opt, x):
    for (name, p), m in zip(list(ref_model.named_parameters()), masters):
        mod = ref_model.get_submodule(name.rsplit(".", 1)[0])
        if fp4_dist.is_nvfp4_tensor(p):
            setattr(mod, "weight", nn.Parameter(fp4_dist.quantize(m.to(torch.bfloat16))))
        else:
            p.data = m.to(torch.bfloat16)
    for m, g in zip(masters, torch.autograd.grad(loss_of(ref_model, x), list(ref_model.parameters()))):
        m.grad = g.float()
    ref_opt.step()


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_matches_torch_on_the_same_fp32_grads(norm_type):
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=1.0), master_init=init)
    ref = [t.clone().requires_grad_() for t in init]
    grads = []
    loss_of(model, data(0)).backward()
    for p, r in zip(opt.params, ref):
        r.grad = p.grad.float().clone()  # what the optimizer reduces into its fp32 grad shard (one rank)
        grads.append(r.grad)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.05, norm_type=norm_type)
    got = opt.clip_grad_norm_(0.05, norm_type=norm_type)
    assert torch.equal(got, want), f"total norm {got} != torch's {want}"
    for sec in opt._sections:
        for j, i in enumerate(sec.indices):
            assert torch.equal(sec.buf.grad_shard_piece(j), ref[i].grad.reshape(-1)), f"clipped grad {i}"
    opt.step()  # uses the clipped grads: masters moved by exactly -lr * clipped grad
    for m, r, i0 in zip(opt.full_masters(), ref, init):
        assert torch.equal(m, i0 - r.grad)


# ------------------------------------------------------------------------------------------ checkpoints
def test_dcp_round_trip_in_one_process_restores_masters_state_and_hyperparameters(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    for step in range(2):
        loss_of(model, data(step)).backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 3e-3
    dcp.save({"optim": opt}, checkpoint_id=str(tmp_path / "ck"))
    want_masters = [m.clone() for m in opt.full_masters()]
    want_state = {k: v.clone() for k, v in opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]].items()}
    want_bytes = [w.rowwise_data.clone() for w in opt.nvfp4_params]

    model2, _ = mlp(seed=1)
    opt2 = Zero1Optimizer(model2.parameters(), adam)
    loss_of(model2, data(5)).backward()
    opt2.step()  # some state of its own, overwritten by the load
    dcp.load({"optim": opt2}, checkpoint_id=str(tmp_path / "ck"))
    for got, want in zip(opt2.full_masters(), want_masters):
        assert torch.equal(got, want)
    got_state = opt2.optimizer.state[opt2.optimizer.param_groups[0]["params"][0]]
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), k
    assert opt2.param_groups[0]["lr"] == 3e-3
    for w, b in zip(opt2.nvfp4_params, want_bytes):
        assert torch.equal(w.rowwise_data, b), "weights re-cast from the loaded masters"


@pytest.mark.parametrize("how", ["stateful", "state_dict", "load_checkpoint"])
def test_a_fresh_optimizer_loads_a_dcp_checkpoint_the_standard_way_and_trains_on_as_the_saved_one(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    from fp4_dist.optim.zero1_state import load_checkpoint

    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    loss_of(model, data(0)).backward()
    opt.step()
    opt.zero_grad()
    dcp.save({"optimizer": opt}, checkpoint_id=str(tmp_path / "ck"))
    fresh, _ = mlp(seed=3)
    opt2 = Zero1Optimizer(fresh.parameters(), adam)
    if how == "stateful":
        dcp.load({"optimizer": opt2}, checkpoint_id=str(tmp_path / "ck"))
    elif how == "state_dict":
        sd = {"optimizer": opt2.state_dict()}
        dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
        opt2.load_state_dict(sd["optimizer"])
    else:
        load_checkpoint(opt2, str(tmp_path / "ck"))
    for net, o in ((model, opt), (fresh, opt2)):  # one more step each: the same state trains the same
        loss_of(net, data(1)).backward()
        o.step()
    assert _same(_state(opt2), _state(opt))


def test_a_fresh_optimizers_state_dict_trains_as_a_fresh_optimizer(tmp_path):
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    opt.state_dict()  # materializes the inner state (zero moments, step 0) without changing a master
    ref_model, _ = mlp()
    ref = Zero1Optimizer(ref_model.parameters(), adam, master_init=init)
    for net, o in ((model, opt), (ref_model, ref)):
        loss_of(net, data(0)).backward()
        o.step()
    assert _same(_state(opt), _state(ref))


def test_converting_after_building_the_optimizer_is_refused_at_the_first_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 40, bias=False)).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="none of the 3 parameters is an NVFP4 weight"):
        opt = Zero1Optimizer(model.parameters(), adam)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)  # too late: opt holds the old bf16 weights
    loss_of(model, data(0)).backward()
    with pytest.raises(ValueError, match=r"replaced by the NVFP4 weight '0.weight'.*build the optimizer"):
        opt.step()


def _no_nvfp4_warnings(build) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [w for w in caught if "is an NVFP4 weight" in str(w.message)]


def test_a_model_without_nvfp4_weights_warns_once_at_the_users_line_naming_the_conversion():
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 40, bias=False)).to(torch.bfloat16)
    caught = _no_nvfp4_warnings(lambda: Zero1Optimizer(model.parameters(), adam))
    assert len(caught) == 1 and caught[0].category is UserWarning and caught[0].filename == __file__
    message = str(caught[0].message)
    assert "none of the 3 parameters is an NVFP4 weight" in message and "in bfloat16" in message
    assert "fp4_dist.convert_linear_weights(model) before building the optimizer" in message


def test_a_converted_model_does_not_warn():
    model, init = mlp()
    assert _no_nvfp4_warnings(lambda: Zero1Optimizer(model.parameters(), adam, master_init=init)) == []


def test_training_steps_never_enter_the_weights_dispatch(dispatches):
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    for step in range(4):
        if step == 1:  # the first forward makes each layer's alias of its weight's copy (a dispatch per weight)
            dispatches.clear()
        loss_of(model, data(step)).backward()
        opt.step()  # cast, all-gather, one refresh of every copy: the layers keep their aliases
        opt.zero_grad()
    assert dispatches == []
    fp4_dist.quantize(torch.randn(16, 16)).t()
    assert dispatches, "the fixture must see a dispatch (else this test cannot fail)"


def test_torchs_get_state_dict_gives_our_error_with_the_remedy_and_changes_nothing():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    loss_of(model, data(0)).backward()
    opt.step()
    opt.zero_grad()
    before = _state(opt)
    with pytest.raises(TypeError, match=r"does not support Zero1Optimizer.*dcp.save\({\"model\""):
        get_state_dict(model, opt)
    assert _same(_state(opt), before), "torch's helper stepped the optimizer before our error"


def _fields(w):
    return [getattr(w, f).clone() for f in ("rowwise_data", "rowwise_scale_inv", "amax")]


def test_a_weight_no_rank_has_a_gradient_for_keeps_its_bytes_and_is_not_cast():
    # Its master does not change, so a cast would only cost time (and turn -0 codes into +0): none runs.
    model, _ = mlp(seed=4)
    frozen, trained = model[0].weight, model[2].weight
    frozen.requires_grad_(False)
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-2))
    before, trained_before = _fields(frozen), _fields(trained)
    written = [frozen.rowwise_data._version, frozen.amax._version]  # every in-place write bumps these
    for step in range(3):
        loss_of(model, data(step)).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(_fields(frozen), before)), "the frozen weight's bytes changed"
    assert [frozen.rowwise_data._version, frozen.amax._version] == written, "the frozen weight was cast again"
    assert not torch.equal(trained.rowwise_data, trained_before[0]), "the trained weight did not train"
    x = data(9)  # its compute copy is still its value
    want = torch.nn.functional.linear(x, frozen.dequantize(torch.bfloat16), model[0].bias)
    assert torch.equal(model[0](x), want)


def test_a_re_cast_of_an_unchanged_master_changes_no_value_only_the_sign_of_zero():
    torch.manual_seed(5)
    q = fp4_dist.quantize(torch.randn(64, 96) * (torch.rand(64, 96) > 0.5))
    again = fp4_dist.quantize(q.dequantize(torch.float32))
    assert torch.equal(again.dequantize(torch.float32), q.dequantize(torch.float32))
    lo, hi = q.rowwise_data & 0x0F, q.rowwise_data >> 4
    lo2, hi2 = again.rowwise_data & 0x0F, again.rowwise_data >> 4
    for a, b in ((lo, lo2), (hi, hi2)):
        differ = a != b
        assert bool(((a[differ] == 0x8) & (b[differ] == 0x0)).all()), "a code other than -0 changed"
    assert torch.equal(again.rowwise_scale_inv, q.rowwise_scale_inv) and torch.equal(again.amax, q.amax)


def test_a_master_made_non_finite_while_another_weight_is_frozen_is_named_by_its_own_number():
    # The step casts the changed weights only; the error still names the weight as the full list numbers it.
    model, init = mlp()
    model[0].weight.requires_grad_(False)
    opt = Zero1Optimizer(model.parameters(), lambda g: _Overflowing(g, lr=1e-2), master_init=init)
    loss_of(model, data(0)).backward()
    with pytest.raises(ValueError, match=r"model_weights\[1\] \(40x80\) = 2\.weight master.*after this optimizer step"):
        opt.step()


def test_weights_loaded_into_the_model_after_the_optimizer_was_built_stop_the_next_step():
    # The step cast the optimizer's fp32 masters over the loaded weights, silently, dense ones too.
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=0.0), master_init=init)
    pretrained, _ = mlp(seed=1)
    model.load_state_dict(pretrained.state_dict())
    loss_of(model, data(0)).backward()
    with pytest.raises(ValueError, match=r"written since the optimizer last set them \(here: 0.weight, parameter 1 "
                                         r"\[80\] \(torch.bfloat16\), 2.weight\), e.g. by model.load_state_dict"):
        opt.step()
    assert all(torch.equal(m, i) for m, i in zip(opt.full_masters(), init)), "the refused step changed a master"
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=0.0), master_init=init)
    for step in range(2):  # the optimizer's own writes are not the user's
        loss_of(model, data(step)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("clip_again", [False, True])
def test_gradients_changed_after_clip_grad_norm_are_reduced_again(clip_again):
    # A batch looked at through clip_grad_norm_ and discarded with model.zero_grad(): the step used its gradients.
    def run(discard: bool):
        model, init = mlp()
        opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=1.0), master_init=init)
        if discard:
            loss_of(model, data(0)).backward()
            opt.clip_grad_norm_(0.05)
            model.zero_grad()
        loss_of(model, data(1)).backward()
        if clip_again:
            opt.clip_grad_norm_(0.05)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        return opt.full_masters(), [str(w.message) for w in caught if "changed after clip_grad_norm_" in str(w.message)]

    (want, _), (got, said) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "the step used the discarded batch's gradients"
    assert len(said) == (0 if clip_again else 1), said


def test_a_grad_scaler_is_refused_at_its_first_step():
    # It checked each rank's unreduced gradients: one rank skipped a step the others took, and the ranks' gradient
    # reductions paired across steps until they hung.
    model, init = mlp()
    opt = Zero1Optimizer(model.parameters(), adam, master_init=init)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, data(0))).backward()
    with pytest.raises(RuntimeError, match="under torch.amp.GradScaler: the scaler checks each rank's own gradients"):
        scaler.step(opt)
    assert not hasattr(opt, "found_inf") and all(torch.equal(m, i) for m, i in zip(opt.full_masters(), init))


def test_a_checkpoint_of_a_bigger_model_is_refused_not_loaded_in_part(tmp_path):
    # Parameters are saved by index: DCP filled the smaller optimizer's and dropped the rest, without a word.
    import torch.distributed.checkpoint as dcp

    from fp4_dist.optim.zero1_state import load_checkpoint, save_checkpoint

    def stack(n):
        net = nn.Sequential(*[nn.Linear(48, 48, bias=False) for _ in range(n)]).to(torch.bfloat16)
        fp4_dist.convert_linear_weights(net, dtype=torch.bfloat16)
        return Zero1Optimizer(net.parameters(), adam)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on a process without a group
        save_checkpoint(stack(4), tmp_path / "ck")
        small = stack(3)
        before = [m.clone() for m in small.full_masters()]
        with pytest.raises(ValueError, match="holds optimizer state of 4 parameters; this optimizer has 3"):
            load_checkpoint(small, tmp_path / "ck")
        assert all(torch.equal(a, b) for a, b in zip(small.full_masters(), before)), "loaded in part"
        sd = {"optimizer": small.state_dict()}  # the standard way: DCP loads in place, the restore refuses
        dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
        with pytest.raises(ValueError, match=r"holds 4 parameters in groups of \[4\]; this one holds 3"):
            small.load_state_dict(sd["optimizer"])
