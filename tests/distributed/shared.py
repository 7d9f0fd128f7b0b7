"""Launches that several tests read, made once per test session whichever pytest-xdist worker asks first.

A launch (a torchrun job and its JSON report) costs seconds of every rank's start-up; the tests of one world size
all read one. Under pytest-xdist the tests that read it may run on different workers (processes), so a per-process
cache would launch it once per worker: `once_per_session` keeps the result in a file of the session instead, and a
worker that asks while another is launching waits for that result (an exclusive file lock per launch).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path


def _session_dir() -> Path:
    # pytest-xdist gives every worker of a session the same PYTEST_XDIST_TESTRUNUID; alone, this process is the session.
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    root = Path(tempfile.gettempdir()) / f"fp4_dist_tests_{uid}"
    root.mkdir(exist_ok=True)
    return root


def once_per_session(fn):
    """`fn(*args)` run once per test session for each `args` (JSON-able arguments and result: tuples come back as
    lists); every other call, in any worker, reads its result. A call that raises stores nothing."""
    memo: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if args not in memo:
            key = hashlib.sha1(f"{fn.__module__}.{fn.__qualname__}{args!r}".encode()).hexdigest()[:20]
            root = _session_dir()
            result = root / f"{key}.json"
            with open(root / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when fn raises
                if not result.exists():
                    value = fn(*args)
                    result.write_text(json.dumps(value))
                memo[args] = json.loads(result.read_text())
        return memo[args]

    return wrapper
