"""A rank killed (SIGKILL) in the middle of a step or of a checkpoint save, for each training path: the other ranks
leave on their own within seconds, saying what happened, and the restart with the same command resumes from the
newest complete checkpoint (naming what it skipped), after which the run ends bit for bit like an uninterrupted
one: every loss, the full fp32 masters (and for Zero1 and FSDP2 the optimizer state and the gathered NVFP4 bytes;
for Megatron the gathered bytes equal quantize(master) at every iteration, `--check-every 1`).

One run per path is killed and restarted six times in a row (three kills mid-step, three mid-save, at points drawn
from a seeded RNG among the events `kill_switch` counted in the uninterrupted run: collectives, checkpoint file
writes, and the fsyncs and renames of a commit), so seven launches and one uninterrupted reference cover a path.
Each kill lands past the next save after the checkpoint the launch resumed from, so every launch leaves a newer
complete checkpoint behind. The emulated torchrun agent is told to look only every `MONITOR_S` seconds: a survivor
has to leave by itself, well before the agent would stop it.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from . import forked_ranks
from .shared import once_per_session
from .test_launch import REPO, _env, megatron_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEED = 51
KILLS = ("step", "save") * 3
MONITOR_S = 30.0
LEAVE_S = 10.0  # the job ends this soon after the kill: the survivors left by themselves, not by the agent at MONITOR_S
TIMEOUT_S = 180
# What a gloo rank raises when its peer's process is gone (the connection closes or resets under it).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def first_errors(log: str, count: int = 5) -> list[str]:
    """The first lines of `log` that name an error: what a failed launch's tail (a C++ backtrace, the agent's
    summary) leaves out."""
    return [line for line in log.splitlines() if re.search(r"Error|error:|refus", line)][:count]


@dataclass
class Run:
    """What one launch left: how it ended, where it resumed, what it said it skipped, its losses."""

    returncode: int
    ended: float
    """time.time() when the job had ended."""
    log: str
    resumed_from: Optional[int] = None
    said: str = ""
    losses: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)
    """What must equal the uninterrupted run at the end (digests)."""
    counts: list = field(default_factory=list)


def launch(cmd: list, env: dict, kill: Optional[str]) -> tuple[subprocess.CompletedProcess, float]:
    monitor = ["--monitor-interval", str(MONITOR_S)] if kill else []
    cmd = [*cmd[:5], *monitor, *cmd[5:]]
    proc = forked_ranks.run(cmd, env=dict(env, FP4_DIST_TEST_KILL=kill or ""), timeout=TIMEOUT_S)
    return proc, time.time()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


class TorchPath:
    """Zero1Optimizer or fully_shard_nvfp4 with fp4_dist.checkpoint's folder per step (killed_rank_run.py)."""

    steps, save_every = 12, 1

    def __init__(self, trainer: str):
        self.trainer = trainer

    def run(self, work: Path, name: str, kill: Optional[str] = None) -> Run:
        out = work / f"{name}.json"
        proc, ended = launch([*TORCHRUN, str(REPO / "tests" / "distributed" / "killed_rank_run.py"), "--trainer",
                                self.trainer, "--ckpt", str(work / "ckpt"), "--steps", str(self.steps),
                                "--save-every", str(self.save_every), "--out", str(out)], _env(), kill)  # fmt: skip
        r = json.loads(out.read_text()) if out.exists() else {}
        return Run(proc.returncode, ended, proc.stdout + proc.stderr, r.get("resumed_from"),
                   " ".join(r.get("skipped", []) + r.get("notes", [])), r.get("losses", {}), r.get("digests", {}),
                   r.get("counts", []))  # fmt: skip

    def on_disk(self, work: Path) -> tuple[Optional[int], list[str]]:
        """(the newest complete checkpoint's step, the newer unfinished saves), as the folder shows them."""
        root = work / "ckpt"
        if not root.is_dir():
            return None, []
        newest = max((int(p.name[5:]) for p in root.glob("step_*") if (p / ".metadata").is_file()), default=None)
        unfinished = [p.name for p in sorted(root.iterdir()) if (p.name.startswith(".step_") and ".tmp-" in p.name)
                      or (p.name.startswith("step_") and not (p / ".metadata").is_file())]  # fmt: skip
        return newest, [n for n in unfinished if int(n.lstrip(".")[5:13]) > (newest or 0)]

    def left_behind(self, work: Path) -> list[str]:
        return sorted(p.name for p in (work / "ckpt").iterdir())

    def expected_left(self) -> list[str]:
        return [f"step_{s:08d}" for s in range(self.save_every, self.steps + 1, self.save_every)]


MEGATRON_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
                 "--micro-batch-size 2 --global-batch-size 12 --lr 2e-3 --bf16 --use-distributed-optimizer "
                 "--tokenizer-type NullTokenizer --vocab-size 256 --split 80,10,10 --log-interval 1 --seed 1234 "
                 "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
                 "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --eval-iters 1 --eval-interval 1000 "
                 "--hidden-dropout 0 --attention-dropout 0 --ckpt-format torch --num-workers 0 "
                 "--fp4-param-gather").split()


class MegatronPath:
    """megatron.training.pretrain() through python -m fp4_dist.megatron.run, restarted with the same command
    (``--save DIR --load DIR``), as docs/megatron.md shows it."""

    steps, save_every = 12, 1

    def run(self, work: Path, name: str, kill: Optional[str] = None) -> Run:
        data = work.parent / "corpus" if (work.parent / "corpus.bin").exists() else _corpus(work.parent)
        log, counts = work / f"{name}.json", work / f"{name}.counts"
        root = work / "ckpt"
        proc, ended = launch(
            [*TORCHRUN, "-m", "fp4_dist.megatron.run", "--check-every", "1", "--log-json", str(log),
             str(REPO / "tests" / "distributed" / "megatron_kill_rank.py"), str(REPO / "examples" / "pretrain_gpt.py"),
             *MEGATRON_ARGS, "--data-path", str(data), "--train-iters", str(self.steps), "--save", str(root),
             "--load", str(root), "--save-interval", str(self.save_every)],
            dict(megatron_env(), CUDA_DEVICE_MAX_CONNECTIONS="1", FP4_DIST_TEST_COUNTS=str(counts)), kill)  # fmt: skip
        out = proc.stdout + proc.stderr
        r = json.loads(log.read_text()) if log.exists() else {}
        loaded = re.search(r" loading checkpoint from \S+ at iteration (\d+)", out)
        said = "\n".join(line for line in out.splitlines() if "fp4_dist.megatron: --load" in line)
        assert all(it.get("check", "").startswith("ok") for it in r.get("iterations", [])), out[-3000:]
        ranks = [Path(f"{counts}.{rank}") for rank in range(2)]
        return Run(proc.returncode, ended, out, int(loaded.group(1)) if loaded else None, said,
                   {str(it["iteration"]): it["loss"] for it in r.get("iterations", [])},
                   {"master": r.get("master_digest_final")},
                   [json.loads(p.read_text()) for p in ranks] if all(p.exists() for p in ranks) else [])  # fmt: skip

    def on_disk(self, work: Path) -> tuple[Optional[int], list[str]]:
        """(the iteration latest_checkpointed_iteration.txt names, the newer iteration folders)."""
        root = work / "ckpt"
        tracker = root / "latest_checkpointed_iteration.txt"
        newest = int(tracker.read_text()) if tracker.exists() else None
        folders = sorted(p.name for p in root.glob("iter_*")) if root.is_dir() else []
        return newest, [f for f in folders if int(f[5:]) > (newest or 0)]

    def left_behind(self, work: Path) -> list[str]:
        return sorted(p.name for p in (work / "ckpt").iterdir())

    def expected_left(self) -> list[str]:
        return [f"iter_{s:07d}" for s in range(1, self.steps + 1)] + ["latest_checkpointed_iteration.txt"]


def _corpus(folder: Path) -> Path:
    from examples.megatron_preprocess import write_indexed

    assert write_indexed([str(REPO / "examples" / "data" / "tiny_corpus.txt")], str(folder / "corpus")) > 10
    return folder / "corpus"


PATHS = {"zero1": lambda: TorchPath("zero1"), "fsdp2": lambda: TorchPath("fsdp2"), "megatron": MegatronPath}


@once_per_session
def reference(name: str) -> dict:
    """The uninterrupted run of a path: its losses, final digests and the events of every phase per rank."""
    work = Path(tempfile.mkdtemp(prefix=f"fp4_dist_killed_{name}_")) / "reference"
    work.mkdir()
    run = PATHS[name]().run(work, "reference")
    assert run.returncode == 0 and run.counts, run.log[-5000:]
    return {"losses": run.losses, "final": run.final, "counts": run.counts}


def kill_point(rng: random.Random, path, phase: str, start: int, counts: list) -> str:
    """A rank; the step or save after the next save past `start`; an event that every step or save of that kind
    reaches on that rank."""
    rank = rng.randrange(2)
    if phase == "step":
        step = rng.randrange(start + path.save_every, start + 2 * path.save_every)
    else:
        step = start + 2 * path.save_every
    events = min(n for key, n in counts[rank].items() if key.startswith(f"{phase}:"))
    return f"{rank}:{phase}:{step}:{rng.randrange(events)}"


@pytest.mark.parametrize("name", [pytest.param("megatron", marks=pytest.mark.megatron), "zero1", "fsdp2"])
def test_a_run_killed_six_times_resumes_each_time_and_ends_bit_for_bit_like_an_uninterrupted_one(name, tmp_path):
    if name == "megatron":
        pytest.importorskip("megatron.core")
    path, ref = PATHS[name](), reference(name)
    rng = random.Random(f"{SEED}-{name}")
    work = tmp_path / "killed"
    work.mkdir()
    resumed = []
    for i, phase in enumerate((*KILLS, None)):
        newest, unfinished = path.on_disk(work)
        kill = kill_point(rng, path, phase, newest or 0, ref["counts"]) if phase else None
        run = path.run(work, f"launch{i}", kill)
        # resumed from the newest complete checkpoint on disk, naming every newer unfinished one
        assert run.resumed_from == newest, (kill, run.resumed_from, newest, first_errors(run.log), run.log[-3000:])
        assert all(u in run.said for u in unfinished), (unfinished, run.said)
        resumed.append(newest)
        # every step it trained has the uninterrupted run's loss
        differ = {s: (v, ref["losses"][s]) for s, v in run.losses.items() if v != ref["losses"][s]}
        assert not differ, f"launch {i} (kill {kill}, resumed from {newest}): losses differ {differ}"
        if kill is None:
            assert run.returncode == 0, run.log[-5000:]
            assert run.final == ref["final"] and all(run.final.values()), (run.final, ref["final"])
            break
        # the kill happened, and the other rank left by itself, naming the lost connection
        rank = int(kill.split(":")[0])
        killed = re.search(rf"kill_switch: rank {rank} kills itself at .* at ([0-9.]+)", run.log)
        assert killed, f"{kill} was not reached:\n{run.log[-3000:]}"
        left = run.ended - float(killed.group(1))
        assert run.returncode != 0 and left < LEAVE_S, (kill, left, run.log[-3000:])
        assert any(m in run.log for m in PEER_GONE), f"{kill}: the survivor's message:\n{run.log[-3000:]}"
        if name == "megatron":  # the launcher's line on the survivor says what it means
            assert f"fp4_dist.megatron.run: rank {1 - rank}: " in run.log and "a peer rank's process ended" in run.log
    assert resumed[0] is None and len(set(resumed)) >= 5, resumed
    # Nothing a killed save left is still there once the same step was saved again.
    assert path.left_behind(work) == path.expected_left()
