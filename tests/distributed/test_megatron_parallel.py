"""Megatron's parallel layouts with ``--fp4-param-gather``: ``megatron.training.pretrain()``
(`examples/pretrain_gpt.py`) through ``python -m fp4_dist.megatron.run`` on 4 gloo CPU ranks, each fp4 run against the
bf16 run of the same layout.

Every fp4 run checks on every rank, after setup and after every iteration, that the gathered NVFP4 bytes, scales and
amax equal quantize(full fp32 master), the full master being the whole weight across tensor-parallel slices
(`fp4_dist.megatron.parity`). Tensor-parallel runs use ``--use-cpu-initialization``: Megatron then initializes each
whole weight and hands every rank its slice, so the slices' amaxes differ (on CPU ranks without it, every slice
draws the same values from one CPU generator and a per-slice amax would go unseen, as it did before).

Losses: within `LOSS_RTOL` (2%) of the bf16 run at every iteration, as in test_megatron_run (the NVFP4 error moves
this model's loss by well under 1% over 3 iterations; 2% catches a model that trains on wrong weights).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from .test_launch import REPO  # noqa: E402
from .test_megatron_run import (LOSS_RTOL, assert_fp4_run, data, launch, refusal,  # noqa: E402,F401 (data: fixture)
                                train)

pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.slow]

COMMON = ("--train-iters", "3", "--eval-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--global-batch-size", "16")  # fmt: skip
TP = ("--tensor-model-parallel-size", "2", "--use-cpu-initialization")
PP = ("--pipeline-model-parallel-size", "2")
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2")
SLICE_AMAX = str(REPO / "tests" / "distributed" / "megatron_slice_amax.py")

# Layers kept in bf16 by --first-last-layers-bf16 are chosen by their global layer number across pipeline stages:
# with 6 layers on 2 stages, the first one and the last two in bf16, stage 0 (layers 1-3) converts layers 2 and 3,
# stage 1 (layers 4-6) layer 4 only: 8, 8, 4, 4 NVFP4 weights on ranks 0-3 (4 linears a layer), where counting layers
# per stage would convert two on each. The bf16 run trains the same 6 layers.
FIRST_LAST = ("--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "2")

# layout: (arguments of both runs, of the fp4 run only, NVFP4 weights on each rank). GPT 2 layers (4 for virtual
# stages, 6 with bf16 first and last layers): 4 linears per dense layer.
LAYOUTS = {
    "tp2-dp2": (TP, (), [8, 8, 8, 8]),
    "pp2-dp2-first-last-bf16": (PP + ("--num-layers", "6"), FIRST_LAST, [8, 8, 4, 4]),
    "pp2-vpp2-dp2": (PP + ("--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"), (), [8, 8, 8, 8]),
}


def _run(tmp_path: Path, data: str, name: str, args, **kwargs) -> dict:
    return train(tmp_path, name, kwargs.pop("nproc", 4), "--data-path", data, *COMMON, *args, **kwargs)


# The bf16 reference of a layout runs at data-parallel size 1 (its tensor and pipeline split kept): the same global
# batch and the same init (Megatron seeds by pipeline and expert rank, not by data-parallel rank), so the same
# masters after setup, bit for bit (the digest is independent of the data-parallel size), at half the ranks'
# start-up on the 2-core test machine.
def _bf16_ranks(args) -> int:
    sizes = [int(args[i + 1]) for i, a in enumerate(args) if a in ("--tensor-model-parallel-size",
             "--pipeline-model-parallel-size", "--expert-model-parallel-size")]  # fmt: skip
    return math.prod(sizes)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_bf16_with_bytes_checked_every_step(tmp_path, data, layout):
    args, fp4_only, per_rank = LAYOUTS[layout]
    fp4 = _run(tmp_path, data, "fp4", (*args, *fp4_only))
    assert_fp4_run(fp4, _run(tmp_path, data, "bf16", args, fp4=False, nproc=_bf16_ranks(args)), per_rank[0])
    assert fp4["nvfp4_weights_per_rank"] == per_rank


CKPT = ("--ckpt-format", "torch", "--train-iters", "4")


def _save_and_resume(tmp_path: Path, data: str, args, weights: int) -> tuple[dict, dict, Path]:
    """4 iterations saving at 2, against bf16; resumed from 2 in the same layout, the run repeats iterations 3-4 bit
    for bit. Returns the records of the fp4 run and the resumed one, and the checkpoint folder at iteration 2."""
    save = tmp_path / "ckpt"
    ckpt = CKPT
    fp4 = _run(tmp_path, data, "fp4", (*args, *ckpt, "--save", str(save), "--save-interval", "2"))
    assert_fp4_run(fp4, _run(tmp_path, data, "bf16", (*args, *ckpt), fp4=False, nproc=_bf16_ranks(args)), weights)
    at2 = tmp_path / "at2"
    shutil.copytree(save / "iter_0000002", at2 / "iter_0000002")
    (at2 / "latest_checkpointed_iteration.txt").write_text("2")
    same = _run(tmp_path, data, "resume", (*args, *ckpt, "--load", str(at2)))
    assert [it["iteration"] for it in same["iterations"]] == [3, 4]
    assert [it["loss"] for it in same["iterations"]] == [it["loss"] for it in fp4["iterations"][2:]]
    assert same["master_digest_final"] == fp4["master_digest_final"], "resume is not bitwise"
    assert same["check_after_setup"].startswith("ok") and all(it["check"].startswith("ok") for it in same["iterations"])
    return fp4, same, at2


def test_tensor_by_pipeline_parallel_saves_and_resumes_bitwise(tmp_path, data):
    _save_and_resume(tmp_path, data, TP + PP, 4)


def test_experts_save_resume_at_another_data_parallel_size_and_the_alltoall_dispatcher(tmp_path, data):
    args = MOE + ("--moe-token-dispatcher-type", "allgather")
    fp4, same, at2 = _save_and_resume(tmp_path, data, args, 12)
    # On 2 ranks the expert-data-parallel size halves (2 -> 1) and the dense one too (4 -> 2): the fp32 masters
    # after loading, dense and experts, are the same bits.
    half = _run(tmp_path, data, "resume_half", (*args, *CKPT, "--load", str(at2)), nproc=2)
    assert half["master_digest_after_setup"] == same["master_digest_after_setup"], "masters differ after re-sharding"
    assert half["check_after_setup"].startswith("ok") and all(it["check"].startswith("ok") for it in half["iterations"])
    # The all-to-all dispatcher routes the same tokens to the same experts by another exchange: every step checked,
    # losses within the bf16 tolerance of the allgather run.
    a2a = _run(tmp_path, data, "a2a", (*MOE, "--moe-token-dispatcher-type", "alltoall", *CKPT))
    assert a2a["check_after_setup"].startswith("ok") and all(it["check"].startswith("ok") for it in a2a["iterations"])
    assert a2a["master_digest_after_setup"] == fp4["master_digest_after_setup"]
    for a, b in zip(a2a["iterations"], fp4["iterations"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * b["loss"], (a, b)


def test_a_per_slice_conversion_stops_every_rank_after_setup_naming_the_weight(tmp_path, data):
    # The check after setup runs without --check-every: the first step must never train on such bytes.
    proc = launch(4, ["--data-path", data, *COMMON, *TP, "--fp4-param-gather"], check=False, refused=True,
                  wrapper=(SLICE_AMAX,))  # fmt: skip
    for rank in range(4):
        line = refusal(proc, rank)
        assert "after setup: the gathered NVFP4 weights differ from quantize(full fp32 master)" in line, line
    assert ".weight.rowwise_scale_inv" in proc.stderr and "iteration        1/" not in proc.stdout
    assert f'File "{REPO / "fp4_dist"}' not in proc.stderr  # one line per rank, no traceback through fp4_dist
