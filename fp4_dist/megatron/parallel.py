"""Which of Megatron's process groups a weight's NVFP4 scales and masters follow.

- Amax: a tensor-parallel slice is quantized with the whole weight's amax, so every slice equals the same slice of
  quantizing the whole weight (and a checkpoint's bytes do not depend on the TP size). The whole weight spans the
  tensor-parallel group for dense layers and the expert-tensor-parallel group for MoE experts (Megatron marks expert
  parameters ``allreduce=False``).
- Masters: the distributed optimizer that holds a weight shards its fp32 master over that optimizer's own
  data-parallel group (the expert-data-parallel group for experts, which Megatron keeps in buffers and an optimizer
  of their own); pipeline stages each have their own groups.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    """Where a small tensor for a collective over the default group lives (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_expert(param) -> bool:
    """Megatron's mark of an MoE expert parameter (reduced over the expert-data-parallel group, not the DP group)."""
    return not getattr(param, "allreduce", True)


def tensor_parallel_group(param):
    """The group over which `param` is one slice of a whole weight, or None (not sliced, or one rank)."""
    return _group_of_kind(bool(getattr(param, "tensor_model_parallel", False)), is_expert(param))


def _group_of_kind(sliced: bool, expert: bool):
    from megatron.core import parallel_state

    if not sliced or not parallel_state.model_parallel_is_initialized():
        return None
    if expert:
        group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    else:
        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def amax_group(params: Iterable) -> Optional[object]:
    """The one tensor-parallel group of a cast's weights (see `tensor_parallel_group`), or None. Raises ValueError
    when the weights span different groups (dense and expert weights in one cast): one MAX all-reduce serves a
    cast, so its weights must be slices over one group. Called every optimizer step: the groups are looked up once
    per kind of weight, not per weight."""
    kinds = {(bool(getattr(p, "tensor_model_parallel", False)), is_expert(p)) for p in params}
    groups = {id(g): g for g in (_group_of_kind(*kind) for kind in kinds) if g is not None}
    if len(groups) > 1:
        raise ValueError("fp4_dist.megatron: one NVFP4 cast holds tensor-parallel slices over different groups "
                         "(dense and expert weights together); Megatron keeps expert weights in buffers of their "
                         "own, which this cast expects")
    return next(iter(groups.values()), None)


def reduce_whole_amaxes(params, amaxes: torch.Tensor) -> torch.Tensor:
    """MAX-reduce each weight's slice amax (`amaxes[i]` for `params[i]`) over its tensor-parallel group, one
    all-reduce per group: the whole weights' amaxes. A collective over every group involved (call on every rank of
    the model-parallel layout alike)."""
    by_group: dict[int, tuple[object, list[int]]] = {}
    for i, p in enumerate(params):
        g = tensor_parallel_group(p)
        if g is not None:
            by_group.setdefault(id(g), (g, []))[1].append(i)
    for group, members in by_group.values():
        index = torch.tensor(members, device=amaxes.device)
        part = amaxes.index_select(0, index)
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        amaxes.index_copy_(0, index, part)
    return amaxes
