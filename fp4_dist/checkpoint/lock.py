"""One writer per checkpoint root: a lock file naming the job that saves there, taken before its first save.

    <root>/.fp4_dist_lock      {"host": ..., "pid": ..., "start_ticks": ..., "started": "2026-12-08T10:31:02"}

Two jobs saving into one root interleave their step folders (a scheduler's retry while the first still runs, the
same command started twice). Rank 0 of a job takes the lock at its first save (`fp4_dist.checkpoint.save`), or at
start-up where the job knows its root (`lock_root`); a second job is refused then, on every rank, naming the
holder. The lock is the file's ``flock``, held by the holder's open descriptor: the kernel drops it when the process
ends however it ends, and the file's contents name the holder for the refusal. The holder is told by host, pid and
the process's start time (a pid is reused; pid and start time together are not).

- A lock whose holder is gone (same host, no such process, or another process under its pid) is taken over, with a
  note naming it.
- A lock naming another host is honoured: whether that process still runs cannot be seen from here (and ``flock``
  does not reach across hosts on every shared file system). ``take_over_other_host=True`` (``--take-over-lock``)
  takes it over, with a note.
- Once the lock is taken, what unfinished saves left in the root (``.step_*.tmp-*`` and the like, the size of a
  checkpoint each) is deleted, each named as it goes: no other writer can be running there then.
- The lock is released at exit (``atexit``; `release_root` earlier). A killed job leaves the file, which the next
  job takes over as above.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .._user import user_stacklevel
from . import atomic

__all__ = ["LOCK", "Holder", "RootLockedError", "lock_root", "release_root", "remove_leftovers"]

LOCK = ".fp4_dist_lock"
TAKE_OVER_REMEDY = ("if that job is gone (its host down or rebooted), pass take_over_other_host=True "
                    "(--take-over-lock on the command lines that save)")  # fmt: skip
# What an interrupted atomic write leaves beside its target: .<name>.<tmp|del|old>-<host>-<pid>-<8 hex>
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|del|old)-.+-\d+-[0-9a-f]{8}")


class RootLockedError(RuntimeError):
    """Another job holds the checkpoint root's lock; this job saved nothing there."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start_ticks: Optional[int]
    """The process's start time in clock ticks since boot (/proc/<pid>/stat); None where /proc has none."""
    started: str
    """The start time as local time, for people."""

    @staticmethod
    def of_this_process() -> "Holder":
        ticks = _start_ticks(os.getpid())
        return Holder(socket.gethostname(), os.getpid(), ticks, _wall_time(ticks))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


def _start_ticks(pid: int) -> Optional[int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22; the name before ')' may hold spaces


def _wall_time(ticks: Optional[int]) -> str:
    if ticks is None:
        return time.strftime("%Y-%m-%dT%H:%M:%S") + " (the time it took the lock)"
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")))


def _gone(holder: Holder) -> bool:
    """Whether `holder`, a process of this host, has ended (or its pid now belongs to another process)."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: alive, unless its start time says it is another process
    return holder.start_ticks is not None and _start_ticks(holder.pid) not in (None, holder.start_ticks)


_FDS: dict[str, tuple[int, int]] = {}
"""(open flocked descriptor, pid of the process that took it) of each lock held here, by resolved root. The pid
keeps a forked child (which inherits the table) from releasing its parent's locks at its exit."""
_JOB: set[str] = set()
"""Roots this job has locked (on every rank, so that later saves skip the collective)."""


def _read_holder(path: Path) -> Optional[Holder]:
    # The holder writes its record just after taking the flock: a reader that comes in between retries briefly.
    for _ in range(50):
        try:
            return Holder(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            time.sleep(0.02)
    return None


def _open_locked(path: Path) -> Optional[int]:
    """An open descriptor of `path` holding its flock, or None when another process holds it. Retries when the
    file was unlinked (released) between the open and the flock, so the flock is on the file the path names."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return None
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _acquire(root: Path, take_over_other_host: bool) -> list[str]:
    """Take `root`'s lock for this process; the notes of what was taken over. Raises RootLockedError."""
    key = str(root.resolve())
    if key in _FDS and _FDS[key][1] == os.getpid():
        return []
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    me = Holder.of_this_process()
    fd = _open_locked(path)
    held = _read_holder(path) if fd is None else None
    if fd is None:
        who = held.describe() if held else "another process (it has not written its name yet)"
        raise RootLockedError(f"{root} is the checkpoint root of another job that is still running: {who} holds "
                              f"{path}. Two jobs saving into one root would interleave their checkpoints; stop that "
                              "job first, or save into another folder")  # fmt: skip
    notes = []
    try:
        before = json.loads(os.read(fd, 1 << 16) or b"null")
        before = Holder(**before) if isinstance(before, dict) else None
    except (ValueError, TypeError):
        before = None  # a record cut short by a crash while it was written: no holder to honour
    if before is not None and before.host != me.host:
        if not take_over_other_host:
            os.close(fd)
            raise RootLockedError(f"{path} names a job of another host ({before.describe()}), which may still be "
                                  f"saving into {root}; whether it runs cannot be seen from this host. Stop it or "
                                  f"save into another folder; {TAKE_OVER_REMEDY}")  # fmt: skip
        notes.append(f"took over {path} from {before.describe()}, as asked (take_over_other_host)")
    elif before is not None and (before.pid, before.start_ticks) != (me.pid, me.start_ticks):
        if not _gone(before):  # alive, yet not holding the flock: not a lock of ours; do not guess
            os.close(fd)
            raise RootLockedError(f"{path} names {before.describe()}, which still runs; stop it first, or save into "
                                  "another folder")  # fmt: skip
        notes.append(f"took over {path}, left by {before.describe()}, which has ended")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me.__dict__).encode(), 0)
    os.fsync(fd)
    _FDS[key] = (fd, os.getpid())
    return notes


def remove_leftovers(root) -> list[str]:
    """Delete what interrupted atomic writes left in `root` (``.step_*.tmp-*``, ``.iter_*.del-*``, ...) and put
    back a complete earlier version left aside (``.old-``, `fp4_dist.checkpoint.atomic.recover`); one note per
    entry. Only for the holder of `root`'s lock: no writer into `root` can be running then."""
    root = Path(root)
    notes = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        m = _LEFTOVER.fullmatch(entry.name)
        if not m or not entry.exists():
            continue
        if m["kind"] == "old":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # said below
                notes += atomic.recover(root / m["name"])
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        what = "temporary folder" if m["kind"] == "tmp" else "earlier version being deleted"
        notes.append(f"deleted {entry}, the {what} of a save that did not finish")
    return notes


def lock_root(root, *, take_over_other_host: bool = False, process_group=None) -> None:
    """Make this job the one writer of checkpoint root `root` (collective over `process_group`, the job's ranks:
    every rank calls; a second call for the same root does nothing). Rank 0 takes the lock (module docstring), then
    deletes what unfinished saves left in `root`, warning once per note; every rank raises the same
    RootLockedError, naming the holder, when another job holds it.

    Args:
        root: the folder the job's checkpoints go into (created).
        take_over_other_host: take a lock that names another host's job (it cannot be checked from here).
        process_group: the job's ranks (default: all).
    """
    import torch.distributed as dist

    root = Path(root)
    key = str(root.resolve())
    if key in _JOB:
        return
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    verdict: list = [None]
    if rank == 0:
        try:
            notes = _acquire(root, take_over_other_host)
            verdict[0] = ("taken", notes + remove_leftovers(root))
        except (RootLockedError, OSError) as e:
            verdict[0] = ("refused", f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    if distributed:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(verdict, src=src, group=process_group)
    outcome, said = verdict[0]
    if outcome == "refused":
        raise RootLockedError(said)
    for note in said if rank == 0 else []:
        warnings.warn(f"fp4_dist: {note}", UserWarning, stacklevel=user_stacklevel())
    _JOB.add(key)


def release_root(root) -> None:
    """Give up `root`'s lock, if this process holds it: the file is deleted, then its flock dropped."""
    key = str(Path(root).resolve())
    _JOB.discard(key)
    held = _FDS.pop(key, None)
    if held is not None and held[1] == os.getpid():
        (Path(key) / LOCK).unlink(missing_ok=True)
        os.close(held[0])


@atexit.register
def _release_all() -> None:
    for key in list(_FDS):
        release_root(key)
