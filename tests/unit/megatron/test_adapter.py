"""The hook table: every binding patched, exactly restored, version range enforced before any patch."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from fp4_dist.megatron import adapter, cpu_compat, layers, patching  # noqa: E402

pytestmark = pytest.mark.megatron
CPU = not torch.cuda.is_available()
"""The CPU rows and cpu_compat install only on a machine without CUDA (there they would hide the GPUs): a GPU machine
installs and checks the other rows."""


def _bindings() -> dict:
    """Every (module, name) the table targets -> the object bound there right now (class attrs raw)."""
    out = {}
    for hook in adapter.HOOKS:
        for module_name in hook.modules:
            owner, attr = patching._resolve(module_name, hook.name)
            out[(module_name, hook.name)] = patching._raw_attr(owner, attr)
    return out


@pytest.fixture
def clean():
    adapter.uninstall()
    yield
    adapter.uninstall()


def test_install_replaces_every_binding_of_every_row_with_one_object_per_row(clean):
    before = _bindings()
    adapter.install(cpu=CPU)
    after = _bindings()
    for hook in (h for h in adapter.HOOKS if CPU or not h.cpu_only):
        objs = {id(after[(m, hook.name)]) for m in hook.modules}
        assert len(objs) == 1, f"{hook.name}: modules bind different replacements"
        for m in hook.modules:
            assert after[(m, hook.name)] is not before[(m, hook.name)], f"{m}.{hook.name} not patched"


def test_uninstall_restores_the_original_objects_exactly(clean):
    before = _bindings()
    cuda_api = {n: getattr(torch.cuda, n) for n in ("current_device", "current_stream", "manual_seed")}
    adapter.install(cpu=CPU)
    assert cpu_compat.is_enabled() == CPU
    adapter.uninstall()
    after = _bindings()
    assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
    assert all(getattr(torch.cuda, n) is f for n, f in cuda_api.items())
    assert not cpu_compat.is_enabled() and not adapter.is_installed()


def test_install_twice_is_a_no_op_and_gpu_mode_leaves_gloo_rows_out(clean):
    before = _bindings()
    adapter.install(cpu=False)
    first = _bindings()
    adapter.install(cpu=False)
    assert _bindings() == first
    for hook in adapter.HOOKS:
        for m in hook.modules:
            patched = first[(m, hook.name)] is not before[(m, hook.name)]
            assert patched == (not hook.cpu_only), f"{m}.{hook.name}"
    assert not cpu_compat.is_enabled()


def test_exclude_keeps_upstream_layout_and_unknown_rows_are_refused(clean):
    pgb = importlib.import_module(adapter._PGB)
    original = pgb._ParamAndGradBuffer.__dict__["_compute_nvfp4_packed_layout"]
    adapter.install(cpu=False, exclude=adapter.UPSTREAM_LAYOUT)
    assert pgb._ParamAndGradBuffer.__dict__["_compute_nvfp4_packed_layout"] is original
    adapter.uninstall()
    with pytest.raises(ValueError, match="not in the hook table"):
        adapter.install(cpu=False, exclude=("no_such_row",))
    assert not adapter.is_installed()


@pytest.mark.parametrize("version", ["0.19.1", "0.19.2"])
def test_versions_in_the_tested_range_are_accepted(version):
    adapter.check_megatron_version(version)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.0", "0.19.3", "0.20.0", "0.20.0rc1", "1.0.0"])
def test_versions_outside_the_tested_range_raise_naming_the_range_and_the_remedy(version):
    with pytest.raises(RuntimeError) as e:
        adapter.check_megatron_version(version)
    msg = str(e.value)
    assert version in msg and "0.19.2" in msg and "allow_untested_version" in msg and "--allow-untested-megatron" in msg


def test_untested_installed_version_raises_at_install_before_any_patch(clean, monkeypatch):
    before = _bindings()
    monkeypatch.setattr(adapter, "installed_megatron_version", lambda: "0.20.1")
    with pytest.raises(RuntimeError, match="found 0.20.1"):
        adapter.install(cpu=CPU)
    assert _bindings() == before and not adapter.is_installed() and not cpu_compat.is_enabled()
    adapter.install(cpu=False, allow_untested_version=True)  # the explicit override still works
    assert adapter.is_installed()


def test_every_row_states_a_reason_and_a_tested_version():
    for hook in adapter.HOOKS:
        assert len(hook.reason) > 30 and hook.tested, hook.name
    assert "packed layout" in adapter.describe()


def test_distopt_quantized_param_check_gives_the_originals_answer_without_reading_data(clean, dispatches):
    import fp4_dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = patching._unwrap(patching._raw_attr(DistributedOptimizer, "_is_distopt_quantized_param"))
    param = torch.nn.Parameter(fp4_dist.quantize(torch.randn(32, 32)))
    plain = torch.nn.Parameter(torch.randn(32, 32))
    seen = dispatches
    want = original(DistributedOptimizer, param)
    assert seen, "the original reads param.data (so the check below can fail)"
    adapter.install(cpu=CPU)
    seen.clear()
    assert DistributedOptimizer._is_distopt_quantized_param(param) is want is False
    assert seen == []
    assert DistributedOptimizer._is_distopt_quantized_param(plain) is original(DistributedOptimizer, plain)


def test_inherited_methods_patched_on_a_class_are_deleted_again_on_uninstall(clean):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        assert "_apply" not in cls.__dict__
    adapter.install(cpu=CPU)
    assert all("_apply" in cls.__dict__ for cls in (ColumnParallelLinear, RowParallelLinear))
    adapter.uninstall()
    for cls in (ColumnParallelLinear, RowParallelLinear):
        assert "_apply" not in cls.__dict__ and cls._apply is torch.nn.Module._apply


def test_apply_row_drops_the_layers_cached_view_so_a_moved_layer_still_trains():
    import fp4_dist
    from fp4_dist.compute.view import compute_view

    x = torch.randn(4, 32).to(torch.bfloat16)

    def forward_backward(m):
        m.weight.grad = None
        torch.nn.functional.linear(x, compute_view(m, m.weight)).sum().backward()
        return m.weight.grad

    def layer_after_a_forward():
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(fp4_dist.quantize(torch.randn(32, 32)))
        forward_backward(m)
        return m

    m = layer_after_a_forward()
    torch.nn.Module._apply(m, lambda t: t.to("cpu"))  # already there: what the row exists for: torch swaps the
    with pytest.raises(RuntimeError, match="swap"):  # parameter in place and poisons the view's accumulator
        forward_backward(m)
    m = layer_after_a_forward()
    layers.make_apply(torch.nn.Module._apply)(m, lambda t: t.to("cpu"))
    assert type(forward_backward(m)) is torch.Tensor
    layers.make_apply(torch.nn.Module._apply)(m, lambda t: t.to("meta"))
    assert m.weight.device.type == "meta"


def test_every_hook_row_is_in_the_docs_table():
    doc = (Path(__file__).parents[3] / "docs" / "megatron.md").read_text()
    table = [line for line in doc.splitlines() if line.startswith("| `")]
    missing = [h.name for h in adapter.HOOKS if not any(f"`{h.name}`" in row for row in table)]
    assert not missing, f"docs/megatron.md's hook table lacks {missing}"
