"""Megatron-Core integration on gloo ranks: torchrun launches of megatron_suite.py for dp 2, 3 and 4.

One launch per data-parallel size runs several suites on megatron-core's real GPTModel, DDP and
DistributedOptimizer (see megatron_suite.py); the tests below read its JSON report.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from . import forked_ranks
from .shared import once_per_session
from .test_launch import megatron_env

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "megatron_suite.py"
SUITES = {2: "parity,upstream,resume,fake,lean", 3: "parity,upstream,resume", 4: "parity,upstream"}
TIMEOUT_S = 400

pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.slow]


@once_per_session
def report(dp: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"fp4_megatron_dp{dp}_")) / "report.json"
    env = dict(megatron_env(), PYTHONWARNINGS="ignore")  # the CPU/gloo suites, also on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp}", str(SCRIPT),
           "--out", str(out), "--suites", SUITES[dp]]
    proc = forked_ranks.run(cmd, env=env, timeout=TIMEOUT_S)
    rep = json.loads(out.read_text()) if out.exists() else {"suites": {}, "failures": []}
    rep["log"] = (proc.stdout + proc.stderr)[-6000:]
    rep["returncode"] = proc.returncode
    return rep


def failures(dp: int, suite: str) -> list[str]:
    rep = report(dp)
    assert suite in rep["suites"], f"dp {dp}: suite {suite} did not run (exit {rep['returncode']}):\n{rep['log']}"
    return [f for f in rep["failures"] if f.startswith(f"[{suite}]")]


@pytest.mark.parametrize("dp", [2, 3, 4], ids=lambda n: f"dp{n}")
def test_every_rank_gathers_nvfp4_bytes_equal_to_quantize_of_full_master_after_every_step(dp):
    bad = failures(dp, "parity")
    assert not bad, "\n".join(bad)
    parity = report(dp)["suites"]["parity"]
    assert parity["overlap-buckets-bf16-ends"]["buckets"] > 1  # the overlap variant really had several buckets


@pytest.mark.parametrize("dp", [2, 3, 4], ids=lambda n: f"dp{n}")
def test_upstream_packed_layout_goes_stale_on_the_same_model(dp):
    bad = failures(dp, "upstream")
    assert not bad, "\n".join(bad)
    assert report(dp)["suites"]["upstream"]["stale_bytes"] > 0


@pytest.mark.parametrize("dp", [2, 3], ids=lambda n: f"dp{n}")
def test_resume_from_checkpoint_continues_bit_for_bit(dp):
    bad = failures(dp, "resume")
    assert not bad, "\n".join(bad)
    assert len(report(dp)["suites"]["resume"]["losses"]) == 6


def test_nvfp4_param_gather_run_equals_fake_quant_bf16_run_bit_for_bit():
    bad = failures(2, "fake")
    assert not bad, "\n".join(bad)


def test_lean_compute_trains_bitwise_like_kept_compute_copies():
    bad = failures(2, "lean")
    assert not bad, "\n".join(bad)
    rep = report(2)["suites"]["lean"]
    assert rep["compute_copy_bytes"] == 0 and len(rep["losses"]) == 4
    assert rep["copies"]["deep"] < rep["copies"]["lean"], rep["copies"]


@pytest.mark.parametrize("dp", [2, 3, 4], ids=lambda n: f"dp{n}")
def test_launch_exits_cleanly(dp):
    rep = report(dp)
    assert rep["returncode"] == 0, rep["log"]
