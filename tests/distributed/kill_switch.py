"""A rank that SIGKILLs itself at a chosen point of a training run: the test hook of the killed-rank tests.

    FP4_DIST_TEST_KILL="RANK:PHASE:STEP:K"

PHASE is ``step`` (the training step that starts after STEP steps) or ``save`` (the checkpoint save after STEP
steps); the script marks them with `KillSwitch.phase`. Inside a phase every torch.distributed collective call
(wrapped by `_harness.count_collectives`, the real call still runs) and every write, fsync, rename and delete of
`fp4_dist.checkpoint.atomic` is one event, counted from 0; rank RANK kills itself (SIGKILL, as the out-of-memory
killer or a preempting scheduler would) just before event K. Without the variable nothing is killed and the counts of
every phase are kept: an uninterrupted run reports them, and the test chooses its kill points among them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Optional

from _harness import count_collectives

ENV = "FP4_DIST_TEST_KILL"


class KillSwitch:
    def __init__(self, rank: int, spec: Optional[str] = None):
        self.rank = rank
        spec = os.environ.get(ENV) if spec is None else spec
        if spec:
            r, phase, step, k = spec.split(":")
            self.target = (int(r), phase, int(step), int(k))
        else:
            self.target = None
        self.where: Optional[tuple[str, int]] = None
        self.counts: dict[str, int] = {}
        """"phase:step" -> events seen there."""

    def install(self) -> "KillSwitch":
        """Count collectives and fp4_dist.checkpoint.atomic's steps from now on, for the life of the process."""
        from fp4_dist.checkpoint import atomic

        self._collectives = count_collectives(before=self.event)
        self._collectives.__enter__()
        atomic._step = lambda action, path: self.event(f"atomic {action}")
        return self

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        outer, self.where = self.where, (name, int(step))
        try:
            yield
        finally:
            self.where = outer

    def event(self, what: str) -> None:
        if self.where is None:
            return
        name, step = self.where
        key = f"{name}:{step}"
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        if self.target == (self.rank, name, step, k):
            print(f"kill_switch: rank {self.rank} kills itself at {key} event {k} ({what}) at {time.time():.3f}",
                  flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGKILL)
