"""Checking that every rank of a group passed the same structure (parameter lists, shapes, options), before a
collective whose sizes depend on it could abort the job (gloo) or hang it (NCCL).

One all-gather of one 8-byte digest per field; only when digests differ does a second collective gather the
readable values, so that every rank raises the same `RankMismatchError` naming the rank, the field and the first
difference.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .collectives import all_gather_into, dist_backend, rank_and_size


class RankMismatchError(ValueError):
    """The ranks of a group passed different structures to a collective fp4_dist call (raised on every rank)."""


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _device(group) -> torch.device:
    if dist_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_on_every_rank(fields: Dict[str, Any], group, what: str) -> None:
    """Raise `RankMismatchError` on every rank of `group` unless every rank passed equal `fields` (compared by
    ``repr``). A collective: call it on every rank at the same point."""
    rank, size = rank_and_size(group)
    if size == 1:
        return
    names = list(fields)
    mine = torch.tensor([_digest(fields[k]) for k in names], dtype=torch.int64, device=_device(group))
    table = torch.empty(size * len(names), dtype=torch.int64, device=mine.device)
    all_gather_into(table, mine, group)
    rows = table.view(size, len(names)).tolist()  # one read
    differing = [j for j in range(len(names)) if any(row[j] != rows[0][j] for row in rows)]
    if not differing:
        return
    values: List[Any] = [None] * size
    dist.all_gather_object(values, {names[j]: fields[names[j]] for j in differing}, group=group)
    lines = []
    for r in range(1, size):  # the first field a rank differs in explains the rest (fields are in that order)
        j = next((j for j in differing if rows[r][j] != rows[0][j]), None)
        if j is not None:
            diff = _first_difference(values[0][names[j]], values[r][names[j]], r)
            lines.append(f"rank {r} differs from rank 0 in {names[j]}: {diff}")
    raise RankMismatchError(f"{what}: the ranks passed different structures (this is rank {rank}); "
                            + "; ".join(lines[:6]) + ("; ..." if len(lines) > 6 else "")
                            + ". Every rank must pass the same parameters, shapes and options")


def _first_difference(a: Any, b: Any, r: int) -> str:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{len(a)} entries on rank 0, {len(b)} on rank {r}"
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if repr(x) != repr(y))
        return f"entry {i} is {a[i]} on rank 0, {b[i]} on rank {r}"
    return f"{a} on rank 0, {b} on rank {r}"
