"""Multi-rank launches for the tests, with each rank forked from a process that has already imported torch (and
Megatron-Core for the Megatron runs) instead of a fresh interpreter that imports them again.

On the 2-core test machine a rank spends about 5 CPU-seconds importing torch and Megatron-Core before it runs any
of the code under test, and the torchrun agent another 1.5; the suite starts a few hundred ranks. `run(cmd, ...)`
takes the same ``python -m torch.distributed.run --standalone --nproc_per_node=N [-m] TARGET ARGS`` command a test
would give to ``subprocess.run`` and runs it as torchrun would, on ranks forked from a *zygote*:

    zygote      one per pytest worker and import environment; imports torch / Megatron-Core (never fp4_dist, the
                code under test) and waits for jobs on a pipe
      agent     forked per job: picks a free port, forks the ranks, watches them as torchrun's agent does (when one
                fails, the others get SIGTERM after the monitor interval, SIGKILL 30 s later) and exits 0 or 1
        rank    forked per rank: torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), the
                command's environment, working directory, sys.path and argv, its own session, stdout and stderr to
                the job's files; then the target runs as ``python -u`` would run it (runpy), and the rank exits as
                an interpreter does (threads joined, atexit handlers, exit status 1 on an uncaught exception),
                without its teardown of the modules (`_exit`)

What the ranks run is the same code on the same real torch.distributed (gloo) and Megatron-Core: only the start-up
and the end differ. `run_python` does the same for a plain ``python [-m|-c] TARGET ARGS`` process (a bench script, a
command-line tool): one process, forked as a rank is, without the launcher's variables. A zygote serves only commands
whose environment equals its own (outside the variables a rank gets from the launcher and a few read only at run
time), so nothing read at import time can differ from a fresh rank's.
Real torchrun runs instead when this cannot serve the command faithfully: ``FP4_DIST_TEST_FORK=0``, a CUDA machine
(a forked process cannot use CUDA once its parent touched it), a launcher option other than the ones above, or a
zygote that failed to start. Tests of launching itself (the documented launch lines, mpirun, a rank's failure
reaching the others) call torchrun or mpirun directly.
"""

from __future__ import annotations

import io
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]

# Variables a rank may differ in from its zygote: set by the launcher, or read at run time only (never while
# torch or Megatron-Core import).
RUNTIME_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
               "PYTEST_CURRENT_TEST", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "CUDA_DEVICE_MAX_CONNECTIONS")
RUNTIME_PREFIXES = ("FP4_DIST_",)

# What each kind of zygote imports before it forks.
PRELOAD = {"torch": ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                     "torch.distributed.tensor", "torch.optim"),  # fmt: skip
           "megatron": ("torch", "torch.distributed", "torch.optim", "megatron.core", "megatron.core.models.gpt",
                        "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.datasets.gpt_dataset",
                        "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.training")}  # fmt: skip

STOP_GRACE_S = 30.0  # torchrun's agent: SIGTERM, then SIGKILL what is left after this


# ------------------------------------------------------------------------------------------------------ client
def run(cmd: list, *, env: dict, cwd=REPO, timeout: float, dump_stacks: bool = False,
        fork: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`` for a torchrun
    command, its ranks forked from a zygote when that runs it as torchrun would (module docstring).

    `dump_stacks`: past `timeout`, SIGABRT every rank first (its faulthandler, PYTHONFAULTHANDLER, prints where
    each thread waits) and put that in the TimeoutExpired's stderr. `fork=False`: the command itself (a test of
    what torchrun does)."""
    job = _parse(cmd) if fork else None
    if job is None or not _enabled():
        return _real(cmd, env, cwd, timeout, dump_stacks)
    zygote = _zygote_for(env)
    if zygote is None:
        return _real(cmd, env, cwd, timeout, dump_stacks)
    return zygote.run(cmd, job, env, str(cwd), timeout, dump_stacks)


def run_python(cmd: list, *, env: dict, cwd=REPO, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`` for a plain
    ``python [-u] [-m] TARGET ARGS`` command (no launcher: none of torchrun's variables), the process forked from a
    zygote as `run` forks a rank: the same target, argv, sys.path, environment, working directory and exit status
    (minus its signal when one ended it), a second or more of interpreter and torch start-up fewer."""
    job = _parse_python(cmd)
    if job is None or not _enabled():
        return _real(cmd, env, cwd, timeout, False)
    zygote = _zygote_for(env)
    if zygote is None:
        return _real(cmd, env, cwd, timeout, False)
    return zygote.run(cmd, job, env, str(cwd), timeout, False)


def prepare(env: dict) -> None:
    """Start the zygote that `run` would use for commands with environment `env` now, so that a launch a test times
    against something already running does not include its start-up."""
    if _enabled():
        _zygote_for(env)


def _parse_python(cmd: list) -> Optional[dict]:
    """`_parse`'s job for ``python [-u] [-m] TARGET ARGS`` run by this interpreter, or None for any other form."""
    if len(cmd) < 2 or str(cmd[0]) != sys.executable:
        return None
    rest = [str(a) for a in cmd[1:]]
    unbuffered = rest[0] == "-u"
    if unbuffered:
        rest.pop(0)
    # A fresh interpreter keeps an ignored SIGINT ignored (pytest-xdist's workers ignore it), else raises
    # KeyboardInterrupt on it: the forked process takes the disposition this caller would pass on.
    sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    job = {"nproc": 1, "monitor_s": 0.1, "module": False, "plain": True, "unbuffered": unbuffered,
           "sigint_ignored": sigint_ignored}  # fmt: skip
    if rest[0] == "-c" and len(rest) > 1:
        return dict(job, command=rest[1], target="-c", args=rest[2:])
    if rest[0] == "-m":
        job["module"] = True
        rest.pop(0)
    if not rest or rest[0].startswith("-"):
        return None
    return dict(job, target=rest[0], args=rest[1:])


def _enabled() -> bool:
    if os.environ.get("FP4_DIST_TEST_FORK", "1") == "0":
        return False
    # A CUDA machine: a forked rank cannot use CUDA once the zygote's imports touched it.
    return not Path("/dev/nvidiactl").exists()


def _parse(cmd: list) -> Optional[dict]:
    """{nproc, monitor_s, module, target, args} of ``python -m torch.distributed.run --standalone
    --nproc_per_node=N [--monitor-interval S] [-m] TARGET ARGS``, or None for any other form."""
    if len(cmd) < 4 or list(cmd[1:3]) != ["-m", "torch.distributed.run"]:
        return None
    job = {"nproc": None, "monitor_s": 0.1, "module": False}
    rest = [str(a) for a in cmd[3:]]
    while rest and rest[0].startswith("-"):
        opt = rest.pop(0)
        name, _, value = opt.partition("=")
        name = name.replace("_", "-")
        if name == "--standalone":
            continue
        if name in ("--nproc-per-node", "--monitor-interval") and not value:
            if not rest:
                return None
            value = rest.pop(0)
        if name == "--nproc-per-node" and value.isdigit():
            job["nproc"] = int(value)
        elif name == "--monitor-interval":
            job["monitor_s"] = float(value)
        elif name in ("-m", "--module"):
            job["module"] = True
            break
        else:
            return None  # a launcher option this does not emulate: real torchrun
    if not job["nproc"] or not rest:
        return None
    job["target"], job["args"] = rest[0], rest[1:]
    return job


def _real(cmd, env, cwd, timeout, dump_stacks) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(-proc.pid, _children(proc.pid), dump_stacks)  # torchrun starts each rank in a session of its own
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stop(launcher: int, ranks: list[int], dump_stacks: bool) -> None:
    """A job past its timeout: with `dump_stacks` every rank gets SIGABRT first and 3 s (its faulthandler prints
    where each thread waits); then SIGKILL for the launcher (`launcher`: a pid, or minus a process group) and for
    each rank's session."""
    if dump_stacks:
        # The ranks first, then their own children (DataLoader workers: a rank may wait on one; a worker stopped
        # first would move its rank off the point it waits at), apart in time so that a rank's file holds one
        # process's stacks after another.
        workers = [child for pid in ranks for child in _children(pid)]
        for pid in ranks:
            _signal(pid, signal.SIGABRT)
        time.sleep(2 if workers else 3)
        for pid in workers:
            _signal(pid, signal.SIGABRT)
        if workers:
            time.sleep(2)
    _signal(launcher, signal.SIGKILL)
    for pid in ranks:
        _signal(-pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _import_env(env: dict) -> tuple:
    """The part of an environment a zygote must share with the command: all of it but `RUNTIME_ENV`."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in RUNTIME_ENV and not k.startswith(RUNTIME_PREFIXES)))  # fmt: skip


_ZYGOTES: dict = {}
# The suite launches with five import environments: Megatron or torch, warnings filtered or not, and torch with
# TORCH_LOGS (test_compile).
_MAX_ZYGOTES = 5


def _zygote_for(env: dict) -> Optional["Zygote"]:
    key = _import_env(env)
    zygote = _ZYGOTES.get(key)
    if zygote is not None and not zygote.alive():
        del _ZYGOTES[key]
        zygote = None
    if zygote is None:
        if len(_ZYGOTES) >= _MAX_ZYGOTES:  # the oldest goes
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        kind = "megatron" if "without_transformers" in env.get("PYTHONPATH", "") else "torch"
        try:
            zygote = Zygote(env, kind)
        except (OSError, RuntimeError):
            return None
        _ZYGOTES[key] = zygote
    return zygote


class Zygote:
    """The client's handle on one zygote process (`serve`)."""

    def __init__(self, env: dict, kind: str):
        self.dir = Path(tempfile.mkdtemp(prefix="fp4_dist_zygote_"))
        with open(self.dir / "zygote.log", "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-u", __file__, "--serve", kind], env=env, cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        self._pending = b""
        if self._reply(120.0) != {"ready": True}:
            self.close()
            raise RuntimeError(f"the test zygote did not start: {(self.dir / 'zygote.log').read_text()[-2000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        _signal(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def _reply(self, timeout: Optional[float]) -> Optional[dict]:
        """The zygote's next reply line; None past `timeout`; {"dead": True} if it exited. Read from the pipe's fd
        directly: a buffered reader could hold the next reply where select() does not see it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return {"dead": True}
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd, job, env, cwd, timeout, dump_stacks) -> subprocess.CompletedProcess:
        out_dir = Path(tempfile.mkdtemp(dir=self.dir))
        request = dict(job, env=env, cwd=cwd, out=str(out_dir))
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        started = self._reply(30.0)
        if not started or "agent" not in started:
            self.close()
            return _real(cmd, env, cwd, timeout, dump_stacks)
        done = self._reply(timeout)
        if done is None:  # past the timeout: stopped as _real stops torchrun's job
            ranks = [int(p) for p in (out_dir / "ranks").read_text().split()] if (out_dir / "ranks").exists() else []
            _stop(started["agent"], ranks, dump_stacks)
            self._reply(30.0)
            out, err = _read(out_dir)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        if done.get("dead"):
            raise RuntimeError(f"the test zygote died: {(self.dir / 'zygote.log').read_text()[-2000:]}")
        out, err = _read(out_dir)
        return subprocess.CompletedProcess(cmd, done["returncode"], out, err)


def _read(out_dir: Path) -> tuple[str, str]:
    """The job's stdout and stderr, and after the stderr what each rank's faulthandler wrote (`stacks`); the folder
    goes (a suite runs hundreds of jobs)."""
    out, err = ((out_dir / name).read_text(errors="backslashreplace") for name in ("stdout", "stderr"))
    for path in sorted(out_dir.glob("stacks.*"), key=lambda p: int(p.suffix[1:])):
        text = path.read_text(errors="backslashreplace")
        if text:
            err += f"\n{STACKS_HEADER}{path.suffix[1:]}:\n{text}"
    shutil.rmtree(out_dir, ignore_errors=True)
    return out, err


STACKS_HEADER = "forked_ranks: faulthandler of rank "


def stacks_summary(stderr: str, frames: int = 12) -> str:
    """Each rank's waiting point from `_read`'s stacks sections: per process, the thread the signal interrupted
    (faulthandler's "Current thread", the main thread for SIGABRT) with its innermost `frames` frames, and how many
    other threads it had. Short enough to survive a CI log's truncation, where the whole dump would not."""
    lines = []
    for section in stderr.split(STACKS_HEADER)[1:]:
        head, _, body = section.partition("\n")
        lines.append(f"rank {head.rstrip(':')}")
        for process in body.split("Fatal Python error")[1:] or [body]:
            threads = process.split("\n\n")
            current = next((t for t in threads if "Current thread" in t), "")
            others = sum("Thread 0x" in t for t in threads)
            frame_lines = [ln for ln in current.splitlines() if ln.strip().startswith("File ")]
            lines.append(f"  a process ({others} other threads), interrupted thread:")
            lines.extend("    " + ln.strip() for ln in frame_lines[:frames])
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ zygote
def serve(kind: str) -> None:
    """The zygote: import, then for each request line fork an agent, say its pid, wait for it, say its status."""
    import importlib

    for name in PRELOAD[kind]:  # as a rank imports them (their warnings, filters and all: into the log)
        if name.startswith("megatron.training"):
            _typing_override()
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    _freeze()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports or a fork print goes to the log, not into the replies
    own_path = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base_path = [p for p in sys.path[1:] if p not in own_path]
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _agent(job, base_path)  # never returns
        replies.write(json.dumps({"agent": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _typing_override() -> None:
    """``typing.override`` on Python 3.11 (typing_extensions'), which megatron.training imports from typing (3.12+):
    what every Megatron rank's launcher under test sets before it imports megatron.training
    (fp4_dist.megatron.patching.python_311_shim), set here once for the zygote's import of it. That import (some 350
    modules, CuPy's among them) otherwise costs each forked Megatron rank most of a second."""
    import typing

    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _freeze() -> None:
    """What the imports left moves to the collector's permanent generation: a forked process's collections skip those
    objects instead of walking them all again (writing to every page the fork shares with the zygote). The torch-only
    multi-process tests (test_forked_ranks, test_launch, test_fsdp: -n 2, alone) took 137.6 s without it, 111.7 and
    122.6 s with torch's objects frozen. Megatron-Core's are frozen too since a rank ends without the interpreter's
    teardown of the modules (`_exit`): in that teardown, triton's nanobind bindings (imported by Megatron-Core) print
    every object of theirs still alive, which frozen objects all are. A Megatron rank's own collections (Megatron's
    and fp4_dist's, the one at its exit) then skip some 270,000 objects, 0.25 s each: a 2-rank pretrain() launch of 5
    iterations took 7.6-8.1 CPU-seconds with only torch's objects frozen, 6.5-6.7 with all. What the imports left in
    cycles is collected before the freeze; the job's own objects are collected as in a fresh rank."""
    import gc

    gc.collect()
    gc.freeze()


def _agent(job: dict, base_path: list) -> None:
    """torchrun's agent for one job: fork the ranks, watch them, stop them all when one fails, exit 0 or 1."""
    os.setsid()
    out = Path(job["out"])
    err = os.open(out / "stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    port = _free_port()
    run_id = uuid.uuid4().hex
    ranks = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(job, rank, port, run_id, base_path)  # never returns
        ranks[pid] = rank
    (out / "ranks").write_text(" ".join(map(str, ranks)))
    codes, failed_at = {}, None
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            if pid in ranks:
                codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
                if codes[ranks[pid]] != 0 and failed_at is None:
                    failed_at = time.monotonic()
            continue
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= job["monitor_s"]:
            # torchrun looks every monitor interval; once it sees a failure it stops every rank left
            for p, r in ranks.items():
                if r not in codes:
                    _signal(p, signal.SIGTERM)
            failed_at = float("inf")
            deadline = now + STOP_GRACE_S
        if failed_at == float("inf") and now > deadline:
            for p, r in ranks.items():
                if r not in codes:
                    _signal(-p, signal.SIGKILL)
        time.sleep(0.02)
    if job.get("plain"):  # the process's own exit status, or the signal that ended it
        code = codes[0]
        if code < 0:
            if -code != signal.SIGKILL:  # SIGKILL's disposition is fixed; another's may be the zygote's
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)
    bad = {r: c for r, c in sorted(codes.items()) if c != 0}
    if bad:
        os.write(2, f"forked_ranks: ranks failed, exit codes by rank: {bad}\n".encode())
    os._exit(1 if bad else 0)


def _free_port() -> int:
    """A free port for the job's rendezvous (rank 0's TCPStore), drawn below the kernel's ephemeral range. A port
    from that range (a bind to port 0) can be handed to another process's outgoing connection before rank 0 binds
    it again, and a suite of hundreds of jobs on one machine opens thousands of such connections (gloo's pairs)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free down there: the kernel's choice
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _rank(job: dict, rank: int, port: int, run_id: str, base_path: list) -> None:
    """Become rank `rank` as torchrun makes it (``python -u TARGET ARGS`` in a session of its own), run the target,
    and exit the way that interpreter would (`_exit`)."""
    os.setsid()
    # the dispositions a fresh interpreter starts with: SIGPIPE ignored (a write to a dead peer's socket is an error
    # the rank reports, not a silent death), SIGINT to KeyboardInterrupt (a plain process: ignored where its caller
    # ignores it, as a fresh interpreter inherits), the others default
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if job.get("sigint_ignored") else signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    out = Path(job["out"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(out / "stdout", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 1)
    os.dup2(os.open(out / "stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 2)
    n = job["nproc"]
    env = dict(job["env"])
    if not job.get("plain"):
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0",
                   GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_NAME="default", ROLE_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="False",
                   TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))  # fmt: skip
    if n > 1 and "OMP_NUM_THREADS" not in job["env"]:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default with several ranks per node
    os.environ.clear()
    os.environ.update(env)
    os.chdir(job["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        if job.get("unbuffered", True) or env.get("PYTHONUNBUFFERED"):  # `python -u`: written through
            stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)
        else:  # `python` into a file: stdout block-buffered, stderr line-buffered
            stream = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=name == "stderr")  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import faulthandler

    if env.get("PYTHONFAULTHANDLER"):
        # A file per rank: ranks stopped together would interleave their stacks line by line in the shared stderr.
        # The processes a rank forks (DataLoader workers) inherit the handler and write here too, one at a time.
        stacks = open(out / f"stacks.{rank}", "a", buffering=1)  # noqa: SIM115 (open for the rank's lifetime)
        faulthandler.enable(file=stacks, all_threads=True)
    else:
        faulthandler.disable()
    try:
        _run_target(job, env, base_path)
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop)
    except BaseException as error:  # noqa: BLE001 (uncaught in the target: the interpreter prints it, status 1)
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # the zygote's frames: not the rank's
            tb = tb.tb_next
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        status = 1
        if isinstance(error, KeyboardInterrupt):
            status = -signal.SIGINT
    _exit(status)


def _run_target(job: dict, env: dict, base_path: list) -> None:
    """Run the job's target as ``python [-u] [-m] TARGET ARGS`` or ``python -c COMMAND ARGS`` would."""
    import runpy

    target, args = job["target"], job["args"]
    own_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if job["module"] else str(Path(target).resolve().parent)
    sys.path[:] = [first, *own_path, *base_path]
    sys.argv = [target, *args]
    if "command" in job:  # `python -c COMMAND ARGS`: '' first on sys.path, argv[0] "-c", a fresh __main__
        import types

        sys.path[:] = ["", *own_path, *base_path]
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(job["command"], "<string>", "exec"), main.__dict__)
    elif job["module"]:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def _exit_status(stop: SystemExit) -> int:
    """The exit status a fresh interpreter gives an uncaught SystemExit: its code (None: 0), or 1 after printing a
    code that is not an int to stderr."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _exit(status: int) -> None:
    """End the rank as a fresh interpreter's finalization does, up to its teardown of the modules: non-daemon threads
    joined, atexit handlers run (weakref finalizers among them), the cyclic garbage collected (its finalizers run
    while the modules are whole), stdout and stderr flushed (status 120 if that fails), an uncaught
    KeyboardInterrupt ending it by SIGINT. Then os._exit: the teardown left out frees every object that the imports
    made, about a second of CPU per Megatron rank on the 2-core test machine (in a fresh interpreter too) that the
    suite's few hundred ranks would each spend. What it skips are the destructors of objects alive until the modules
    go, and the C library's exit handlers; the tests of a rank's teardown itself launch with real torchrun."""
    import atexit
    import gc
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120
    if status == -signal.SIGINT:  # an uncaught KeyboardInterrupt: the interpreter ends by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
