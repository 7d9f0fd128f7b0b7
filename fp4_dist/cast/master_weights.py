"""Cast fp32 master shards straight into NVFP4 weights (ZeRO partial cast), composed from the stage API.

One call, for any number of weights (spec section 4)::

    validate everything            (nothing written yet; errors name the weight)
    agreement header               one MAX all-reduce of a few floats and one read: same weights on every
                                   rank, shards covering each weight once, no rank rejected its arguments
                                   (`master_weights_check.CallAgreement`; only in a distributed job)
    partial_amax   -> amax buffer  [group 0: n0 tensor amaxes | tiles][group 1: ...]
    ONE MAX all-reduce of that buffer over the data-parallel group
    one scalar read: all tensor amaxes finite? (or, with defer_check, a DeferredCheck read later)
    fused_scale    -> every weight's rowwise_scale_inv + amax (identical on every rank), encode multipliers
    partial_cast   -> the owned nibbles of each weight's rowwise_data (or of its FSDP shard)

The stages, the amax exchange and the check are `core.CastCore`'s; this module adds TransformerEngine's
signature, the per-call checks and the agreement header. `BoundCast` binds a call's tensors once; a call with
the same tensors as a recent one (`core.BINDINGS`) skips the per-weight checks and list building (the
header still runs every call: the binding cache is per rank, and a rank whose list changed must still meet the
others' collectives).

Why the header comes first: the amax all-reduce's size depends on the weights, and a size mismatch there
aborts gloo and hangs NCCL. A rank whose own arguments are invalid joins the header with its flag set, so
every rank raises before writing a byte.

The all-reduce carries every tile amax, as TransformerEngine's does, so that every rank holds every scale
before the gather (Megatron relies on it). `fp4_dist.cast.sharded.ShardedCast` (Zero1Optimizer's cast)
exchanges only the tiles cut by rank boundaries and gathers the owners' scale bytes instead. `BoundCast` holds
everything a step needs (argument lists, amax buffer) so an optimizer builds it once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import kernels
from ..tensor.copy import mark_pending
from ..format import DEFAULT_NUMERICS, MASTER_DTYPES, byte_window, check_even_boundary, check_weight_shape
from ..shared_amax import group_of
from ..tensor import NVFP4Tensor, is_nvfp4_tensor
from .master_weights_check import CallAgreement, reject
from ..tensor.copy import weight_name
from .core import BINDINGS, CastCore, CastPlan, DeferredCheck, make_cast_plan, shard_bytes
from .collectives import CommStats, dist_backend, in_distributed_job, rank_and_size


# ------------------------------------------------------------------------------------------------ validation
def _check_weights(model_weights, master_weights, start_offsets, fsdp_shard_model_weights) -> None:
    """The call's structure: arguments of the right kinds, one entry of each per weight, NVFP4 weights.

    Raised on one rank only (a rank-local bug), these still reach every rank: `_validate_and_bind` joins the
    agreement header with this rank's flag set."""
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
        check_weight_shape(w.shape, weight_name(w, i, listed_as="model_weights"))


def _shape_plan(model_weights) -> CastPlan:
    """The amax-buffer layout of `model_weights` from what every entry reports (shape, dtype, numerics), also
    for entries that are not NVFP4 weights (their own check names them). Raises TypeError when
    ``model_weights`` is not a list of 2D tensors."""
    if model_weights is None or isinstance(model_weights, torch.Tensor) or not hasattr(model_weights, "__len__"):
        raise TypeError(f"model_weights must be a list of NVFP4Tensor weights (the same on every rank), got "
                        f"{type(model_weights).__name__}; this rank cannot join the other ranks' cast")
    shapes, dtypes, numerics, amax_groups = [], [], [], []
    for i, w in enumerate(model_weights):
        shape = tuple(getattr(w, "shape", ()))
        if len(shape) != 2:
            raise TypeError(f"model_weights[{i}] is a {type(w).__name__} of shape {list(shape)}, not a 2D weight; "
                            "this rank cannot join the other ranks' cast")
        shapes.append((int(shape[0]), int(shape[1])))
        dtypes.append(w.dtype if is_nvfp4_tensor(w) else torch.bfloat16)
        numerics.append(w.numerics if is_nvfp4_tensor(w) else DEFAULT_NUMERICS)
        amax_groups.append(group_of(w))
    return make_cast_plan(tuple(shapes), tuple(dtypes), tuple(numerics), amax_groups)


def _check_shard(i: int, w: NVFP4Tensor, master, start, fragment) -> None:
    """One weight's master shard, offset and optional FSDP fragment; raise naming the weight."""
    name = weight_name(w, i, listed_as="model_weights")
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
    check_even_boundary(name, start, end)
    if fragment is not None:
        lo, hi = byte_window(start, master.numel())
        want = hi - lo
        flat = fragment.dim() == 1 and fragment.is_contiguous()
        if fragment.dtype != torch.uint8 or fragment.numel() != want or fragment.device != master.device or not flat:
            raise ValueError(f"{name}: FSDP fragment must be {want} uint8 bytes on {master.device}, flat contiguous, "
                             f"got {fragment.dtype} {list(fragment.shape)} (contiguous={fragment.is_contiguous()}) "
                             f"on {fragment.device}; pass rowwise_data.view(-1)[lo:hi] with (lo, hi) = "
                             "fp4_dist.format.byte_window(start, numel)")


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
    amax_group=None,
    stats: Optional[CommStats] = None,
    defer_check: bool = False,
) -> Optional[DeferredCheck]:
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
            calls `post_all_gather_processing` (one launch for every weight). False, as in TE: no call is
            needed; each weight's compute copy is refreshed at its first use after this cast (one launch per
            weight, once per cast: gather before using the weights), and the now-stale columnwise copies are
            dropped here (``make_columnwise()`` rebuilds one on demand).
        amax_group: a second process group over which the weights' tensor amaxes are also
            MAX-reduced: under tensor parallelism each weight here is a slice of a larger one, and its scales use
            the whole weight's amax (the TP group), so every slice equals the slice of quantizing the whole
            weight. One more all-reduce of n floats.
        stats: optional `CommStats` recording the all-reduce (every tile amax of every weight: TE's payload).
        defer_check: do not wait for the non-finite check: the weights are written whatever it finds, and the
            verdict comes back as a `DeferredCheck` whose ``resolve()`` raises the error below, naming the weight,
            on every rank (the verdict is the all-reduced one). Resolve it before anything reads the weights (the
            Megatron adapter does so in `post_all_gather_processing`): the host then need not wait for the
            optimizer's device work in the middle of the step. None when there is nothing to check.

    Every weight's ``rowwise_scale_inv`` and ``amax`` are written (identical on every rank) and the owned
    nibbles of ``rowwise_data``; nothing else. Inside a distributed job two MAX all-reduces per call (the
    agreement header, the amaxes) and two scalar device-to-host reads; in a single process none and one.
    The checks and the binding of the stages run on the first call with a set of tensors; later calls with the
    same tensors (same objects, same buffers) only launch. `Zero1Optimizer` exchanges far fewer amaxes
    (`fp4_dist.cast.sharded`); this function keeps TE's full exchange because its callers (Megatron)
    rely on every rank holding every scale before the gather.
    Raises ValueError/TypeError naming the weight, with no byte written, for bad shards, offsets, dtypes,
    devices, or non-finite master values (those at ``resolve()`` with `defer_check`, the weights written);
    `fp4_dist.cast.RankMismatchError` on every rank when the ranks passed different weights or shards that do not
    cover each weight exactly once.
    """
    key = _call_key(model_weights, master_weights, start_offsets, fsdp_shard_model_weights, group)
    bound = None if key is None else BINDINGS.get(key)
    if bound is None:  # first call with these tensors: every check, then bind
        bound = _validate_and_bind(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights,
                                   key, stats)  # fmt: skip
    check = bound.run(group, stats, amax_group, defer_check=defer_check)
    if not manual_post_all_gather_processing:
        mark_pending(model_weights, auto_refresh=True)
        for w in model_weights:
            w.columnwise_data = w.columnwise_scale_inv = None
    return check


def _call_key(model_weights, master_weights, start_offsets, fragments, group) -> Optional[tuple]:
    """Everything the checks of a call and its bound launches depend on, cheaply: the weights by identity (a
    cached binding holds them, so an id is never reused), their numerics (settable; dtype and shape are fixed per
    tensor), the signatures of the buffers the cast writes, of each master and fragment, the offsets with their
    types, and the group. None if unhashable."""
    try:
        return (
            "cast", tuple(map(id, model_weights)), tuple([w.numerics for w in model_weights]),
            kernels.signature([t for w in model_weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax)]),
            kernels.signature(master_weights), tuple(start_offsets), tuple(map(type, start_offsets)),
            None if fragments is None else kernels.signature(fragments), id(group), rank_and_size(group),
        )  # fmt: skip
    except (AttributeError, TypeError, ValueError):
        return None


def _validate_and_bind(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights, key,
                       stats) -> "BoundCast":  # fmt: skip
    """First call with these tensors: every check, then bind (and cache) the cast. A rank whose checks fail
    still joins the agreement header, with its flag set, so every rank raises (none hangs)."""
    try:
        plan = _shape_plan(model_weights)
        _check_weights(model_weights, master_weights, start_offsets, fsdp_shard_model_weights)
        frags = fsdp_shard_model_weights or [None] * len(model_weights)
        for i, (w, m, s, f) in enumerate(zip(model_weights, master_weights, start_offsets, frags)):
            _check_shard(i, w, m, s, f)
    except (TypeError, ValueError) as e:
        _join_with_error(model_weights, group, stats, e)
    pairs = [_normalise(m, s) for m, s in zip(master_weights, start_offsets)]
    rank, size = rank_and_size(group)
    bound = BoundCast(plan, model_weights, [p[0] for p in pairs], [p[1] for p in pairs], frags, rank=rank,
                      world_size=size)  # fmt: skip
    if key is not None:
        BINDINGS.put(key, bound)
    return bound


quantize_master_weights = cast_master_weights_to_nvfp4


def _weight_device(model_weights) -> torch.device:
    return model_weights[0].rowwise_data.device if len(model_weights) else torch.device("cpu")


def _agreement(plan, model_weights, shards, starts, rank, size) -> Optional[CallAgreement]:
    """The agreement header of a call inside a distributed job; none for a single process (no other rank to
    disagree with: a part of a weight may be cast alone there, its scales then come from that part)."""
    if not in_distributed_job():
        return None
    return CallAgreement(plan.shapes, [w.dtype for w in model_weights], [w.numerics for w in model_weights],
                         shards, starts, rank, size, plan.shared)  # fmt: skip


class BoundCast:
    """The TE-signature cast bound to one set of tensors: a `CastCore` that exchanges the whole amax buffer (every
    tile amax) and writes every scale with fused_scale, after the ranks' agreement check
    (`master_weights_check.CallAgreement`).

    An optimizer whose weights, master shards and fragments stay the same tensors from step to step (as a loop
    calling `cast_master_weights_to_nvfp4` with the same lists) builds this once; each step is then `run()`: a
    few launches, two all-reduces (the agreement header, the amaxes), two scalar reads, no per-weight Python work.

    Args:
        shards, starts: per weight the validated flat master shard (None: owns nothing) and its first element.
        fragments: per weight an FSDP byte fragment, or None to write into ``rowwise_data``.
        rank, world_size: this rank and the size of the group `run` will be called with.
    """

    def __init__(self, plan: CastPlan, model_weights, shards, starts, fragments=None, *, rank: int = 0,
                 world_size: int = 1):  # fmt: skip
        n = len(model_weights)
        fragments = fragments or [None] * n
        self.weights, self.world_size = list(model_weights), world_size
        targets = [f if f is not None else shard_bytes(w.rowwise_data, m, s)
                   for w, m, s, f in zip(self.weights, shards, starts, fragments)]  # fmt: skip
        self.core = CastCore(plan, shards, starts, targets, self._bind_scales,
                             names=[weight_name(w, i, listed_as="model_weights") + " master"
                                    for i, w in enumerate(self.weights)],
                             device=_weight_device(model_weights))  # fmt: skip
        self.agreement = _agreement(plan, self.weights, shards, starts, rank, world_size)

    def _bind_scales(self, g, block, enc):
        ws = [self.weights[i] for i in g.indices]
        return kernels.bind_fused_scale(block, g.shapes, [w.rowwise_scale_inv for w in ws], [w.amax for w in ws],
                                        enc, numerics=g.numerics)  # fmt: skip

    def run(self, group=None, stats: Optional[CommStats] = None, amax_group=None, *,
            defer_check: bool = False) -> Optional[DeferredCheck]:  # fmt: skip
        """agreement check -> amax -> one MAX all-reduce (and one over `amax_group` of the tensor amaxes) ->
        check (one scalar read) -> scales -> cast. Raises before any write; with `defer_check` the check is read
        later (`cast_master_weights_to_nvfp4`), and its `DeferredCheck` is returned."""
        _, size = rank_and_size(group)
        if size != self.world_size:
            raise ValueError(f"this BoundCast was built for a group of {self.world_size} ranks but runs on a group "
                             f"of {size}; build one per process group")
        if self.agreement is not None:
            self.agreement.check(group, stats, self.core.amaxes.device)
        core = self.core
        core.local_amaxes()
        verdict = core.exchange(group, stats, amax_group, defer_check=defer_check)
        check = core.defer(verdict) if defer_check else None
        mark_pending(self.weights)
        core.scales()
        core.cast()
        return check


def _join_with_error(model_weights, group, stats, error: Exception) -> None:
    """This rank's call is invalid: join the agreement header with this rank's flag set (the other ranks then
    raise RuntimeError naming this rank, before their amax all-reduce), and raise `error` here. Writes nothing.
    A single process has no one to tell."""
    if in_distributed_job():
        reject(group, stats, _error_device(model_weights, group))
    raise error


def _error_device(model_weights, group) -> torch.device:
    """Where the all-reduce buffer must live: the weights' device, or the GPU an NCCL group needs."""
    for w in model_weights if isinstance(model_weights, (list, tuple)) else ():
        t = getattr(w, "rowwise_data", w)
        if isinstance(t, torch.Tensor):
            if t.device.type == "cpu" and rank_and_size(group)[1] > 1 and dist_backend(group) == "nccl":
                break
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
