"""An --fp4-param-gather run of the Megatron trainer equals its fake-quantization reference (bf16 weights, the same
NVFP4 forward) bit for bit with gradient clipping on, at data-parallel size 1: the same losses, gradient norms and
fp32 masters at every step. The gradient norm is summed by parameter name (`fp4_dist.megatron.gradnorm`); in the
order of Megatron's per-dtype buffers the norms differed by an ulp from the first step and the losses from the
26th. (The distributed suite compares the two at data-parallel size 2 with clipping off: there each rank's shards
are cut from its own buffer layout.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.distributed import forked_ranks  # noqa: E402
from tests.distributed.test_launch import megatron_env  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 4 --bf16 --use-distributed-optimizer --lr 2e-3 --min-lr 2e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --train-iters 30 "
        "--log-interval 30 --seed 1234 --fp4-master-digest --eval-interval 15 --eval-iters 1").split()


def _train(tmp_path: Path, mode: str) -> dict:
    # One rank, forked from a process that has imported Megatron-Core already (tests/distributed/forked_ranks.py)
    log = tmp_path / f"{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "examples.megatron_pretrain_gpt", *ARGS, mode, "--fp4-log-json", str(log)]  # fmt: skip
    proc = forked_ranks.run(cmd, env=megatron_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(log.read_text())


def test_fp4_equals_fake_quant_bitwise_with_clipping_at_dp1(tmp_path):
    fp4, fake = _train(tmp_path, "--fp4-param-gather"), _train(tmp_path, "--fp4-fake-quant")
    norms = [r["grad_norm"] for r in fp4["records"]]
    assert sum(n > 1.0 for n in norms) >= 10, f"clipping must act on many steps for this to test it: {norms}"
    assert norms == [r["grad_norm"] for r in fake["records"]], "gradient norms differ"
    assert [r["loss"] for r in fp4["records"]] == [r["loss"] for r in fake["records"]], "losses differ"
    assert fp4["master_digest"] == fake["master_digest"], "fp32 masters differ"
    # the record, written after each evaluation with complete: false, ends complete
    assert fp4["complete"] is True and [i for i, _ in fp4["validation"]] == [15, 30]
