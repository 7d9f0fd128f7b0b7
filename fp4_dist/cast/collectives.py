"""The collectives of the cast and of the trainers built on it (ZeRO, FSDP2, the export): all-reduce, all-gather
and reduce-scatter, counted by `CommStats`. (The structure checks of `agreement.py` and `master_weights_check.py`,
and Zero1Optimizer's checkpoints through torch.distributed.checkpoint, make their own calls.)

Every function takes the process group as an argument (None = the default group) and works
without an initialised process group when the group has one rank: a single process runs the
same code path with the collectives reduced to local copies.

`CommStats` (optional everywhere) counts the collectives issued and the bytes they carry, so
tools can print "bytes all-gathered" without wrapping torch.distributed themselves.
"""

from __future__ import annotations

import os

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist


__all__ = ["CommStats", "in_distributed_job", "rank_and_size", "dist_backend", "all_reduce_max_", "all_reduce_sum_",
           "reduce_scatter_sum", "reduce_scatter_ordered", "all_gather_inplace", "all_gather_into"]


@dataclass
class CommStats:
    """Collectives issued through this module: ``calls[name]`` and payload ``bytes[name]``.

    Bytes are the full buffer a collective produces (all-gather output, all-reduce buffer,
    reduce-scatter input), i.e. the size of the logical message, not the wire traffic.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, name: str, nbytes: int) -> None:
        self.calls[name] += 1
        self.bytes[name] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def in_distributed_job() -> bool:
    """Whether torch.distributed is initialised (a job of processes; otherwise a single process)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_size(group=None) -> Tuple[int, int]:
    """(rank in ``group``, size of ``group``); (0, 1) when torch.distributed is not initialised in a process that
    runs alone. Raises ValueError for a process a launcher started as one of several ranks (``WORLD_SIZE`` > 1)
    without a process group: alone, each rank would train (and write checkpoints) on its own."""
    if not in_distributed_job():
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised; "
                             "call fp4_dist.launch.init_distributed() (or dist.init_process_group) first")
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1:
            raise ValueError(f"this process is rank {os.environ.get('RANK', '?')} of {launched} (WORLD_SIZE, set by "
                             "the launcher) but torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group() (or fp4_dist.launch.init_distributed()) first; "
                             "without it every rank would train and write on its own")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group it "
                         "passed; pass the data-parallel group this rank belongs to")
    return rank, dist.get_world_size(group)


def dist_backend(group=None) -> Optional[str]:
    """The backend name of ``group`` ("gloo", "nccl", ...), or None without torch.distributed."""
    if not in_distributed_job():
        return None
    return dist.get_backend(group)


# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter; older releases only have the old names.
# Looked up at call time, so a profiler or test that wraps torch.distributed sees every call.
def _all_gather_single(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out, inp, op, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _all_reduce_(buf: torch.Tensor, op, group, stats: Optional[CommStats]) -> None:
    _, size = rank_and_size(group)
    if size == 1:
        return
    if stats is not None:
        stats.record("all_reduce", _nbytes(buf))
    dist.all_reduce(buf, op=op, group=group)


def all_reduce_max_(buf: torch.Tensor, group=None, stats: Optional[CommStats] = None) -> None:
    """In-place elementwise MAX of ``buf`` over the ranks of ``group`` (any float dtype)."""
    _all_reduce_(buf, dist.ReduceOp.MAX, group, stats)


def all_reduce_sum_(buf: torch.Tensor, group=None, stats: Optional[CommStats] = None) -> None:
    """In-place elementwise SUM of ``buf`` over the ranks of ``group`` (logging, metrics)."""
    _all_reduce_(buf, dist.ReduceOp.SUM, group, stats)


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group=None,
                       stats: Optional[CommStats] = None) -> None:
    """``out`` (numel N) <- sum over ranks of ``inp[rank*N:(rank+1)*N]``; summation order is the backend's."""
    def backend_sum(size: int) -> None:
        _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)

    _reduce_scatter(out, inp, group, stats, "reduce_scatter", backend_sum)


def reduce_scatter_ordered(out: torch.Tensor, inp: torch.Tensor, group=None,
                           stats: Optional[CommStats] = None) -> None:
    """Like `reduce_scatter_sum`, but summed in rank order ``((x0 + x1) + x2) + ...`` on every rank.

    One all-to-all moves the same bytes a ring reduce-scatter does; the local sum then has a fixed
    association, so the result equals a single process accumulating the ranks' gradients in rank
    order (gradient accumulation), bit for bit, for every world size.
    """
    def rank_order_sum(size: int) -> None:
        recv = torch.empty_like(inp)
        dist.all_to_all_single(recv, inp, group=group)
        parts = recv.view(size, -1)
        out.copy_(parts[0])
        for r in range(1, size):
            out.add_(parts[r])

    _reduce_scatter(out, inp, group, stats, "all_to_all", rank_order_sum)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, stats: Optional[CommStats], name: str,
                    reduce: Callable[[int], None]) -> None:
    """Shared frame of the two reduce-scatters: check sizes, copy on one rank, else record and ``reduce(size)``."""
    _, size = rank_and_size(group)
    if inp.numel() != out.numel() * size or inp.dtype != out.dtype:
        raise ValueError(f"reduce-scatter of {inp.numel()} {inp.dtype} into {out.numel()} {out.dtype} "
                         f"over {size} ranks: input must be size x output, same dtype")
    if size == 1:
        out.copy_(inp)
        return
    if stats is not None:
        stats.record(name, _nbytes(inp))
    reduce(size)


def all_gather_inplace(buf: torch.Tensor, group=None, stats: Optional[CommStats] = None) -> None:
    """Every rank's slice ``buf[rank*N:(rank+1)*N]`` is sent to all ranks, in place (N = numel / size)."""
    rank, size = rank_and_size(group)
    if size == 1:
        return
    if buf.numel() % size:
        raise ValueError(f"all-gather buffer of {buf.numel()} elements is not divisible by {size} ranks")
    n = buf.numel() // size
    if stats is not None:
        stats.record("all_gather", _nbytes(buf))
    _all_gather_single(buf, buf[rank * n:(rank + 1) * n], group=group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, stats: Optional[CommStats] = None) -> None:
    """``out`` (numel size x N) <- every rank's ``inp`` (numel N) in rank order."""
    _, size = rank_and_size(group)
    if out.numel() != inp.numel() * size or out.dtype != inp.dtype:
        raise ValueError(f"all-gather of {inp.numel()} {inp.dtype} into {out.numel()} {out.dtype} over {size} "
                         "ranks: output must be size x input, same dtype")
    if size == 1:
        out.copy_(inp)
        return
    if stats is not None:
        stats.record("all_gather", _nbytes(out))
    _all_gather_single(out, inp, group=group)

