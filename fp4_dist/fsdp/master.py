"""NVFP4Master: an fp32 master weight that PyTorch FSDP2 shards like any parameter and all-gathers as NVFP4.

The parameter FSDP2 shards (and the optimizer steps) is the weight's fp32 master, wrapped in this tensor subclass.
Every op computes on the wrapped values (`_data`); the ops FSDP2 uses to shard, move and load a parameter (split,
slice, view, as_strided, new_zeros, empty_like, copy_, clone, detach, _to_copy, pin_memory) keep the wrapper,
so the shard FSDP2 keeps is still an NVFP4Master. Its all-gather goes through FSDP2's tensor-subclass extension::

    fsdp_pre_all_gather   this rank's rows as packed E2M1 bytes + its tile scale bytes (`wire`: the format),
                          cast from the fp32 master with the weight's global amax (`precompute.ShardCast`: one
                          batched amax all-reduce for the whole model, before the forward)
    (FSDP2 all-gathers those bytes: 0.504 B per element instead of 2)
    fsdp_post_all_gather  a dequantize of the gathered bytes and tile scales into the bf16 compute copy, which is
                          the unsharded parameter the forward and backward read (a plain tensor: no per-op overhead);
                          one launch for each FSDP2 parameter group's weights (`dequant_batch`). A compute mode
                          with an unsharded weight of its own (its row's ``fsdp_unsharded``) makes that instead, per
                          weight: the FP8 block copy of the gathered bytes (`fp4_dist.compute.fp8_param.Fp8Param`),
                          or an NVFP4Tensor on the gathered bytes themselves (`fp4_dist.compute.nvfp4`)

Weights whose rows do not split into whole 16-row tile bands per rank ("bf16" mode) gather their bf16 values
instead and are quantized after the gather (every rank quantizes the same full weight, so the bytes are those
of `quantize(full master)` too).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from .. import kernels
from ..compute.modes import DEFAULT, MODES
from ..format import DEFAULT_NUMERICS, is_tile_grid, rowwise_data_shape, rowwise_scale_shape, tile_grid
from ..tensor import NVFP4Tensor
from . import wire
from .dequant_batch import DequantBatch

aten = torch.ops.aten

GATHER_MODES = ("nvfp4", "bf16")


@dataclass(eq=False)
class WeightState:
    """What all views of one master weight share: its identity, how it is gathered, and this step's bytes."""

    fqn: str
    shape: tuple[int, int]
    """[M, K] of the whole weight."""
    mode: str
    """"nvfp4": packed bytes + tile scales are gathered; "bf16": bf16 values are gathered, quantized after."""
    model_dtype: torch.dtype
    """Dtype the masters are rounded to before quantization and that the forward computes in."""
    numerics: str = DEFAULT_NUMERICS
    amax_group: Any = None
    """The `fp4_dist.shared_amax.AmaxGroup` whose one amax this weight's scales use, or None."""
    # --- filled by precompute.ShardCast before each gather ("nvfp4" mode)
    packed: Optional[torch.Tensor] = None
    """uint8 [rows, K/2]: this rank's rows, cast with the global amax."""
    scales: Optional[torch.Tensor] = None
    """uint8 [rows/16, tiles_k]: this rank's tile scale bytes."""
    amax: Optional[torch.Tensor] = None
    """fp32 [1]: the whole weight's amax (identical on every rank)."""
    writes: int = 0
    """In-place ops on the master through this subclass (an optimizer step): they run below autograd, so the
    version counter of the wrapped tensor does not see them."""
    cast_from: Any = None
    """(data_ptr, _version, writes) of the master the bytes were cast from: a mismatch means they are stale."""
    # --- filled by fsdp_post_all_gather, valid while the weight is unsharded
    value: Optional[torch.Tensor] = None
    gathered_fields: Optional[tuple] = None
    """(rowwise_data, scales, amax) of the last gather: scales as gathered, the tile grid, for "nvfp4" mode;
    the row-expanded rowwise_scale_inv for "bf16" mode (`gathered()` wraps them)."""
    buffers: dict = field(default_factory=dict)
    grid: tuple[int, int] = (0, 0)
    """The weight's tile grid (`format.tile_grid`): the shape of its gathered tile scales."""
    world: tuple = (None, 1)
    """(mesh, its size) of the last gather: FSDP2 passes the same mesh every time, and asking it costs."""
    batch: DequantBatch = field(default_factory=DequantBatch)
    """The dequantize launch this weight's gathers join (`dequant_batch`: one per FSDP2 parameter group)."""
    compute: str = DEFAULT
    """What the GEMMs read of the unsharded weight (a name in `compute.modes.MODES`): the dequantized values
    (`value`), or what the mode's ``fsdp_unsharded`` makes (`held`)."""
    held: Any = None
    """What a mode with an unsharded weight of its own holds of it (the FP8 block copy, the NVFP4Tensor on the
    gathered bytes), valid while unsharded."""

    def __post_init__(self):
        self.grid = tile_grid(*self.shape)

    def gathered(self) -> Optional[NVFP4Tensor]:
        """The last gathered weight as an NVFP4Tensor (its bytes are FSDP2's: valid while unsharded)."""
        if self.gathered_fields is None:
            return None
        data, scale_inv, amax = self.gathered_fields
        if is_tile_grid(scale_inv.shape, *self.shape):  # as gathered: expanded here, for the tensor layout
            grid, scale_inv = scale_inv, torch.empty(rowwise_scale_shape(*self.shape), dtype=torch.uint8,
                                                     device=scale_inv.device)  # fmt: skip
            kernels.expand_scales(grid.reshape(-1), [self.shape], [[(0, 0)]], [scale_inv])
        return NVFP4Tensor(self.shape, self.model_dtype, data, scale_inv, amax.reshape(1), numerics=self.numerics,
                           compute_copy=False)  # fmt: skip

    def cast_is_current(self, master: torch.Tensor) -> bool:
        return self.cast_from == self.source_id(master)

    def source_id(self, master: torch.Tensor) -> tuple:
        """What changes when the master's values may have: writes through the subclass, and writes into the
        wrapped tensor itself (a checkpoint loaded into the state dict's plain view of it)."""
        return (master.data_ptr(), master._version, self.writes)


class NVFP4Master(torch.Tensor):
    """fp32 master values of an NVFP4 weight (or of its FSDP2 shard); see the module docstring."""

    _data: torch.Tensor
    _state: WeightState

    @staticmethod
    def __new__(cls, data: torch.Tensor, state: WeightState, requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=requires_grad,
        )  # fmt: skip
        self._data = data
        self._state = state
        return self

    @property
    def state(self) -> "WeightState":
        """What fp4_dist knows of the weight: its shape, mode, numerics, amax group and the last cast and gather."""
        return self._state

    @property
    def fp32(self) -> torch.Tensor:
        """The wrapped plain fp32 tensor (this rank's master values): what the casts read."""
        return self._data

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"NVFP4Master({self._state.fqn or 'weight'}, shape={list(self.shape)}, mode={self._state.mode})"

    def __tensor_flatten__(self):
        return ["_data"], self._state

    @staticmethod
    def __tensor_unflatten__(inner, state, outer_size, outer_stride):
        return NVFP4Master(inner["_data"], state)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        found: list = []  # the NVFP4Master leaves, in order, gathered while unwrapping (one pass)
        schema = func._schema
        if schema.is_mutable:
            plain, formal = [], schema.arguments
            for i, a in enumerate(args):
                first = len(found)
                plain.append(_unwrap(a, found))
                info = formal[i].alias_info if i < len(formal) else None
                if info is not None and info.is_write:
                    for t in found[first:]:
                        t._state.writes += 1
        else:
            plain = _unwrap(args, found)
        plain_kwargs = _unwrap(kwargs, found) if kwargs else {}
        state = found[0]._state
        out = func(*plain, **plain_kwargs)
        if func in _KEEP:
            return _wrap(out, state)
        if out is not None and schema.is_mutable and isinstance(args[0], NVFP4Master):
            return args[0]  # in place on the wrapped values: the wrapper is the result
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ----------------------------------------------------------------------------------- FSDP2 extension
    def _pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        state = self._state
        if state.world[0] is not mesh:
            state.world = (mesh, mesh.size())
        if state.mode == "nvfp4":
            if not state.cast_is_current(self._data):
                why = ("are not cast yet (the cast runs in the forward of the model passed to fully_shard_nvfp4)"
                       if state.cast_from is None else "are stale: its fp32 master changed since they were cast (an "
                       "optimizer step, a checkpoint load or another in-place write; the cast runs in the forward of "
                       "the model passed to fully_shard_nvfp4)")  # fmt: skip
                raise RuntimeError(
                    f"fp4_dist.fsdp: the NVFP4 bytes of {state.fqn} {why}. Before gathering outside a forward "
                    "(module.unshard()), call fp4_dist.fsdp.precompute_nvfp4(model) on every rank")
            return wire.pack(state.packed, state.scales, state.amax, state.world[1])
        return wire.pack_rows(self._data.to(state.model_dtype), state.shape[0], state.world[1]), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: Optional[torch.Tensor] = None):
        state = self._state
        m, k = state.shape
        unsharded = MODES[state.compute].fsdp_unsharded  # None: the dequantized values
        first = (state.held if unsharded is not None else state.value) is None or out is None
        if first:
            # normal tensors even under inference mode: later gathers write them
            with torch.inference_mode(False):
                state.buffers = _gather_buffers(state, self.device)
                if unsharded is None:
                    state.value = torch.empty((m, k), dtype=state.model_dtype, device=self.device)
        b = state.buffers
        if state.mode == "nvfp4":
            # the dequantize reads the tile grid as gathered (no expand)
            data, scale_inv, amax = wire.unpack(outputs, metadata, state.grid)
        else:
            (values,) = outputs
            data, amax, scale_inv = b["data"], b["amax"], b["scale_inv"]
            # In the nvfp4 compute mode these are the unsharded weight's own fields, which a forward saves for its
            # backward, whose gather writes the same values again: not an in-place change (as FSDP2's own writes).
            with torch.autograd._unsafe_preserve_version_counter((data, scale_inv, amax)):
                kernels.quantize_rowwise(values[:m].reshape(-1), (m, k), round_to=state.model_dtype,
                                         numerics=state.numerics, rowwise_data=data, scale_inv=scale_inv,
                                         amax=amax, name=state.fqn)  # fmt: skip
        state.gathered_fields = (data, scale_inv, amax)
        if unsharded is not None:
            if first:
                state.held, param, tensors = unsharded.make(state.gathered_fields, state.model_dtype, state.numerics)
                return param, (*tensors, *b.values())
            unsharded.write(state.held, state.gathered_fields)
            return None
        state.batch.add(state, data, scale_inv, amax, state.value)  # launches when its parameter group is complete
        if first:
            return state.value, (state.value, *b.values())
        return None


def local_master(p) -> Optional[NVFP4Master]:
    """The NVFP4Master of parameter `p` (this rank's shard when FSDP2 wrapped it in a DTensor), or None."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    return local if isinstance(local, NVFP4Master) else None


def _gather_buffers(state: WeightState, device) -> dict:
    """The unsharded weight's own tensors besides its value (FSDP2 frees and re-allocates them around each
    gather): the NVFP4 form a "bf16"-mode weight is quantized into after its gather ("nvfp4" mode reads
    FSDP2's gathered bytes and tile scales in place)."""
    m, k = state.shape
    if state.mode != "bf16":
        return {}
    return {"scale_inv": torch.zeros(rowwise_scale_shape(m, k), dtype=torch.uint8, device=device),
            "data": torch.zeros(rowwise_data_shape(m, k), dtype=torch.uint8, device=device),
            "amax": torch.zeros(1, dtype=torch.float32, device=device)}  # fmt: skip


# Ops FSDP2 (and module.to_empty / load_state_dict) apply to a parameter that must give back the wrapper. Every
# other op computes on the fp32 values and returns plain tensors (optimizer states are plain).
_KEEP = frozenset([
    aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.new_zeros.default, aten.empty_like.default, aten.clone.default, aten.detach.default,
    aten.alias.default, aten._to_copy.default, aten._pin_memory.default,
])  # fmt: skip


class _BoundPreAllGather:
    """`master.fsdp_pre_all_gather`: FSDP2 calls `inspect.signature` on it at every gather of every parameter,
    and for a bound method inspect derives the bound form anew each time (~10 us, even from a stored function
    signature); this callable carries the bound signature itself (~2.6 us)."""

    __slots__ = ("master",)
    _unbound = inspect.signature(NVFP4Master._pre_all_gather)
    __signature__ = _unbound.replace(parameters=list(_unbound.parameters.values())[1:])  # without `self`

    def __init__(self, master: NVFP4Master):
        self.master = master

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self.master._pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


NVFP4Master.fsdp_pre_all_gather = property(_BoundPreAllGather, doc="FSDP2's pre-all-gather extension hook.")


# Plain recursion over the containers aten ops take (tuples, lists, dicts) instead of torch's pytree: a fused
# optimizer step passes lists of hundreds of tensors, and pytree's per-leaf cost showed in its host time.
def _unwrap(tree, found: list):
    """`tree` with every NVFP4Master replaced by its wrapped values; the masters are appended to `found`."""
    if isinstance(tree, NVFP4Master):
        found.append(tree)
        return tree._data
    t = type(tree)
    if t is list or t is tuple:
        out = []
        for x in tree:
            if isinstance(x, NVFP4Master):
                found.append(x)
                out.append(x._data)
            elif type(x) in (list, tuple, dict):
                out.append(_unwrap(x, found))
            else:
                out.append(x)
        return out if t is list else tuple(out)
    if t is dict:
        return {k: _unwrap(v, found) for k, v in tree.items()}
    return tree


def _wrap(tree, state: WeightState):
    """Every plain tensor of an op's result wrapped as the master of `state`."""
    if isinstance(tree, torch.Tensor):
        return NVFP4Master(tree, state)
    t = type(tree)
    if t is list or t is tuple:
        return t([_wrap(x, state) for x in tree])
    return tree
