"""Cast fp32 master shards straight into NVFP4 weights (ZeRO partial cast), composed from the stage API.

One call, for any number of weights (spec section 4)::

    validate everything            (nothing written yet; errors name the weight)
    partial_amax   -> amax buffer  [group 0: n0 tensor amaxes | tiles][group 1: ...][ws error flags]
    ONE MAX all-reduce of that buffer over the data-parallel group
    one scalar read: all tensor amaxes finite and no rank flagged an error?   (the only host sync)
    fused_scale    -> every weight's rowwise_scale_inv + amax (identical on every rank), encode multipliers
    partial_cast   -> the owned nibbles of each weight's rowwise_data (or of its FSDP shard)

Weights are grouped by (model dtype, numerics) because the stages take one of each; all groups share the
one all-reduce. Per-step metadata (`CastPlan`: groups and buffer offsets) is built once per list of shapes
and cached; `BoundCast` binds it to tensors once, so optimizers skip the per-call checks and list building.

Why the error flags: a rank whose inputs are invalid must not skip the collective (the others would hang),
so it contributes zeros plus a flag in its own slot, and every rank raises before writing a byte.

The all-reduce carries every tile amax, as TransformerEngine's does, so that every rank holds every scale
before the gather (Megatron relies on it). `fp4_dist.optim.owned_scales.ShardedCast` (Zero1Optimizer's cast)
exchanges only the tiles cut by rank boundaries and gathers the owners' scale bytes instead. `BoundCast` holds
everything a step needs (argument lists, amax buffer) so an optimizer builds it once.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .. import kernels
from ..compute_copy import BoundRefresh, mark_pending
from ..kernels import bound as stages
from ..format import check_weight_shape
from ..tensor import NVFP4Tensor, is_nvfp4_tensor
from .collectives import CommStats, all_reduce_max_, dist_backend, rank_and_size

MASTER_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CastGroup:
    """Weights cast with one set of stage calls (same model dtype and numerics)."""

    indices: Tuple[int, ...]
    shapes: Tuple[Tuple[int, int], ...]
    round_to: torch.dtype
    numerics: str
    offset: int
    """First entry of this group's `kernels.amax_layout` block in the amax buffer."""
    layout: kernels.AmaxLayout


@dataclass(frozen=True)
class CastPlan:
    """Static metadata of one list of weights: built once, reused every step."""

    shapes: Tuple[Tuple[int, int], ...]
    groups: Tuple[CastGroup, ...]
    amax_numel: int
    """Entries of all groups' amax layouts; the buffer adds one error-flag slot per rank."""


@functools.lru_cache(maxsize=64)
def make_cast_plan(shapes: Tuple[Tuple[int, int], ...], dtypes: Tuple[torch.dtype, ...],
                   numerics: Tuple[str, ...]) -> CastPlan:
    """Group weights by (dtype, numerics) and place each group's amax block; pure, cached."""
    keys = {}
    for i, key in enumerate(zip(dtypes, numerics)):
        keys.setdefault(key, []).append(i)
    groups, offset = [], 0
    for (dtype, num), idx in keys.items():
        g_shapes = tuple(shapes[i] for i in idx)
        layout = kernels.amax_layout(g_shapes)
        groups.append(CastGroup(tuple(idx), g_shapes, dtype, num, offset, layout))
        offset += layout.total
    return CastPlan(tuple(shapes), tuple(groups), offset)


def plan_for(model_weights: Sequence[NVFP4Tensor]) -> CastPlan:
    shapes = tuple(tuple(int(s) for s in w.shape) for w in model_weights)
    return make_cast_plan(shapes, tuple(w.dtype for w in model_weights), tuple(w.numerics for w in model_weights))


# ------------------------------------------------------------------------------------------------ validation
def _name(i: int, w) -> str:
    return f"model_weights[{i}] ({'x'.join(map(str, w.shape))})"


def _check_weights(model_weights, master_weights, start_offsets, fsdp_shard_model_weights) -> None:
    """The call's structure: arguments of the right kinds, one entry of each per weight, NVFP4 weights.

    Raised on one rank only (a rank-local bug), these still reach every rank: `_validate_and_run` joins the
    all-reduce with this rank's error flag set (see `_shape_plan`)."""
    n = len(model_weights)
    for arg, value in (("master_weights", master_weights), ("start_offsets", start_offsets)):
        if value is None or isinstance(value, torch.Tensor) or not hasattr(value, "__len__"):
            raise TypeError(f"{arg} must be a list with one entry per weight (None entries where this rank owns "
                            f"nothing), got {type(value).__name__}")
    if len(master_weights) != n or len(start_offsets) != n:
        raise ValueError(f"got {n} model_weights, {len(master_weights)} master_weights and "
                         f"{len(start_offsets)} start_offsets; pass one of each per weight (None where not owned)")
    if fsdp_shard_model_weights is not None and (isinstance(fsdp_shard_model_weights, torch.Tensor)
                                                 or not hasattr(fsdp_shard_model_weights, "__len__")):  # fmt: skip
        raise TypeError("fsdp_shard_model_weights must be None or a list with one byte fragment (or None) per "
                        f"weight, got {type(fsdp_shard_model_weights).__name__}")
    if fsdp_shard_model_weights is not None and len(fsdp_shard_model_weights) != n:
        raise ValueError(f"got {len(fsdp_shard_model_weights)} fsdp_shard_model_weights for {n} model_weights")
    for i, w in enumerate(model_weights):
        if not is_nvfp4_tensor(w):
            raise TypeError(f"model_weights[{i}] is a {type(w).__name__} ({getattr(w, 'dtype', '')}); "
                            "cast_master_weights_to_nvfp4 only casts into NVFP4Tensor weights "
                            "(convert them with fp4_dist.convert_linear_weights or fp4_dist.quantize)")
        check_weight_shape(w.shape, _name(i, w))


def _shape_plan(model_weights) -> CastPlan:
    """The amax-buffer layout of `model_weights` from what every entry reports (shape, dtype, numerics), also
    for entries that are not NVFP4 weights: a rank whose call is malformed can still join the all-reduce with a
    buffer of the length the other ranks use, and say so there. Raises TypeError when even that is impossible
    (``model_weights`` is not a list of 2D tensors): then this rank cannot join, and the others stop at the
    collective's timeout or when this process ends."""
    if model_weights is None or isinstance(model_weights, torch.Tensor) or not hasattr(model_weights, "__len__"):
        raise TypeError(f"model_weights must be a list of NVFP4Tensor weights (the same on every rank), got "
                        f"{type(model_weights).__name__}; this rank cannot join the other ranks' cast")
    shapes, dtypes, numerics = [], [], []
    for i, w in enumerate(model_weights):
        shape = tuple(getattr(w, "shape", ()))
        if len(shape) != 2:
            raise TypeError(f"model_weights[{i}] is a {type(w).__name__} of shape {list(shape)}, not a 2D weight; "
                            "this rank cannot join the other ranks' cast")
        shapes.append((int(shape[0]), int(shape[1])))
        dtypes.append(w.dtype if is_nvfp4_tensor(w) else torch.bfloat16)
        numerics.append(w.numerics if is_nvfp4_tensor(w) else "te")
    return make_cast_plan(tuple(shapes), tuple(dtypes), tuple(numerics))


def _check_shard(i: int, w: NVFP4Tensor, master, start, fragment) -> None:
    """One weight's master shard, offset and optional FSDP fragment; raise naming the weight."""
    name = _name(i, w)
    if master is None:
        return
    if not isinstance(master, torch.Tensor) or master.dtype not in MASTER_DTYPES:
        got = master.dtype if isinstance(master, torch.Tensor) else type(master).__name__
        raise TypeError(f"{name}: master shard must be an fp32 (or bf16) tensor, got {got}")
    if master.device != w.rowwise_data.device:
        raise ValueError(f"{name}: master shard is on {master.device} but the weight is on "
                         f"{w.rowwise_data.device}; move the master to the weight's device")
    if master.dim() != 1 or not master.is_contiguous():
        raise ValueError(f"{name}: master shard must be a flat contiguous tensor, got shape "
                         f"{list(master.shape)}; pass master.view(-1)")
    if master.numel() == 0:
        return  # an empty shard owns nothing, whatever its start offset (as a None master)
    if start is None or isinstance(start, bool) or not hasattr(start, "__index__"):
        raise TypeError(f"{name}: start offset must be an int element offset, got {start!r}")
    start, numel = int(start), w.shape[0] * w.shape[1]
    end = start + master.numel()
    if start < 0 or end > numel:
        raise ValueError(f"{name}: master shard covers elements [{start}, {end}) but the weight has {numel}; "
                         "the shard length or start offset does not match the buffer layout")
    if master.numel() and (start % 2 or end % 2):
        raise ValueError(f"{name}: shard [{start}, {end}) has an odd boundary; two FP4 values share a byte, so "
                         "shard boundaries must be even element offsets (use fp4_dist.buffers.build_layout)")
    if fragment is not None:
        want = (end + 1) // 2 - start // 2
        flat = fragment.dim() == 1 and fragment.is_contiguous()
        if fragment.dtype != torch.uint8 or fragment.numel() != want or fragment.device != master.device or not flat:
            raise ValueError(f"{name}: FSDP fragment must be {want} uint8 bytes on {master.device}, flat contiguous, "
                             f"got {fragment.dtype} {list(fragment.shape)} (contiguous={fragment.is_contiguous()}) "
                             f"on {fragment.device}; pass rowwise_data.view(-1)[start // 2:(end + 1) // 2]")


def _normalise(master, start):
    """(shard or None, int start) as the stages take them; an empty shard owns nothing."""
    if master is None or master.numel() == 0:
        return None, 0
    return master, int(start)


# ------------------------------------------------------------------------------------------------ the cast
def cast_master_weights_to_nvfp4(
    model_weights: Sequence[NVFP4Tensor],
    master_weights: Sequence[Optional[torch.Tensor]],
    start_offsets: Sequence[Optional[int]],
    group=None,
    fsdp_shard_model_weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
    manual_post_all_gather_processing: bool = True,
    *,
    stats: Optional[CommStats] = None,
) -> None:
    """Cast this rank's fp32 master shards into NVFP4 weights (TransformerEngine's `quantize_master_weights`).

    Args:
        model_weights: NVFP4Tensor weights [M, K] (the same list on every rank of ``group``).
        master_weights: per weight, the flat fp32 shard this rank owns (elements
            ``[start, start + numel)`` of the row-major weight), or None where it owns nothing.
            Values are rounded to the weight's dtype (bf16) before amax and cast, as TE does.
        start_offsets: per weight, the first element of the shard (even), or None.
        group: data-parallel process group (None: default group, or a single process).
        fsdp_shard_model_weights: optional per weight uint8 byte fragments
            ``[start >> 1, (end + 1) >> 1)`` that receive the cast bytes instead of ``rowwise_data``.
        manual_post_all_gather_processing: True (default): the caller all-gathers ``rowwise_data`` and then
            calls `post_all_gather_processing`. False: columnwise copies are dropped here (they are stale)
            and ``make_columnwise()`` rebuilds them later, as TE does.
        stats: optional `CommStats` recording the all-reduce (every tile amax of every weight: TE's payload).

    Every weight's ``rowwise_scale_inv`` and ``amax`` are written (identical on every rank) and the owned
    nibbles of ``rowwise_data``; nothing else. One MAX all-reduce per call, one scalar device-to-host read.
    The checks and the binding of the stages run on the first call with a set of tensors; later calls with the
    same tensors (same objects, same buffers) only launch. `Zero1Optimizer` exchanges far fewer amaxes
    (`fp4_dist.optim.owned_scales`); this function keeps TE's full exchange because its callers (Megatron)
    rely on every rank holding every scale before the gather.
    Raises ValueError/TypeError naming the weight, with no byte written, for bad shards, offsets, dtypes,
    devices, or non-finite master values.
    """
    key = _bound_key(model_weights, master_weights, start_offsets, fsdp_shard_model_weights, group)
    bound = None if key is None else _BOUND.get(key)
    if bound is not None:  # the same tensors as a call that passed every check: skip the per-weight checks
        _BOUND.move_to_end(key)
        bound.run(group, stats)
    else:
        _validate_and_run(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights, key, stats)
    if not manual_post_all_gather_processing:
        for w in model_weights:
            w.columnwise_data = w.columnwise_scale_inv = None


# Casts bound by earlier calls, by `_bound_key` (an LRU: a training loop passes the same lists every step).
_BOUND: "OrderedDict[tuple, BoundCast]" = OrderedDict()
_BOUND_SIZE = 4


def _bound_key(model_weights, master_weights, start_offsets, fragments, group) -> Optional[tuple]:
    """Everything the checks of a call and the bound launches depend on, cheaply: the weights by identity (the
    cache holds them, so an id is never reused), their numerics (settable; dtype and shape are fixed per tensor),
    the addresses of the buffers the cast writes, the signature (address, dtype, shape, strides) of each master
    and fragment, the offsets with their types, and the group. None if unhashable."""
    try:
        return (
            tuple(map(id, model_weights)),
            tuple([w.numerics for w in model_weights]),
            tuple([(w.rowwise_data.data_ptr(), w.rowwise_scale_inv.data_ptr(), w.amax.data_ptr())
                   for w in model_weights]),
            _signature(master_weights), tuple(start_offsets), tuple(map(type, start_offsets)),
            None if fragments is None else _signature(fragments), id(group), rank_and_size(group),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


def _signature(tensors) -> tuple:
    return tuple([None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors])


def _validate_and_run(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights, key, stats):
    """First call with these tensors: every check, then bind (and cache) the cast, then run it. A rank whose
    checks fail still joins the one all-reduce, with its error flag set, so every rank raises (none hangs)."""
    plan = _shape_plan(model_weights)
    try:
        _check_weights(model_weights, master_weights, start_offsets, fsdp_shard_model_weights)
        frags = fsdp_shard_model_weights or [None] * len(model_weights)
        for i, (w, m, s, f) in enumerate(zip(model_weights, master_weights, start_offsets, frags)):
            _check_shard(i, w, m, s, f)
    except (TypeError, ValueError) as e:
        _join_with_error(plan, model_weights, group, stats, e)
    pairs = [_normalise(m, s) for m, s in zip(master_weights, start_offsets)]
    bound = BoundCast(plan, model_weights, [p[0] for p in pairs], [p[1] for p in pairs], frags,
                      world_size=rank_and_size(group)[1])  # fmt: skip
    if key is not None:
        _BOUND[key] = bound
        if len(_BOUND) > _BOUND_SIZE:
            _BOUND.popitem(last=False)
    bound.run(group, stats)


quantize_master_weights = cast_master_weights_to_nvfp4


def _weight_device(model_weights) -> torch.device:
    return model_weights[0].rowwise_data.device if len(model_weights) else torch.device("cpu")


class BoundCast:
    """A `CastPlan` bound to one set of tensors: the amax buffer and every stage launch, built once.

    An optimizer whose weights, master shards and fragments stay the same tensors from step to step (as in
    `Zero1Optimizer`, or a loop calling `cast_master_weights_to_nvfp4` with the same lists) builds this once;
    each step is then `run()`: a few launches, one all-reduce, one scalar read, no per-weight Python work.

    Args:
        shards, starts: per weight the validated flat master shard (None: owns nothing) and its first element;
            None for both: this rank owns nothing (error path).
        fragments: per weight an FSDP byte fragment, or None to write into ``rowwise_data``.
        world_size: size of the group `run` will be called with (one error-flag slot per rank).
    """

    def __init__(self, plan: CastPlan, model_weights, shards, starts, fragments=None, *, world_size: int = 1):
        n = len(model_weights)
        shards, starts = shards or [None] * n, starts or [0] * n
        fragments = fragments or [None] * n
        self.plan, self.weights = plan, list(model_weights)
        self.buf = torch.zeros(plan.amax_numel + world_size, dtype=torch.float32,
                               device=_weight_device(model_weights))
        self.amax_runs, self.cast_runs = [], []
        for g in plan.groups:
            ws = [model_weights[i] for i in g.indices]
            g_shards, g_starts = [shards[i] for i in g.indices], [starts[i] for i in g.indices]
            block = self.buf[g.offset:g.offset + g.layout.total]
            enc = torch.zeros(g.layout.total - g.layout.n, dtype=torch.float32, device=self.buf.device)
            frags = [_fragment(model_weights[i], shards[i], starts[i], fragments[i]) for i in g.indices]
            self.amax_runs.append(stages.bind_partial_amax(g_shards, g_starts, g.shapes, block, round_to=g.round_to))
            self.cast_runs.append((
                stages.bind_fused_scale(block, g.shapes, [w.rowwise_scale_inv for w in ws], [w.amax for w in ws],
                                       enc, numerics=g.numerics),
                stages.bind_partial_cast(g_shards, g_starts, g.shapes, enc, frags, round_to=g.round_to)))  # fmt: skip

    def run(self, group=None, stats: Optional[CommStats] = None) -> None:
        """amax -> one MAX all-reduce -> check (one scalar read) -> scales -> cast. Raises before any write."""
        _, size = rank_and_size(group)
        buf, plan = self.buf, self.plan
        if buf.numel() != plan.amax_numel + size:
            raise ValueError(f"this BoundCast was built for a group of {buf.numel() - plan.amax_numel} ranks but runs "
                             f"on a group of {size}; build one per process group")
        buf[plan.amax_numel:].zero_()  # partial_amax writes every other entry
        for amax in self.amax_runs:
            amax()
        _exchange_amaxes(buf, group, stats)
        _raise_if_bad(plan, buf, self.weights)
        mark_pending(self.weights)
        for scale, cast in self.cast_runs:
            scale()
            cast()


def _exchange_amaxes(buf: torch.Tensor, group, stats) -> None:
    """What crosses ranks: the whole buffer (tensor amaxes, every tile amax, error flags). The cut-tile-only
    exchange is a separate flow (`owned_scales.ShardedCast`) because it also changes where scales come from."""
    all_reduce_max_(buf, group, stats)


def _join_with_error(plan: CastPlan, model_weights, group, stats, error: Exception) -> None:
    """This rank's call is invalid: contribute zeros and its error flag to the all-reduce the other ranks run
    (they then raise RuntimeError naming this rank), and raise `error` here. Writes nothing."""
    rank, size = rank_and_size(group)
    buf = torch.zeros(plan.amax_numel + size, dtype=torch.float32, device=_error_device(model_weights, group))
    buf[plan.amax_numel + rank] = 1.0
    _exchange_amaxes(buf, group, stats)
    raise error


def _error_device(model_weights, group) -> torch.device:
    """Where the all-reduce buffer must live: the weights' device, or the GPU an NCCL group needs."""
    for w in model_weights:
        t = getattr(w, "rowwise_data", w)
        if isinstance(t, torch.Tensor):
            if t.device.type == "cpu" and rank_and_size(group)[1] > 1 and dist_backend(group) == "nccl":
                break
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_cast(plan: CastPlan, model_weights, shards, starts, *, group=None, fragments=None,
             stats: Optional[CommStats] = None, local_error: Optional[Exception] = None) -> None:
    """The cast with a prebuilt plan: shards/starts already valid; or, with ``local_error``, this rank's part in
    the other ranks' cast (its error flag) and then that error raised."""
    if local_error is not None:
        _join_with_error(plan, model_weights, group, stats, local_error)
    bound = BoundCast(plan, model_weights, shards, starts, fragments, world_size=rank_and_size(group)[1])
    bound.run(group, stats)


def _fragment(w: NVFP4Tensor, shard, start: int, fsdp_fragment):
    if shard is None:
        return None
    if fsdp_fragment is not None:
        return fsdp_fragment
    return w.rowwise_data.view(-1)[start >> 1:(start + shard.numel() + 1) >> 1]


def _raise_if_bad(plan: CastPlan, buf: torch.Tensor, model_weights) -> None:
    """One scalar read decides; the error path may read more (it is about to raise anyway)."""
    flags = buf[plan.amax_numel:]
    ok = (flags == 0).all()
    for g in plan.groups:
        ok = ok & torch.isfinite(buf[g.offset:g.offset + g.layout.n]).all()
    if bool(ok.item()):  # the only device-to-host read of a successful call
        return
    bad_ranks = flags.nonzero().flatten().tolist()
    if bad_ranks:
        raise RuntimeError(f"rank(s) {bad_ranks} rejected their master shards (see the error on those ranks); "
                           "no weight, scale or amax was written on any rank")
    for g in plan.groups:
        amaxes = buf[g.offset:g.offset + g.layout.n].tolist()
        for i, a in zip(g.indices, amaxes):
            if a != a or a in (float("inf"), float("-inf")):
                raise ValueError(f"{_name(i, model_weights[i])}: master values are not finite (inf or NaN on "
                                 "some rank); NVFP4 cannot encode them. No weight, scale or amax was written")
    raise AssertionError("amax check failed without a non-finite amax or an error flag")


# ----------------------------------------------------------------------------------- after the all-gather
def post_all_gather_processing(model_weights, *, columnwise: bool = True) -> None:
    """After the byte all-gather: refresh the compute copies and build the columnwise copies of NVFP4 weights.

    Args:
        model_weights: a tensor or a list; entries that are not NVFP4Tensor are ignored (as in TE).
        columnwise: build the columnwise copies (nibble transpose + scale transpose), as TransformerEngine's
            function does; weights with an odd M stay rowwise-only (two rows share a columnwise byte). False:
            drop them instead (set to None, never left stale): nothing in a Hopper or CPU training step reads
            them, and `make_columnwise()` builds them on demand.
    One launch per stage for all weights (dequantize, and the two transposes); the launches are bound once per
    list of weights and reused while the list and its tensors stay the same.
    """
    if isinstance(model_weights, torch.Tensor):
        model_weights = [model_weights]
    if model_weights is None or not hasattr(model_weights, "__iter__"):
        raise TypeError(f"post_all_gather_processing: model_weights must be a tensor or a list of them, got "
                        f"{type(model_weights).__name__}")
    ours = [w for w in model_weights if is_nvfp4_tensor(w)]
    if not ours:
        return
    _post_gather_for(ours, columnwise)()


class _PostGather:
    """post_all_gather_processing of one list of weights, bound: transposes (or drop), then the refresh."""

    def __init__(self, weights, columnwise: bool):
        self.weights, self.columnwise = weights, columnwise
        self.refresh = BoundRefresh(weights)
        self._transposes, self._bound = [], None

    def _columnwise_fields(self, todo) -> tuple:
        return tuple((w.rowwise_data, w.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv) for w in todo)

    def __call__(self) -> None:
        if self.columnwise:
            todo = [w for w in self.weights if w.shape[0] % 2 == 0]
            for w in todo:
                w.alloc_columnwise()
            fields = self._columnwise_fields(todo)
            if self._bound is None or len(fields) != len(self._bound) or any(
                    a is not b for x, y in zip(fields, self._bound) for a, b in zip(x, y)):
                self._transposes = [
                    stages.bind_nibble_transpose([w.rowwise_data for w in todo], [w.columnwise_data for w in todo]),
                    stages.bind_scale_transpose([w.rowwise_scale_inv for w in todo],
                                                [w.columnwise_scale_inv for w in todo], [tuple(w.shape) for w in todo])]
                self._bound = fields
            for run in self._transposes:
                run()
        else:
            for w in self.weights:
                if w.columnwise_data is not None or w.columnwise_scale_inv is not None:
                    w.columnwise_data = w.columnwise_scale_inv = None
        self.refresh()


_POST: "OrderedDict[tuple, _PostGather]" = OrderedDict()
_POST_SIZE = 16  # Megatron calls it once per bucket group, with the same lists every step


def _post_gather_for(weights, columnwise: bool) -> _PostGather:
    key = (tuple(map(id, weights)), columnwise)
    post = _POST.get(key)
    if post is None:
        post = _POST[key] = _PostGather(weights, columnwise)  # holds the weights, so the ids stay theirs
        if len(_POST) > _POST_SIZE:
            _POST.popitem(last=False)
    else:
        _POST.move_to_end(key)
    return post
