"""fp4_dist.fsdp.shard in one gloo process (a subprocess: the process group is global state)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

_UNSHARD_AFTER_STEP = """
import warnings, torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from fp4_dist.fsdp import fully_shard_nvfp4
from fp4_dist.launch import init_distributed, shutdown
init_distributed("gloo")
net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fully_shard_nvfp4(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), shard_modules=list(net))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
net(torch.randn(4, 32)).float().sum().backward()
opt.step()
try:
    net[0].unshard()
except RuntimeError as e:
    print("ERROR", e)
shutdown()
"""


def test_unshard_right_after_a_step_names_the_step_and_the_remedy():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29871", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _UNSHARD_AFTER_STEP], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")), proc.stdout + proc.stderr[-2000:])
    assert "0.weight are stale" in line and "an optimizer step" in line and "precompute_nvfp4(model)" in line, line
