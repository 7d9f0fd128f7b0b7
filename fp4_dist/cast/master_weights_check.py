"""The check, on every call of the TE-signature cast, that the ranks of the group passed the same weights and
shards that make up each weight exactly once, before the amax all-reduce (whose size depends on the weights:
a mismatch there aborts gloo and hangs NCCL).

One MAX all-reduce of a small header whose size depends only on the group size, then one read::

    [ n, -n | d, -d | rejected: one flag per rank | coverage: (A_r, B_r, C_r) in rank r's slots ]

``n`` is the number of weights and ``d`` a digest of every weight's shape, dtype and numerics (which fix the
amax buffer's length): after the MAX, ``x == -(-x)_max`` holds only if every rank has the same ``x``. A rank whose own
arguments are invalid sets its flag instead, so every rank raises (none hangs). ``A_r, B_r, C_r`` are the 0th,
1st and 2nd moments of the elements rank r's shards cover, summed over the weights with per-weight coefficients
modulo a prime below 2**24 (exact in fp32). Shards that cover every weight exactly once sum to the moments of
the whole weights; overlapping or missing shards, two ranks claiming one range, and a group that does not hold
every rank whose shards make up the weights (per-rank groups of one, say) do not.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from .agreement import RankMismatchError
from .collectives import CommStats, all_reduce_max_, rank_and_size

PRIME = 16_777_213
"""The largest prime below 2**24: every residue is an exact fp32 integer."""
FIXED = 4


def _digest24(value) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") % PRIME


def _squares_below(n: int) -> int:
    """0**2 + 1**2 + ... + (n - 1)**2."""
    return (n - 1) * n * (2 * n - 1) // 6


def header_numel(size: int) -> int:
    return FIXED + 4 * size


class CallAgreement:
    """This rank's header for one bound call (`shapes` with their dtypes and numerics, its shards), and the check.

    Args:
        shapes, dtypes, numerics: per weight, as every rank must pass them.
        shared: the plan's amax groups (`CastPlan.shared`), which every rank must apply alike.
        shards, starts: per weight this rank's flat master piece (None: none) and its first element.
        rank, size: this rank and the size of the group the call runs on.
    """

    def __init__(self, shapes: Sequence[tuple], dtypes, numerics, shards, starts, rank: int, size: int,
                 shared: tuple = ()):  # fmt: skip
        self.size = size
        numels = [m * k for m, k in shapes]
        coef = [[_digest24(("coverage", j, w)) for w in range(len(numels))] for j in range(3)]
        mine = [0, 0, 0]
        for w, (shard, start) in enumerate(zip(shards, starts)):
            if shard is None:
                continue
            s, e = int(start), int(start) + shard.numel()
            moments = (e - s, (s + e - 1) * (e - s) // 2, _squares_below(e) - _squares_below(s))
            mine = [(acc + c[w] * m) % PRIME for acc, c, m in zip(mine, coef, moments)]
        whole_moments = (numels, [n * (n - 1) // 2 for n in numels], [_squares_below(n) for n in numels])
        self.whole = [sum(c[w] * m for w, m in enumerate(ms)) % PRIME for c, ms in zip(coef, whole_moments)]
        d = _digest24([(tuple(s), str(t), num) for s, t, num in zip(shapes, dtypes, numerics)] + list(shared))
        header = [0.0] * header_numel(size)
        for slot, x in enumerate((len(shapes) % PRIME, d)):
            header[2 * slot], header[2 * slot + 1] = x, -x
        header[FIXED + size + 3 * rank:FIXED + size + 3 * rank + 3] = mine
        self.header = torch.tensor(header, dtype=torch.float32)
        self.n = len(shapes)

    def check(self, group, stats: Optional[CommStats], device) -> None:
        """The header all-reduce and its read; raises on every rank when the ranks disagree."""
        if self.size == 1:  # nothing to exchange (`BoundCast.run` checked the group's size): check on the host
            raise_if_disagree(self.header.tolist(), self.size, self.whole, self.n)
            return
        buf = self.header.to(device, copy=True)  # the all-reduce writes into it: never into the kept header
        all_reduce_max_(buf, group, stats)
        raise_if_disagree(buf.tolist(), self.size, self.whole, self.n)


def reject(group, stats: Optional[CommStats], device) -> None:
    """This rank's own arguments are invalid: join the header all-reduce with its flag set, so that every other
    rank raises naming it (this rank raises its own error after)."""
    rank, size = rank_and_size(group)
    buf = torch.zeros(header_numel(size), dtype=torch.float32, device=device)
    buf[FIXED + rank] = 1.0
    all_reduce_max_(buf, group, stats)


def raise_if_disagree(values: list, size: int, whole: list, n: int) -> None:
    rejected = [r for r in range(size) if values[FIXED + r]]
    if rejected:
        raise RuntimeError(f"rank(s) {rejected} rejected their master shards (see the error on those ranks); no "
                           "weight, scale or amax was written on any rank")
    what = "cast_master_weights_to_nvfp4"
    if values[0] != -values[1]:
        raise RankMismatchError(
            f"{what}: the ranks passed different numbers of weights (this rank passed {n}, some rank up to "
            f"{int(values[0])}); every rank must pass the same list of weights. No byte was written")
    if values[2] != -values[3]:
        raise RankMismatchError(
            f"{what}: the ranks passed different weights (shapes, dtypes or numerics differ between ranks); every "
            "rank must pass the same list of weights. No byte was written")
    cover = values[FIXED + size:]
    sums = [int(sum(cover[3 * r + j] for r in range(size))) % PRIME for j in range(3)]
    if sums != whole:
        raise RankMismatchError(
            f"{what}: the ranks' master shards do not cover each weight exactly once (shards overlap or leave a "
            "gap, or the process group does not hold every rank whose shards make up the weights: this group has "
            f"{size} rank(s)). Pass each rank's own [start, start + numel) of a partition of every weight, and the "
            "data-parallel group over all of them. No byte was written")
