"""The documented snippets, as the docs hold them, run where users run them: under torchrun on CPU (gloo) ranks.

Each snippet is read out of its Markdown file at test time (the first ```python block of the section named), so
the docs cannot drift from what runs. The test supplies only what the snippet leaves to the reader (a model class,
data), in a preamble.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from . import forked_ranks
from .test_launch import REPO, TIMEOUT_S, _env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def python_block(doc: str, index: int = 0) -> str:
    """The `index`-th ```python block of docs/`doc`."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / doc).read_text(), flags=re.S)
    return blocks[index]


FSDP2_PREAMBLE = '''
import torch
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 48), torch.nn.Linear(48, 64)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))
class MyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
data = [torch.randn(4, 64) for _ in range(3)]
'''


def test_the_fsdp2_snippet_runs_as_written_on_two_ranks(tmp_path):
    # Linear(64, 48) at 2 ranks holds 24 rows per rank: not whole 16-row tile bands, so gathered in bf16; the
    # snippet creates no process group, and the report must still see the 2 ranks.
    script = tmp_path / "snippet.py"
    script.write_text(FSDP2_PREAMBLE + python_block("fsdp2.md") + '\nprint("SNIPPET DONE", flush=True)\n')
    proc = _torchrun(script, REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("SNIPPET DONE") == 2
    assert "FSDP world size 2" in proc.stdout and "FSDP world size 1" not in proc.stdout, proc.stdout[-2000:]


EXPORT_PREAMBLE = '''
from transformers import LlamaConfig
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
'''


def _torchrun(script, cwd, *options: str) -> subprocess.CompletedProcess:
    """`script` under ``torchrun --nproc_per_node=2 OPTIONS``, its ranks forked from a process that has imported
    torch (tests/distributed/forked_ranks.py: torchrun's rank environment, checked against it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *options, str(script)]
    return forked_ranks.run(cmd, env=_env(), cwd=cwd, timeout=TIMEOUT_S)


def test_the_export_snippet_runs_as_written_on_two_ranks_and_without_its_process_group_is_refused(tmp_path):
    pytest.importorskip("compressed_tensors")
    snippet = python_block("export.md")
    script = tmp_path / "export_snippet.py"
    script.write_text(EXPORT_PREAMBLE + snippet)
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "llama-nvfp4" / "model.safetensors").is_file()
    # The same snippet without its init_process_group line: every rank is refused, naming the remedy.
    lines = snippet.splitlines()
    at = next(i for i, line in enumerate(lines) if "init_process_group" in line)
    alone = tmp_path / "alone.py"
    alone.write_text(EXPORT_PREAMBLE + "\n".join(lines[:at - 1] + lines[at + 1:]))
    # torchrun stops the other rank once it sees one fail (it looks every 0.1 s); looking every 5 s lets each rank's
    # own refusal reach the log, which is what this run checks.
    proc = _torchrun(alone, tmp_path, "--monitor-interval", "5")
    assert proc.returncode != 0
    refusal = "but torch.distributed is not initialised: call torch.distributed.init_process_group()"
    assert proc.stderr.count(refusal) >= 2


ZERO_PREAMBLE = '''
import types
import torch
torch.manual_seed(0)
class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    def forward(self, x):
        return types.SimpleNamespace(loss=self.fc2(torch.relu(self.fc1(x))).float().pow(2).mean())
loader = [torch.randn(4, 32, dtype=torch.bfloat16) for _ in range(3)]
'''


def test_the_zero1_snippet_runs_as_written_on_two_ranks(tmp_path):
    script = tmp_path / "zero_snippet.py"
    script.write_text(ZERO_PREAMBLE + python_block("zero.md") + "\nprint(\"SNIPPET DONE\", flush=True)\n")
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("SNIPPET DONE") == 2


RECIPE_RUNS = '''
for steps in (4, 6):                   # the recipe twice: it saves steps 2 and 4, then resumes at 4 and saves 6
    model, {opt} = build()
    exec(RECIPE)
    print(f"RECIPE trained steps {{start}}..{{steps}}", flush=True)
fp4_dist.launch.shutdown()
'''
ZERO_RECIPE_PREAMBLE = ZERO_PREAMBLE + '''
import fp4_dist
from fp4_dist.launch import init_distributed
from fp4_dist.optim import Zero1Optimizer
info = init_distributed()
save_every = 2
def build():
    torch.manual_seed(0)
    model = MyModel().to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model)
    return model, Zero1Optimizer(model.named_parameters(), lambda groups: torch.optim.AdamW(groups, lr=1e-3))
def batch_at(step):
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + info.rank)).to(torch.bfloat16)
'''
FSDP2_RECIPE_PREAMBLE = FSDP2_PREAMBLE + '''
import fp4_dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from fp4_dist.fsdp import fully_shard_nvfp4
save_every = 2
def build():
    torch.manual_seed(0)
    model = MyTransformer()
    fully_shard_nvfp4(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                      shard_modules=list(model.blocks))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)
def batch_at(step):
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + torch.distributed.get_rank()))
'''


@pytest.mark.parametrize("doc, preamble, opt", [("zero.md", ZERO_RECIPE_PREAMBLE, "opt"),
                                                ("fsdp2.md", FSDP2_RECIPE_PREAMBLE, "optimizer")],
                         ids=["zero1", "fsdp2"])  # fmt: skip
def test_the_checkpoint_recipe_runs_as_written_and_resumes_from_the_newest_save(doc, preamble, opt, tmp_path):
    recipe = next(b for b in re.findall(r"```python\n(.*?)```", (REPO / "docs" / doc).read_text(), flags=re.S)
                  if "latest_complete_checkpoint" in b)  # fmt: skip
    script = tmp_path / "recipe.py"
    script.write_text(preamble + f"RECIPE = {recipe!r}\n" + RECIPE_RUNS.format(opt=opt))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("RECIPE trained steps 0..4") == 2 and proc.stdout.count("RECIPE trained steps 4..6") == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    if doc == "fsdp2.md":  # docs/export.md's row for an FSDP2 DCP checkpoint, on the recipe's last save
        assert_export_md_loads_the_fsdp2_recipe_checkpoint(tmp_path)


EXPORT_FSDP2 = FSDP2_RECIPE_PREAMBLE + '''
import fp4_dist.checkpoint
from fp4_dist.export import export_compressed_tensors, load_compressed_tensors
fp4_dist.launch.init_distributed()
model, _ = build()
path = "ckpt/step_00000006"
before = [p.full_tensor().clone() for p in model.parameters()]
LOAD
after = [p.full_tensor() for p in model.parameters()]
assert all(not torch.equal(a, b) for a, b in zip(after, before)), "nothing loaded"
export_compressed_tensors(model, "out")
print("EXPORTED", flush=True)
fp4_dist.launch.shutdown()
'''


def assert_export_md_loads_the_fsdp2_recipe_checkpoint(tmp_path) -> None:
    row = next(line for line in (REPO / "docs" / "export.md").read_text().splitlines()
               if line.startswith("| an FSDP2 DCP checkpoint"))  # fmt: skip
    load = re.search(r"`(fp4_dist\.checkpoint\.load_distributed_checkpoint\(.*?\))`", row).group(1)
    script = tmp_path / "export_fsdp2.py"
    script.write_text(EXPORT_FSDP2.replace("LOAD", load))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)]
    proc = forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and "EXPORTED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
