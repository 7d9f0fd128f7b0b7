"""The compute modes are defined once (`fp4_dist.compute.modes.MODES`): no other file of the package names a mode,
and a new mode is one module and one row, which every way in (convert_linear_weights, fully_shard_nvfp4, the
Megatron options, the example trainer) then takes."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.compute import bf16, modes
from fp4_dist.compute.modes import DEFAULT, MODES, ComputeMode

ROOT = Path(__file__).parents[3]
# String constants equal to a mode's name that are no compute mode: counted per file, so that a new one shows.
NOT_COMPUTE_MODES = {
    "fp4_dist/export/save.py": 2,  # an exported global scale's exactness ("bf16": every product rounds the same)
    "fp4_dist/export/global_scale.py": 1,  # the same
    "fp4_dist/megatron/model.py": 4,  # the reference model's weight storage (WEIGHT_MODES: bf16, nvfp4, fake-nvfp4)
    "fp4_dist/megatron/startup.py": 1,  # Megatron's own --bf16
    "examples/megatron_pretrain_gpt.py": 3,  # the reference model's weight storage; Megatron's --fp4-recipe nvfp4
    "fp4_dist/fsdp/master.py": 5,  # FSDP2's gather mode (GATHER_MODES: packed "nvfp4" bytes or "bf16" rows)
    "fp4_dist/fsdp/shard.py": 10,  # the same, and the gather's bytes per element by gather mode
    "fp4_dist/fsdp/precompute.py": 2,  # FSDP2's "nvfp4" gather mode
    "fp4_dist/fsdp/wire.py": 1,  # the same
    "fp4_dist/optim/zero1.py": 2,  # Zero1Optimizer's byte counts, keyed "nvfp4" (the packed weights)
    "examples/train_lm.py": 2,  # its byte-count report, keyed as Zero1Optimizer keys it
}


def _mode_literals(path: Path, names) -> int:
    return sum(isinstance(n, ast.Constant) and n.value in names for n in ast.walk(ast.parse(path.read_text())))


def test_no_file_but_the_table_names_a_compute_mode():
    names = set(MODES)
    files = [*sorted((ROOT / "fp4_dist").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
    found = {str(p.relative_to(ROOT)): _mode_literals(p, names) for p in files if p.name != "modes.py"}
    wrong = {f: n for f, n in found.items() if n != NOT_COMPUTE_MODES.get(f, 0)}
    assert not wrong, (f"string constants naming a compute mode {sorted(names)} outside fp4_dist/compute/modes.py "
                       f"(read MODES / DEFAULT instead; counts by file, against the known non-mode uses): {wrong}")


def test_the_check_sees_a_planted_mode_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('def f(layer):\n    return layer.fp4_compute == "fp8"\n')
    assert _mode_literals(planted, set(MODES)) == 1


def test_every_row_says_what_the_docs_promise():
    for name, mode in MODES.items():
        assert mode.name == name and mode.check_device(torch.device("cpu")) is None  # every mode runs on the CPU
        for text in (mode.gemms_read, mode.per_update, mode.per_use, mode.devices, mode.bytes_per_weight):
            assert isinstance(text, str) and text
    assert DEFAULT in MODES and MODES[DEFAULT].kept_copies and MODES[DEFAULT].lean_depth


def _noop(calls: list) -> ComputeMode:
    """A do-nothing mode: the bf16 values, counting its uses; one row, as a mode module would declare it."""

    def linear(module, input, compiling=False):
        calls.append(module)
        return bf16.linear(module, input, compiling)

    return replace(MODES[DEFAULT], name="noop", kept_copies=False, lean_depth=False, linear=linear)


def test_a_new_mode_is_one_module_and_one_row(monkeypatch):
    from fp4_dist.megatron.options import AdapterOptions

    calls = []
    monkeypatch.setitem(MODES, "noop", _noop(calls))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)
    twin = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    report = fp4_dist.convert_linear_weights(model, compute="noop")
    fp4_dist.convert_linear_weights(twin)
    assert report.in_mode == ["0", "2"] and model[0].fp4_compute == "noop" and "NOOP compute: 2 linears" in str(report)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), twin(x)) and len(calls) == 2
    with pytest.raises(ValueError, match="never a bf16 compute copy"):
        fp4_dist.convert_linear_weights(nn.Linear(32, 16), compute="noop", compute_copy=True)
    # the Megatron options and their flags take it, and refuse what its row says it does not do
    parser = AdapterOptions.add_arguments(__import__("argparse").ArgumentParser())
    assert AdapterOptions.from_args(parser.parse_args(["--compute", "noop"])).compute == "noop"
    with pytest.raises(ValueError, match="--lean-depth"):
        AdapterOptions(compute="noop", lean_depth=2)


def test_a_device_a_mode_refuses_stops_the_conversion_before_anything_changes(monkeypatch):
    refusing = replace(MODES[DEFAULT], name="nowhere", check_device=lambda device: "it runs nowhere")
    monkeypatch.setitem(MODES, "nowhere", refusing)
    model = nn.Linear(32, 16)
    with pytest.raises(RuntimeError, match="it runs nowhere; convert with compute='bf16'"):
        fp4_dist.convert_linear_weights(model, compute="nowhere")
    assert type(model.weight) is nn.Parameter and not fp4_dist.is_nvfp4_tensor(model.weight)
    assert modes.prepare(refusing, [torch.device("cpu")]) == "it runs nowhere"
