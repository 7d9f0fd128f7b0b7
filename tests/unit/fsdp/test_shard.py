"""fp4_dist.fsdp.shard in one gloo process (a subprocess, forked from one that has imported torch
(tests/distributed/forked_ranks.py): the process group is global state)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.distributed import forked_ranks

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
    proc = forked_ranks.run_python([sys.executable, "-c", _UNSHARD_AFTER_STEP], env=env, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")), proc.stdout + proc.stderr[-2000:])
    assert "0.weight are stale" in line and "an optimizer step" in line and "precompute_nvfp4(model)" in line, line


_TIED = """
import sys, warnings, torch, torch.distributed as dist
from torch import nn
import fp4_dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from fp4_dist.fsdp import fully_shard_nvfp4
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
    def forward(self, t):
        return self.head(torch.relu(self.mid(self.emb(t))))
torch.manual_seed(0)
m = LM()
if sys.argv[1] == "converted":
    fp4_dist.convert_linear_weights(m)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = fully_shard_nvfp4(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
first = m.emb.weight.full_tensor().clone()
t = torch.randint(0, 64, (8, 4))
for _ in range(2):
    nn.functional.cross_entropy(m(t).float().flatten(0, 1), t.flatten()).backward()
    opt.step()
    opt.zero_grad()
moved = not torch.equal(first, m.emb.weight.full_tensor())
print("RESULT", report.nvfp4, sorted(report.kept), m.emb.weight is m.head.weight, moved, report.kept["head.weight"])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("order", ["plain", "converted"])
def test_a_linear_weight_tied_to_an_embedding_stays_tied_in_high_precision(order):
    # It became an NVFP4 master of the head alone: the embedding and the head trained as two weights, silently;
    # converted first, FSDP2 met the embedding's NVFP4Tensor and blamed the user for not calling fully_shard_nvfp4.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = forked_ranks.run_python([sys.executable, "-c", _TIED, order], env=env, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), proc.stdout + proc.stderr[-3000:])
    assert line.startswith("RESULT ['mid.weight'] ['head.weight'] True True shared with emb.weight"), line
    assert ("it was an NVFP4 weight" in line) == (order == "converted"), line


_MESSAGES = """
import warnings, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from fp4_dist.fsdp import fully_shard_nvfp4
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), shard_modules=list(net))
    return net
net = build()
try:
    net[0].unshard()
except RuntimeError as e:
    print("UNSHARD", e)
net = build()
net.load_state_dict(build().state_dict(), assign=True)
try:
    net(torch.randn(4, 32))
except RuntimeError as e:
    print("ASSIGN", e)
dist.destroy_process_group()
"""


def test_a_gather_before_any_cast_and_an_assigning_load_are_named_for_what_they_are():
    # The first was called stale ("its fp32 master changed"), the second an unsharded weight ("call reshard()").
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = forked_ranks.run_python([sys.executable, "-c", _MESSAGES], env=env, timeout=120)
    said = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if ln.startswith(("UNSHARD", "ASSIGN")))
    assert "0.weight are not cast yet" in said.get("UNSHARD", ""), proc.stdout + proc.stderr[-3000:]
    assert "0.weight is no NVFP4 master any more" in said.get("ASSIGN", "") and "assign=True" in said["ASSIGN"], said


_EVAL_BETWEEN = """
import sys, warnings, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from fp4_dist.fsdp import fully_shard_nvfp4
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
def run(evaluate):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                          shard_modules=[net[0], net[2]], reshard_after_forward=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if evaluate:
            with torch.no_grad():
                net(x)
    return losses
print("LOSSES", run(False) == run(True))
dist.destroy_process_group()
"""


def test_an_evaluation_forward_between_steps_under_reshard_after_forward_false_trains_on():
    # FSDP2 keeps the evaluated layers unsharded; the next forward's cast refused them though no master had changed.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = forked_ranks.run_python([sys.executable, "-c", _EVAL_BETWEEN], env=env, timeout=120)
    assert "LOSSES True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


_TWO_TIED_LINEARS = """
import warnings, torch, torch.distributed as dist
from torch import nn
import fp4_dist
from fp4_dist.fsdp import fully_shard_nvfp4
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
m = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False))
m[2].weight = m[0].weight
fp4_dist.convert_linear_weights(m)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = fully_shard_nvfp4(m)
print("RESULT", report.nvfp4, sorted(report.kept), m[0].weight is m[2].weight)
dist.destroy_process_group()
"""


def test_two_linears_sharing_a_converted_weight_both_stay_tied():
    # Made plain for the first holder, the weight was a new parameter the second holder's check did not know:
    # the second became an NVFP4 master of its own, untied.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = forked_ranks.run_python([sys.executable, "-c", _TWO_TIED_LINEARS], env=env, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), proc.stdout + proc.stderr[-3000:])
    assert line == "RESULT [] ['0.weight', '2.weight'] True", line
