"""Shared plumbing of the distributed suites (plain scripts: no pytest inside the ranks).

Each suite module exposes ``run(ctx) -> dict`` and records failures with ``ctx.check``; `run_suite.py`
collects every rank's failures, and rank 0 writes one JSON report that tests/distributed/test_launch.py reads.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fp4_dist.testing import bytes_mismatch

# torch.distributed entry points a collective can go through (old and new names).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter")
# torch >= 2.12 names the flat-tensor collectives *_single; older releases (the GPU image has 2.11) only have
# *_into_tensor / *_tensor, which fp4_dist.cast.collectives falls back to. Count both under the new name.
CANONICAL = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


@dataclass
class Context:
    rank: int
    world_size: int
    device: torch.device
    launcher: str
    suite: str = ""
    failures: list = field(default_factory=list)

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append(f"[{self.suite}] rank {self.rank}: {message}")
        return ok

    def same_bytes(self, got, ref, label: str) -> bool:
        msg = bytes_mismatch(got.cpu(), ref.cpu(), label)
        return self.check(msg is None, msg or "")


@contextlib.contextmanager
def count_collectives(before=None):
    """Wrap (not mock) every torch.distributed collective with a counter; the real call still runs, after
    `before(name)` when given."""
    counts = Counter()
    saved = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            counts[CANONICAL.get(__name, __name)] += 1
            if before is not None:
                before(__name)
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def fp32_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
