"""Weights that share one amax: what lets an exported checkpoint give vLLM one global scale per fused layer.

vLLM runs q/k/v (and gate/up) projections as one fused GEMM with one global scale. A model trained with one amax
per weight exports one global scale per weight, and vLLM would then decode all but one of a fused group with a
scale that is not theirs. `convert_linear_weights(model, shared_amax=VLLM_FUSED)` groups such siblings: their
tensor amax is the MAX over the group, in every cast of the package (the whole-tensor quantize here, the
TE-signature cast, Zero1Optimizer's and FSDP2's shard casts: `CastCore` takes the MAX after its all-reduce), so
their global encode scale S = 2688 / A is one number. Megatron's fused linear_qkv and linear_fc1 are single
weights, which share one amax already.

A group rides on its weights as the attribute ``fp4_dist_amax_group`` (an `AmaxGroup`), so every cast finds it
on the tensors it is given. A cast that is given only some members of a group raises: it could not know the
others' amaxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

ATTR = "fp4_dist_amax_group"


@dataclass(frozen=True)
class AmaxGroup:
    """Weights (by name) whose scales derive from one amax, the largest of theirs."""

    members: tuple[str, ...]

    def __str__(self) -> str:
        return ", ".join(self.members)


def group_of(w) -> Optional[AmaxGroup]:
    """The `AmaxGroup` of weight `w` (an NVFP4Tensor or a Parameter of one), or None. FSDP2 keeps a weight's group
    in its `WeightState.amax_group`."""
    return getattr(w, ATTR, None)


def member_indices(groups: Sequence[Optional[AmaxGroup]]) -> tuple[tuple[int, ...], ...]:
    """Positions of each group's members in a list of weights whose groups are `groups`.

    Raises ValueError when a group has fewer members in the list than it names (a cast of part of a group).
    """
    found: dict = {}
    for i, g in enumerate(groups):
        if g is not None:
            found.setdefault(g, []).append(i)
    for g, idx in found.items():
        if len(idx) != len(g.members):
            raise ValueError(f"the weights {g} share one amax, but this cast was given {len(idx)} of the "
                             f"{len(g.members)}: cast every member of an amax group in one call (one list of "
                             "weights, one Zero1Optimizer, one fully_shard_nvfp4 model)")
    return tuple(tuple(idx) for idx in found.values() if len(idx) > 1)


def sibling_groups(linear_names: Sequence[str], patterns: Sequence[Sequence[str]]) -> list[AmaxGroup]:
    """Groups of sibling linears: for each parent module and each pattern (leaf names, e.g. q_proj, k_proj,
    v_proj), the members present among `linear_names` (module names), when at least two are."""
    names = set(linear_names)
    parents = sorted({n.rpartition(".")[0] for n in linear_names})
    out = []
    for parent in parents:
        for leaves in patterns:
            members = [f"{parent}.{leaf}" if parent else leaf for leaf in leaves]
            present = tuple(f"{m}.weight" for m in members if m in names)
            if len(present) > 1:
                out.append(AmaxGroup(present))
    return out


def check_patterns(patterns) -> tuple[tuple[str, ...], ...]:
    if isinstance(patterns, str) or not all(isinstance(p, (tuple, list)) and len(p) > 1 and
                                            all(isinstance(x, str) for x in p) for p in patterns):  # fmt: skip
        raise TypeError("shared_amax must be a sequence of tuples of sibling module names, e.g. "
                        "(('q_proj', 'k_proj', 'v_proj'), ('gate_proj', 'up_proj')) (fp4_dist.export.VLLM_FUSED)")
    return tuple(tuple(p) for p in patterns)


def group_amax(values: Sequence[torch.Tensor], round_to: torch.dtype) -> torch.Tensor:
    """The shared amax of whole weights: the largest max|x| of their values rounded to the model dtype."""
    return torch.stack([v.detach().to(round_to).abs().max().to(torch.float32) for v in values]).max().reshape(1)
