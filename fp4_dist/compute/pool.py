"""The lean pool: model-dtype buffers per (shape, dtype, device) of the lean weights, shared by all of them.

Every weight of a transformer's layer stack takes its turn in the buffers of one layer (`fp4_dist.compute.lean`),
or of `depth` layers (`set_pool_depth`): the weights of one shape take the buffers in turn, in the order of their
first use (the n-th weight of a shape the buffer n mod depth). A stack runs its layers forward and then backward,
microbatch after microbatch, so the last `depth` layers of a forward find their copies still made in the backward
that follows it, and the first `depth` layers of a backward in the next microbatch's forward: each microbatch then
makes 2 (layers - depth) copies of each weight shape instead of 2 (layers - 1), for `depth` layers' buffers.
Sharing is safe because a copy is consumed by the op it was made for before the next one is written, in the order
of the one stream both run on; a buffer that something still references at the next write (a copy kept past its
use, which the layers never do) is left to its holder and replaced by a new one, counted in `pool_stats()` and
warned about once, so no copy is ever overwritten under a reader.

Each buffer records whose values it holds and what proved them current then (`token`: the weight's cast count and
the version counters of its bytes and of itself, as for a kept copy; nothing while a cast's bytes await their
all-gather). A use that finds its values there launches nothing.

Under CUDA graph capture (Megatron's ``--cuda-graph-impl local`` / ``full_iteration``) that decision would be taken
once, at capture, and replayed for every later step and microbatch: a use being captured always writes its copy
(`lean.LeanView.value`), and the buffer it writes never again proves what it holds (`Buffer.graphed`), since a
replay writes it without the host knowing. The values are the same either way (a copy is a pure function of the
weight's bytes); a graphed buffer only costs the launches that finding a copy made would save.
"""

from __future__ import annotations

from typing import Optional

import warnings
import weakref

import torch

from .._user import user_stacklevel
from ..compare import differs
from ..tensor.copy import version_key


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def use_count(t: torch.Tensor) -> int:
    """References to `t`'s storage (tensors and views on it), plus the one the query itself takes; 0 where this
    torch does not say (the pool then cannot see holders and trusts that layers consume their copies, as they do)."""
    if _STORAGE_USE_COUNT is None:
        return 0
    return _STORAGE_USE_COUNT(t.untyped_storage()._cdata)


class Buffer:
    """One pool buffer, how many references to its storage the pool and the layers' aliases account for, and
    whose values it holds: the bound fields of the layer that wrote it last and `token` of their weight then
    (None: nothing proves what it holds)."""

    __slots__ = ("tensor", "expected", "fields", "token", "version", "retired", "graphed", "__weakref__")

    def __init__(self, shape, dtype, device):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.expected = use_count(self.tensor)
        self.retired = False  # the pool let go of it (replaced or released): layers bound to it bind again
        self.graphed = False  # a captured CUDA graph writes it (`graphed_fill`): what it holds is never known
        self.mark(None, None)

    def mark(self, fields, token) -> None:
        """The buffer was just written with the values of `fields` as `token` says they are (None: unknown). A
        buffer a CUDA graph writes records nothing: a replay writes it without telling the host."""
        if self.graphed:
            fields = token = None
        self.fields, self.token, self.version = fields, token, self.tensor._version

    def free(self) -> bool:
        """Whether nothing but the pool and the layers' aliases references the buffer: the next copy may go in."""
        return use_count(self.tensor) == self.expected

    def adopt(self, alias: torch.Tensor, before: int) -> None:
        """`alias` (made from this buffer after `before` was counted) is a layer's: account for it while it lives."""
        held = use_count(self.tensor) - before
        self.expected += held
        ref = weakref.ref(self)
        weakref.finalize(alias, _release, ref, held)


def _release(ref, held: int) -> None:
    buf = ref()
    if buf is not None:
        buf.expected -= held


class _Pool:
    __slots__ = ("buffers", "depth", "ordinals", "replaced", "warned", "uses", "launches", "copies")

    def __init__(self):
        self.buffers: dict = {}  # (key, slot) -> Buffer
        self.depth = 1  # buffers per key: the layers whose copies the pool holds at once
        self.ordinals: dict = {}  # key -> weights of that key given an ordinal so far (`ordinal`)
        self.replaced = 0
        self.warned = False
        self.uses = self.launches = self.copies = 0  # lean uses seen, dequantize launches, weights' copies made

    def launched(self, copies: int = 1) -> None:
        """Count one dequantize launch writing `copies` weights' copies."""
        self.launches += 1
        self.copies += copies

    def ordinal(self, key) -> int:
        """The next weight of `key`'s place among the weights of its key, in the order of their first use."""
        n = self.ordinals.get(key, 0)
        self.ordinals[key] = n + 1
        return n

    def take(self, key, ordinal: int = 0) -> Buffer:
        """The buffer for `key` = (shape, dtype, device) of the weight with that ordinal (buffer ordinal mod
        depth), new when there is none or the current one is held."""
        slot = (key, ordinal % self.depth)
        buf = self.buffers.get(slot)
        if buf is not None and buf.free():
            return buf
        if buf is not None:
            buf.retired = True
            self._replaced(key)
        buf = self.buffers[slot] = Buffer(*key)
        return buf

    def _replaced(self, key) -> None:
        self.replaced += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"fp4_dist.compute.lean: a lean copy of an NVFP4 weight of shape {list(key[0])} was still referenced "
                "when the next weight of that shape needed the pool buffer; the holder keeps it and the pool takes a "
                "new buffer (correct, but memory the lean mode is meant to save). Something keeps the tensor a layer "
                "computed with past its use", stacklevel=user_stacklevel())  # fmt: skip


POOL = _Pool()


class _Audit:
    """While on (`audit_uses`), each lean use outside a CUDA graph capture compares what its GEMM is about to read
    (the pool buffer, once written or found holding the copy) with a fresh dequantization of the weight's bytes, on
    the weight's device; `audit_verdicts` reads every verdict at once. The Megatron launcher turns it on for the
    steps that its parity check follows (``--check-every``), so a misplaced or stale lean copy fails the check. A use
    inside a captured graph is not audited: it writes its copy unconditionally (`Buffer.graphed`)."""

    __slots__ = ("on", "flags")

    def __init__(self):
        self.on, self.flags = False, []

    def note(self, value: torch.Tensor, w) -> None:
        self.flags.append((w, differs(value, w.dequantize(value.dtype).view(value.shape))))


AUDIT = _Audit()


def audit_uses(on: bool = True) -> None:
    """Start (or stop) auditing lean uses (`_Audit`); starting drops the verdicts not read yet."""
    AUDIT.on = bool(on)
    if on:
        AUDIT.flags = []


def audit_verdicts() -> tuple[int, list]:
    """(uses audited, the weights of the uses that read other values than their bytes') since `audit_uses`; one
    host read for all of them. Stops the audit."""
    flags, AUDIT.flags, AUDIT.on = AUDIT.flags, [], False
    if not flags:
        return 0, []
    bad = torch.stack([f.to(flags[0][1].device) for _, f in flags]).tolist()
    return len(flags), [w for (w, _), b in zip(flags, bad) if b]


def pool_bytes() -> int:
    """Bytes the lean pool's buffers hold (one buffer per distinct shape, dtype and device of the lean weights)."""
    return sum(b.tensor.numel() * b.tensor.element_size() for b in POOL.buffers.values())


def held_copies() -> int:
    """Pool buffers that something besides the pool and the layers' aliases references right now (0 between
    uses: nothing keeps a lean copy)."""
    return sum(not b.free() for b in POOL.buffers.values())


def pool_stats() -> dict:
    """{"buffers", "bytes", "depth", "replaced", "uses", "launches", "copies"}: the pool's size and depth, how often a
    held buffer had to be replaced, and how many lean uses (forward and backward) made how many dequantize launches
    writing how many weights' copies (fewer copies than uses: copies found made already; fewer launches than
    copies: a launch fills the buffers of the uses expected next too)."""
    return {"buffers": len(POOL.buffers), "bytes": pool_bytes(), "depth": POOL.depth, "replaced": POOL.replaced,
            "uses": POOL.uses, "launches": POOL.launches, "copies": POOL.copies}  # fmt: skip


def release_pool() -> None:
    """Let go of the pool's buffers (they are freed once the layers' aliases of them are dropped at their next
    use); the next lean use allocates again."""
    for buf in POOL.buffers.values():
        buf.retired = True
    POOL.buffers.clear()


def pool_depth() -> int:
    """How many layers' copies the lean pool holds at once (`set_pool_depth`)."""
    return POOL.depth


def set_pool_depth(layers: int) -> None:
    """Hold the lean copies of `layers` layers at once (default 1): `layers` buffers per weight shape, which the
    weights of that shape take in turn. Fewer copies are made with several microbatches per step (the module
    docstring) for `layers` times the memory of one layer's copies; the values, and so the training, are the same
    at every depth. The layers take the new buffers at their next use."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"set_pool_depth: the number of layers whose lean copies the pool holds is a positive "
                         f"integer, got {layers!r}")
    if layers != POOL.depth:
        release_pool()
        POOL.depth = layers


def copy_token(cc, fields: tuple, w) -> Optional[tuple]:
    """What proves that a copy made from `fields` (a weight's rowwise fields, as a layer holds them) holds weight
    `w`'s current values: its cast count (`ComputeCopy.casts`: bytes an all-gather writes bump no version counter
    of this rank's) and its freshness key (`copy.version_key`); None between a cast and its all-gather's processing
    (or for an inference tensor), when nothing proves a copy current."""
    if cc.pending:
        return None
    try:
        return (cc.casts,) + version_key(fields, None, w)
    except RuntimeError:  # an inference tensor has no version counter
        return None
