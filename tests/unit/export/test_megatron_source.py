"""`export_megatron_checkpoint` and `python -m fp4_dist.export megatron` read a checkpoint weights-only: a file that
carries code (a pickled object whose unpickling creates a file) is refused before that code runs and before
anything is written, in both formats the export reads; ``trusted=True`` / ``--trust-checkpoint`` unpickles it in
full. Exports of genuine checkpoints: test_export.py (the example trainer's model.pt) and test_megatron_run.py
(a Megatron run's model_optim_rng.pt)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import fp4_dist
from fp4_dist.export import ct_format, export_megatron_checkpoint
from fp4_dist.export.__main__ import main
from fp4_dist.checkpoint.safe_load import UnsafeCheckpointError

from ..pickle_payload import TouchOnLoad, assert_refused

pytest.importorskip("safetensors")
FORMATS = ["model.pt", "model_optim_rng.pt"]


def write_checkpoint(root: Path, fmt: str, payload=None) -> tuple[Path, torch.nn.Module]:
    """A --save folder at iteration 10 in `fmt` (the example trainer's or Megatron's --ckpt-format torch) holding
    one NVFP4 weight, ``linear.weight``, and `payload` among the entries; returns the file written and the model."""
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.linear = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(net)
    folder = root / "iter_0000010"
    if fmt == "model.pt":
        from examples.megatron_checkpoint import model_state

        state = {**model_state(net), **({"x": payload} if payload else {})}
        path = folder / "model.pt"
    else:
        pytest.importorskip("megatron.core")
        from megatron.core.transformer.enums import AttnBackend

        # What Megatron's loader allows beside the weights: its arguments (a Namespace holding its enums).
        state = {"args": argparse.Namespace(attention_backend=AttnBackend.auto), "iteration": 10,
                 "model": net.state_dict(),
                 **({"x": payload} if payload else {})}  # fmt: skip
        path = folder / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return path, net


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_carrying_code_is_refused_before_it_runs_and_nothing_is_written(tmp_path, fmt):
    marker, out = tmp_path / "payload_ran", tmp_path / "out"
    path, _ = write_checkpoint(tmp_path / "ckpt", fmt, TouchOnLoad(marker))
    with pytest.raises(UnsafeCheckpointError) as refused:
        export_megatron_checkpoint(tmp_path / "ckpt", out)
    assert_refused(refused.value, path, marker)
    assert not out.exists()


def test_the_command_line_refuses_it_in_one_sentence_and_writes_nothing(tmp_path, capsys):
    marker, out = tmp_path / "payload_ran", tmp_path / "out"
    path, _ = write_checkpoint(tmp_path / "ckpt", "model_optim_rng.pt", TouchOnLoad(marker))
    with pytest.raises(SystemExit) as stop:
        main(["megatron", str(tmp_path / "ckpt"), str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith("python -m fp4_dist.export: ") and err.count("\n") == 1
    assert_refused(err, path, marker)
    assert not out.exists()


def test_trust_checkpoint_unpickles_in_full_running_the_payload(tmp_path, capsys):
    marker, out = tmp_path / "payload_ran", tmp_path / "out"
    write_checkpoint(tmp_path / "ckpt", "model_optim_rng.pt", TouchOnLoad(marker))
    assert main(["megatron", str(tmp_path / "ckpt"), str(out), "--trust-checkpoint"]) == 0
    assert marker.exists() and "exported 1 NVFP4 weights" in capsys.readouterr().out


def test_a_megatron_checkpoint_of_weights_and_arguments_exports_its_nvfp4_bytes(tmp_path):
    _, net = write_checkpoint(tmp_path / "ckpt", "model_optim_rng.pt")
    export_megatron_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    tensors, amaxes, _ = ct_format.read_checkpoint(tmp_path / "out")
    w = net.linear.weight
    assert torch.equal(tensors["linear.weight_packed"], w.rowwise_data) and amaxes["linear.weight"] == float(w.amax)
