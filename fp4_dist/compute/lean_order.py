"""The order lean uses come in, learned as they come, and the batched fills it allows: one dequantize launch that
writes the copy of the use at hand and of the uses that came after it last time, as far as each has a pool buffer
of its own (one launch per layer of a transformer stack; Megatron GPT, 8 layers, 4 microbatches: 57 launches per 256
uses).

The order only saves launches: every use checks its own buffer (`pool.token`), so a wrong guess costs a launch,
never a value.
"""

from __future__ import annotations

from .. import kernels
from ..tensor.copy import bound
from .pool import POOL, copy_token

# A lean use is made in one of two directions: a forward, or a backward writing its copy again.
FWD, BWD = 0, 1
_BATCH = 8  # most fills one launch makes


class Order:
    """The order lean uses come in, learned as they come: each (layer, direction) links to the one that came
    after it last time. A changed link bumps `epoch`, and the batches built along the old links are built again.
    `tail` is where the last use's link goes: its layer's `next` list and the direction (the list, not the layer,
    so that the order keeps no layer alive)."""

    __slots__ = ("tail", "epoch")

    def __init__(self):
        self.tail, self.epoch = None, 0


ORDER = Order()


class Batch:
    """The fills that one launch makes when a use finds its buffer not holding its weight: its own, then those of
    the uses the learned order says come next, as far as each has a buffer of its own (one not written before in
    the batch): the next uses then find their copies made. A use the order got wrong (or whose weight changes
    before it) finds its buffer not holding its values and fills it itself, so the order is never trusted for
    values, only for saving launches."""

    __slots__ = ("epoch", "members", "fills", "launch")

    def __init__(self, head, d: int):
        self.epoch = ORDER.epoch
        members, written, link = [head], {id(head.buffer)}, head.next[d]
        while link is not None and len(members) < _BATCH:
            v = link[0]()
            if (v is None or v.fill is None or id(v.buffer) in written or v.key[1:] != head.key[1:]
                    or v.buffer.retired or not bound(v.fields, v.weight)):  # fmt: skip
                break
            members.append(v)
            written.add(id(v.buffer))
            link = v.next[link[1]]
        self.members = tuple(v.ref for v in members)
        self.fills = tuple(v.fill for v in members)
        if len(members) == 1:
            self.launch = head.fill
        else:
            self.launch = kernels.bind_dequantize([v.fields[0] for v in members], [v.fields[1] for v in members],
                                                  [v.fields[2] for v in members],
                                                  [v.buffer.tensor for v in members])  # fmt: skip

    def still_bound(self) -> bool:
        """Whether the learned order and every member's binding are what the batch was built from."""
        if self.epoch != ORDER.epoch:
            return False
        for ref, fill in zip(self.members, self.fills):
            v = ref()
            if v is None or v.fill is not fill:
                return False
        return True

    def run(self, head_token) -> bool:
        """Fill every member's buffer (one launch) and record what each holds; False, with nothing written, when
        a member's buffer is referenced by something or its weight is between a cast and its gather."""
        views, tokens = [], []
        for ref in self.members[1:]:
            v = ref()
            token = copy_token(v.cc, v.fields, v.weight)
            if token is None or not v.buffer.free():
                return False
            views.append(v)
            tokens.append(token)
        POOL.launched(len(self.members))
        self.launch()
        for v, token in zip(views, tokens):
            v.buffer.mark(v.fields, token)
        head = self.members[0]()
        head.buffer.mark(head.fields, head_token)
        return True
