"""tests/distributed/forked_ranks.py against real torchrun: the same rank environment, argv, sys.path, working
directory and exit status, so that a test launched through it sees what a torchrun launch would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import forked_ranks
from .test_launch import REPO, _env

pytestmark = [pytest.mark.distributed]

SEEN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
        "FP4_DIST_PROBE")  # fmt: skip
SET = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # set by both, to values of their own

PROBE = textwrap.dedent(f"""
    import json, os, signal, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import torch
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    seen = {{k: os.environ.get(k) for k in {SEEN!r}}}
    seen.update({{k: k in os.environ for k in {SET!r}}})
    # signal dispositions: a rank that dies of SIGPIPE where a real interpreter ignores it says nothing
    signals = {{s: str(signal.getsignal(getattr(signal, s))) for s in ("SIGPIPE", "SIGINT", "SIGTERM", "SIGCHLD")}}
    line = json.dumps(dict(seen, argv=sys.argv[1:], path0=sys.path[0], cwd=os.getcwd(), name=__name__, sum=t.item(),
                           unbuffered=sys.stdout.write_through, signals=signals))
    sys.stdout.write(line + "\\n")
    dist.destroy_process_group()
    if "fail" in sys.argv and dist.get_rank() == 1:
        raise SystemExit(3)
""")


def _launch(script: Path, *args: str, fork: bool):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script), *args]
    env = dict(_env(), FP4_DIST_PROBE="yes")
    return forked_ranks.run(cmd, env=env, timeout=120, fork=fork)


@pytest.mark.skipif(not forked_ranks._enabled(), reason="forked ranks are off here (a CUDA machine, or "
                    "FP4_DIST_TEST_FORK=0): every launch is real torchrun")  # fmt: skip
def test_forked_ranks_see_what_torchrun_ranks_see(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    runs = {fork: _launch(script, "a", "--b", fork=fork) for fork in (False, True)}
    seen = {}
    for fork, proc in runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = sorted(proc.stdout.splitlines(), key=lambda line: json.loads(line)["RANK"])
        seen[fork] = [json.loads(line) for line in lines]
    assert len(seen[True]) == 3 and seen[True] == seen[False]
    assert seen[True][2]["RANK"] == "2" and seen[True][0]["sum"] == 6.0 and seen[True][0]["FP4_DIST_PROBE"] == "yes"
    assert seen[True][0]["path0"] == str(tmp_path) and seen[True][0]["cwd"] == str(REPO)


@pytest.mark.skipif(not forked_ranks._enabled(), reason="forked ranks are off here")
def test_a_failing_rank_fails_the_job_as_under_torchrun(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    for fork in (False, True):
        proc = _launch(script, "fail", fork=fork)
        assert proc.returncode == 1, (fork, proc.returncode, proc.stderr[-2000:])
        assert len(proc.stdout.splitlines()) == 3


PLAIN = textwrap.dedent(f"""
    import json, os, signal, sys
    import torch
    seen = {{k: os.environ.get(k) for k in {SEEN!r} + {SET!r}}}
    signals = {{s: str(signal.getsignal(getattr(signal, s))) for s in ("SIGPIPE", "SIGINT", "SIGTERM", "SIGCHLD")}}
    print(json.dumps(dict(seen, argv=sys.argv, path0=sys.path[0], cwd=os.getcwd(), name=__name__,
                          unbuffered=sys.stdout.write_through, line_buffered=sys.stderr.line_buffering,
                          signals=signals)))
    print("to stderr", file=sys.stderr)
    if "kill" in sys.argv:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(int(sys.argv[-1]))
""")


@pytest.mark.skipif(not forked_ranks._enabled(), reason="forked ranks are off here")
def test_a_forked_plain_process_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = dict(_env(), FP4_DIST_PROBE="plain")
    for args, code in ((["-u", str(script), "a", "0"], 0), ([str(script), "--b", "3"], 3),
                       ([str(script), "kill", "0"], -9), (["-c", PLAIN, "c", "0"], 0)):  # fmt: skip
        cmd = [sys.executable, *args]
        real = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        forked = forked_ranks.run_python(cmd, env=env, timeout=120)
        assert real.returncode == forked.returncode == code, (args, real.returncode, forked.returncode, forked.stderr)
        assert json.loads(forked.stdout) == json.loads(real.stdout), (args, forked.stdout, real.stdout)
        assert forked.stderr == real.stderr == "to stderr\n", (args, forked.stderr, real.stderr)
    assert forked_ranks._parse_python([sys.executable, "-X", "importtime", "x.py"]) is None  # a fresh interpreter


def test_other_commands_run_as_they_are(tmp_path):
    proc = forked_ranks.run([sys.executable, "-c", "import os; print(os.environ['FP4_DIST_PROBE'])"],
                            env=dict(os.environ, FP4_DIST_PROBE="plain"), timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "plain\n"


HANG = textwrap.dedent("""
    import os, time

    def child_waits_here():
        time.sleep(600)

    def rank_waits_here():
        time.sleep(600)

    pid = os.fork()
    if pid == 0:
        child_waits_here()
    rank_waits_here()
""")


@pytest.mark.skipif(not forked_ranks._enabled(), reason="forked ranks are off here")
def test_a_job_past_its_timeout_says_where_each_rank_and_its_children_wait(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        forked_ranks.run(cmd, env=dict(_env(), PYTHONFAULTHANDLER="1"), timeout=5, dump_stacks=True)
    summary = forked_ranks.stacks_summary(stopped.value.stderr)
    for rank in (0, 1):
        section = summary.split(f"rank {rank}\n")[1].split("rank ")[0]
        assert "in child_waits_here" in section and "in rank_waits_here" in section, summary
