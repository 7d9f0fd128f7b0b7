"""The ZeRO cast with a small amax exchange: only tiles cut by a rank boundary cross ranks.

TransformerEngine (and `cast_master_weights_to_nvfp4`, which keeps its semantics) all-reduce every tile amax
of every weight, M*K/256 floats per weight, so that every rank can compute every scale before the gather.
But a tile's amax is already complete on a rank that owns the whole tile; only the tiles cut by a rank
boundary need a cross-rank MAX (`fp4_dist.buffers.tile_owners`). So one step of `ShardedCast` is::

    partial_amax                  local tensor + tile amaxes (every weight, one launch per dtype group)
    index_select                  [tensor amaxes | cut-tile amaxes]        (a few KB for a GPT)
    ONE MAX all-reduce of that, then one scalar read: all finite?         (raise on every rank if not)
    index_copy_                   reduced values back into the local amax buffer
    owner_scales                  encode multipliers of the touched tiles; scale bytes of the tiles this rank
                                  owns (first element owned), packed; every weight's amax
    partial_cast                  owned nibbles into the packed param buffer
    --- caller: byte all-gather per bucket, and `gather_scales` (compact scale bytes, 1 B per tile) ---
    expand_scales                 every rowwise_scale_inv from the gathered bytes, then the columnwise copies

The bytes equal those of the full exchange (same formulas on the same complete amaxes). The compact scale
bytes cannot share the in-place byte all-gather of a bucket: each rank's gathered chunk must be contiguous,
and a weight's packed bytes must stay contiguous across the rank boundary, so a per-rank scale region inside
the chunk would split every weight that a boundary cuts (and make the step copy all data after the gather).
They travel in one extra all-gather per step of ``dp * cap`` bytes instead (`gather_scales`).

Everything is bound once (the `bind_*` stages of `fp4_dist.kernels`): a step is ~10 launches whatever the number
of weights.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import kernels
from ..buffers import ShardBuffer
from ..buffers.layout import BufferLayout
from ..buffers.tile_owners import TileExchange, tile_exchange
from ..tensor.copy import BoundRefresh, mark_pending
from ..tensor import NVFP4Tensor
from ..tensor.copy import weight_name
from .core import CastCore, CastPlan, plan_for, shard_bytes
from .collectives import CommStats, all_gather_inplace
from .post_gather import bind_columnwise, drop_columnwise


class ShardedCast:
    """The cast of NVFP4 weights stored in a packed `ShardBuffer`, with the cut-tile amax exchange.

    Args:
        weights: the NVFP4 weights of ``layout``, in layout order; each rank's shard bytes are written into
            their ``rowwise_data`` (in Zero1Optimizer: views of the packed all-gather buffer).
        layout: the `BufferLayout` of the weights (identical on every rank).
        rank: this rank's index in the data-parallel group.
        masters, starts: per weight this rank's flat fp32 master piece (None where it owns nothing) and its first
            element (`ShardBuffer.master_pieces()` / `start_offsets()`; `from_buffer` passes them).
        columnwise: also build the columnwise copies in `after_gather` (weights with an odd M stay rowwise-only).
        positions: how errors number the weights (default 0..n-1; a `subset` keeps the full list's numbers).
    Built once; bound to these tensors (do not replace a weight's buffers afterwards).
    """

    def __init__(self, weights: Sequence[NVFP4Tensor], layout: BufferLayout, rank: int,
                 masters: Sequence[Optional[torch.Tensor]], starts: Sequence[Optional[int]], *,
                 columnwise: bool = True, positions: Optional[Sequence[int]] = None):  # fmt: skip
        self._positions = list(range(len(weights)) if positions is None else positions)
        self._bind_all(weights, layout, rank, masters, starts, columnwise)

    def _bind_all(self, weights, layout, rank, masters, starts, columnwise) -> None:
        self._args = (weights, layout, rank, masters, starts, columnwise)  # to bind again (`_rebind_if_changed`)
        self.weights = list(weights)
        self._numerics = [w.numerics for w in self.weights]
        self.plan: CastPlan = plan_for(self.weights)
        shapes = [tuple(int(s) for s in w.shape) for w in self.weights]
        order = [i for g in self.plan.groups for i in g.indices]
        self.exchange: TileExchange = tile_exchange(layout, shapes, order)
        dev = self.weights[0].rowwise_data.device
        self.gathered = torch.zeros(layout.dp_size * self.exchange.cap, dtype=torch.uint8, device=dev)
        self._rank, self._compact_off = rank, 0
        starts = [s or 0 for s in starts]
        names = [weight_name(w, i, listed_as="model_weights") + " master" for i, w in zip(self._positions, weights)]
        self.core = CastCore(self.plan, masters, starts,
                             [shard_bytes(w.rowwise_data, m, s) for w, m, s in zip(self.weights, masters, starts)],
                             self._bind_scales, names=names, exchanged=self._exchanged_entries(), device=dev)  # fmt: skip
        self._expand = kernels.bind_expand_scales(self.gathered, shapes, self.exchange.sources,
                                                  [w.rowwise_scale_inv for w in self.weights])
        self._columnwise = bind_columnwise(self.weights) if columnwise else []
        self._refresh = BoundRefresh(self.weights)

    @classmethod
    def from_buffer(cls, weights: Sequence[NVFP4Tensor], buf: ShardBuffer, *, columnwise: bool = True):
        """The cast of the weights stored in ``buf`` (a packed `ShardBuffer`), as Zero1Optimizer builds it."""
        return cls(weights, buf.layout, buf.rank, buf.master_pieces(), buf.start_offsets(), columnwise=columnwise)

    def subset(self, indices: Sequence[int]) -> "ShardedCast":
        """The cast of some of these weights only (`indices` into `weights`, each shared-amax group whole): the others
        keep their bytes, scales and compute copies. Built anew: cache it."""
        weights, layout, rank, masters, starts, columnwise = self._args
        pick = lambda xs: [xs[i] for i in indices]  # noqa: E731
        return ShardedCast(pick(weights), layout.select(indices), rank, pick(masters), pick(starts),
                           columnwise=columnwise, positions=pick(self._positions))  # fmt: skip

    # ----------------------------------------------------------------------------------------- binding
    def _exchanged_entries(self) -> List[int]:
        """Positions in the amax buffer of every tensor amax and every cut tile."""
        cut = [g.tile_entries(j, self.exchange.cut[i]) for g in self.plan.groups for j, i in enumerate(g.indices)]
        return self.plan.tensor_amax_entries() + [e for entries in cut for e in entries]

    def _bind_scales(self, g, block, enc):
        """owner_scales of group g: its compact scale bytes follow the previous group's in this rank's chunk."""
        cap, rank = self.exchange.cap, self._rank
        compact = self.gathered[rank * cap:(rank + 1) * cap]
        own = [self.exchange.scale[rank][i] for i in g.indices]
        touched = [self.exchange.enc[rank][i] for i in g.indices]
        run = kernels.bind_owner_scales(block, g.shapes, touched, own, compact[self._compact_off:], enc,
                                        [self.weights[i].amax for i in g.indices], numerics=g.numerics)  # fmt: skip
        self._compact_off += sum(b - a for a, b in own)
        return run

    # ------------------------------------------------------------------------------------------- a step
    def cast(self, group=None, stats: Optional[CommStats] = None, *, defer_check: bool = False):
        """Amaxes, the one small all-reduce, the check, scales and the partial cast of this rank's shards.

        Raises ValueError (on every rank, before any weight byte is written) if a master value is not finite.
        With `defer_check` nothing is read: the verdict comes back as a device bool (True: all finite) and the
        bytes are written regardless; the caller reads it later and calls `core.raise_for` when it is false.
        """
        self._rebind_if_changed()
        self.local_amaxes()
        verdict = self.core.exchange(group, stats, defer_check=defer_check)
        mark_pending(self.weights)
        self.owner_scales()
        self.cast_shards()
        return verdict

    def _rebind_if_changed(self) -> None:
        """A weight's numerics is settable and the scale launches were bound with the old one: bind again."""
        if [w.numerics for w in self.weights] != self._numerics:
            self._bind_all(*self._args)

    # The stages of `cast`, in order (public so that benchmarks can time each one).
    def local_amaxes(self) -> None:
        """partial_amax of every weight into the local amax buffer (one launch per dtype group)."""
        self.core.local_amaxes()

    def exchange_amaxes(self, group=None, stats: Optional[CommStats] = None) -> None:
        """MAX all-reduce of [tensor amaxes | cut-tile amaxes], the reduced values back, the finiteness check."""
        self.core.exchange(group, stats)

    def owner_scales(self) -> None:
        """Encode multipliers of the touched tiles, compact scale bytes of the owned tiles, every amax."""
        self.core.scales()

    def cast_shards(self) -> None:
        """partial_cast of this rank's shards into the packed bytes."""
        self.core.cast()

    def gather_scales(self, group=None, stats: Optional[CommStats] = None) -> None:
        """All-gather of every rank's compact scale bytes (``dp * cap`` bytes)."""
        all_gather_inplace(self.gathered, group, stats)

    def after_gather(self) -> None:
        """Every weight's rowwise_scale_inv from the gathered bytes, the columnwise copies (if bound), and the
        compute copies (one dequantize launch)."""
        self.expand_scales()
        self.columnwise()
        self.refresh_compute_copies()

    def refresh_compute_copies(self) -> None:
        self._refresh()

    def expand_scales(self) -> None:
        self._expand()

    def columnwise(self) -> None:
        """Nibble and scale transposes of the weights with an even M; built without columnwise, drop any
        columnwise copy instead (a `make_columnwise()` since the last step would be stale now)."""
        for run in self._columnwise:
            run()
        if not self._columnwise:
            drop_columnwise(self.weights)

    # ------------------------------------------------------------------------------------------ reporting
    def message_bytes(self) -> int:
        """Bytes of the step's amax all-reduce (tensor amaxes + cut-tile amaxes, fp32)."""
        return self.core.message_bytes()
