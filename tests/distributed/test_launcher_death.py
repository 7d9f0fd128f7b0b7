"""No orphans: SIGKILL to the launcher's process group (what ``timeout -s KILL``, a job system or the OOM killer
sends) ends every rank within seconds, under the main job (``scripts/train.sh``), ``fp4_dist.megatron.run`` and the
Megatron example trainer. torchrun starts each rank in a session of its own, so that signal reaches the launcher
only; before `fp4_dist.launch.end_with_launcher` the ranks trained on, saving into the folder a restart resumes
from.

Real torchrun (and for the main job the real shell script), started in a process group of its own as a job system
would; the ranks are the processes whose parent is torchrun's agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .forked_ranks import _children
from .test_launch import REPO, _env, megatron_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GONE_S = 10.0  # every rank is gone this soon after the kill
START_S = 240.0  # the ranks are training by then (on a loaded 2-core machine)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def kill_launcher_once_training(cmd: list, env: dict, started: str, log: Path) -> tuple[list[int], float]:
    """Start `cmd` in a process group of its own, wait until its output shows `started` (the ranks train), SIGKILL
    the group, and return the ranks' pids and how long after the kill the last of them was alive (inf: one still
    was after GONE_S; the test then kills it itself)."""
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + START_S
        while started not in log.read_text(errors="replace"):
            assert job.poll() is None, f"the job ended before training:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {started!r} after {START_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        # train.sh execs torchrun, so the group's leader is the agent and the ranks are its children
        ranks = _children(job.pid)
        assert len(ranks) == 2, f"torchrun's children: {ranks}"
        os.killpg(job.pid, signal.SIGKILL)
        killed = time.monotonic()
        job.wait()
        while any(map(_alive, ranks)) and time.monotonic() - killed < GONE_S:
            time.sleep(0.1)
        return ranks, (time.monotonic() - killed if not any(map(_alive, ranks)) else float("inf"))
    finally:
        for pid in ranks:  # a rank the change under test failed to end must not outlive the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_killing_train_sh_with_its_process_group_ends_both_ranks(tmp_path):
    log = tmp_path / "train.log"
    env = dict(_env(), NPROC="2")
    env.pop("FP4_DIST_CALLER_DIR", None)
    ranks, gone = kill_launcher_once_training(
        ["bash", "scripts/train.sh", "--steps", "100000", "--no-progress", "--log-every", "1",
         "--save", str(tmp_path / "ckpt"), "--save-every", "100000"],
        env, started="validation loss before training", log=log)  # fmt: skip
    assert gone <= GONE_S, f"ranks {ranks} still ran {GONE_S} s after the kill:\n{log.read_text()[-2000:]}"


MEGATRON_ARGS = ("--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                 "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --bf16 --use-distributed-optimizer "
                 "--fp4-param-gather --train-iters 5000 --log-interval 1 --eval-interval 100000 "
                 "--vocab-size 256").split()  # fmt: skip


@pytest.mark.megatron
@pytest.mark.parametrize("entry", ["fp4_dist.megatron.run", "examples.megatron_pretrain_gpt"])
def test_killing_torchrun_with_its_process_group_ends_megatron_ranks(tmp_path, entry):
    pytest.importorskip("megatron.core")
    if entry == "fp4_dist.megatron.run":
        from examples.megatron_preprocess import write_indexed

        prefix = str(tmp_path / "corpus")
        write_indexed([str(REPO / "examples" / "data" / "tiny_corpus.txt")], prefix)
        cmd = [*TORCHRUN, "-m", entry, str(REPO / "examples" / "pretrain_gpt.py"), *MEGATRON_ARGS,
               "--data-path", prefix, "--split", "80,10,10", "--eval-iters", "1", "--tokenizer-type",
               "NullTokenizer", "--num-workers", "0"]  # fmt: skip
        started = "iteration        2/"
    else:
        cmd = [*TORCHRUN, "-m", entry, *MEGATRON_ARGS]
        started = "iter     2/"
    log = tmp_path / "job.log"
    ranks, gone = kill_launcher_once_training(cmd, dict(megatron_env(), PYTHONUNBUFFERED="1"), started, log)
    assert gone <= GONE_S, f"ranks {ranks} still ran {GONE_S} s after the kill:\n{log.read_text()[-2000:]}"


_ORPHAN = textwrap.dedent("""
    import os, sys, time
    from fp4_dist.launch import watch_launcher
    watch_launcher(os.getppid(), poll_s=0.2)
    print("watching", flush=True)
    time.sleep(120)
""")


def test_the_watchdog_ends_a_process_whose_launcher_is_gone(tmp_path):
    # Where prctl is not available a thread watches the parent: a middle process (the "launcher") starts the
    # watched one and is SIGKILLed; the watched one ends within seconds.
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    middle = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"p = subprocess.Popen([sys.executable, {str(script)!r}], stdout=sys.stdout)\n"
                               "print(p.pid, flush=True)\ntime.sleep(120)"],
                              env=_env(), stdout=subprocess.PIPE, text=True)  # fmt: skip
    child = int(middle.stdout.readline())
    try:
        assert middle.stdout.readline().strip() == "watching"
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + GONE_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"pid {child} still runs {GONE_S} s after its launcher was killed"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
