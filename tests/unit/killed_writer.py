"""A writer killed part-way: `die_at` forks, and the child runs a write and SIGKILLs itself (as the out-of-memory
killer or a preempting scheduler would) on reaching the k-th write, fsync, rename or delete of
`fp4_dist.checkpoint.atomic` (its `_step` hook, replaced in the child only)."""

from __future__ import annotations

import os
import signal
import warnings

import torch

from fp4_dist.checkpoint import atomic


def die_at(k: int, write) -> int:
    """Fork; the child runs `write()` (warnings silenced) and kills itself at hook point `k` (0-based). Returns the
    child's exit code: -SIGKILL when killed, 3 when `write` ended first."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            # A child forked after the parent's OpenMP threads ran would wait forever at their first barrier (the
            # team is not copied): compute on this thread alone, whatever OMP_NUM_THREADS the run was given.
            torch.set_num_threads(1)
            count = iter(range(10**9))
            atomic._step = lambda action, path: next(count) == k and os.kill(os.getpid(), signal.SIGKILL)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                write()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
