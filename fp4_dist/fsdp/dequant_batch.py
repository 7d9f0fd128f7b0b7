"""One dequantize launch per FSDP2 parameter group and all-gather, instead of one per weight.

FSDP2 hands each weight of a parameter group to its own ``fsdp_post_all_gather``, one after the other, in one
loop (``FSDPParamGroup.wait_for_unshard``), before any layer runs. Each call queues its weight here; the call that
completes the group (every NVFP4 weight of the group queued) dequantizes them all with one launch::

    fsdp_post_all_gather(w0)   queue w0's gathered bytes, tile scales, amax and its compute copy
    ...
    fsdp_post_all_gather(wn)   queue wn: the group is complete -> kernels.dequantize([w0..wn]): one launch

Membership comes from FSDP2's own parameter groups once they exist (`bind`); a weight whose group is unknown is
a group of one (dequantized at once). `check_flushed` runs after the root's forward: a queue still holding
weights there means FSDP2 skipped some, and it says so instead of letting layers read unwritten values.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import kernels


class DequantBatch:
    """The NVFP4 weights of one FSDP2 parameter group, queued as their gathers come in."""

    __slots__ = ("size", "datas", "scales", "amaxes", "outs", "queued")

    def __init__(self, size: int = 1):
        self.size = size
        self.datas, self.scales, self.amaxes, self.outs = [], [], [], []
        self.queued: set = set()

    def add(self, key, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, out: torch.Tensor) -> None:
        """Queue one weight's gathered fields and the compute copy they dequantize into; launch when complete."""
        if key in self.queued:  # gathered again before its group completed: what is queued goes now
            self.flush()
        self.queued.add(key)
        self.datas.append(data)
        self.scales.append(scale_inv)
        self.amaxes.append(amax)
        self.outs.append(out)
        if len(self.outs) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.outs:
            return
        # The forward saved these tensors (as the unsharded parameters) for the backward, which gathers the same
        # bytes again: writing them must not look like an in-place change to autograd (FSDP2 does the same).
        with torch.inference_mode(False), torch.autograd._unsafe_preserve_version_counter(tuple(self.outs)):
            kernels.dequantize(self.datas, self.scales, self.amaxes, self.outs)
        self.datas, self.scales, self.amaxes, self.outs = [], [], [], []
        self.queued = set()

    @property
    def pending(self) -> bool:
        return bool(self.outs)


def bind(fsdp_modules: list[nn.Module], states_of) -> list[DequantBatch]:
    """One `DequantBatch` per FSDP2 parameter group of `fsdp_modules`, set on the states of its NVFP4 weights
    (`states_of(param)`: the weight's state, or None for other parameters). Read from FSDP2's groups when its
    version exposes them; otherwise every weight keeps a batch of its own."""
    batches = []
    for module in fsdp_modules:
        for group in _param_groups(module):
            states = [s for s in (states_of(fp.sharded_param) for fp in group.fsdp_params) if s is not None]
            if not states:
                continue
            batch = DequantBatch(len(states))
            for s in states:
                s.batch = batch
            batches.append(batch)
    return batches


def _param_groups(module: nn.Module) -> list:
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups: Optional[list] = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [g for g in groups if g is not None and hasattr(g, "fsdp_params")]


def check_flushed(batches: list[DequantBatch]) -> None:
    """Raise if a group's weights were queued but never dequantized (FSDP2 gathered only part of a group)."""
    for batch in batches:
        if batch.pending:
            queued = len(batch.outs)
            batch.flush()
            raise RuntimeError("fp4_dist.fsdp: FSDP2 post-processed only part of a parameter group's NVFP4 weights "
                               f"({queued} of {batch.size}), so the forward read their compute copies before they "
                               "were written; this version of torch gathers in a way fp4_dist does not know: please "
                               "report it")
