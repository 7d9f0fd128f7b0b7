"""Zero1Optimizer: ZeRO stage 1 for plain PyTorch models, with a 4-bit NVFP4 parameter all-gather.

Each rank keeps fp32 masters (and the wrapped optimizer's state) only for its shard of the parameters.
One `step()`::

    grads -> fp32 grad buffer       (copy of each param.grad into its slot of the flat buffer)
    reduce-scatter per bucket       -> this rank's grad shard (averaged over ranks by default)
    gradient check                  ONE MAX all-reduce of a flag per parameter (has a gradient on some rank)
                                    and per buffer (a non-finite value in some rank's shard), and the step's
                                    one device-to-host read: raise or skip, and which parameters sit out
    inner.step()                    any torch.optim optimizer, over views of the fp32 master shard
    ShardedCast.cast                amax + ONE small MAX all-reduce (tensor and cut-tile amaxes only) + the
                                    scales of the tiles this rank owns + cast of the owned nibbles, written
                                    straight into the packed all-gather buffer (`fp4_dist.cast.sharded`)
    all-gather per bucket           packed NVFP4 bytes (0.5 B/element) and dense params (model dtype),
                                    plus one all-gather of the compact tile scales (1 B per 16x16 tile)
    ShardedCast.after_gather        rowwise scales from the gathered bytes, columnwise copies

Collectives per step: (reduce-scatter + all-gather) per bucket of each buffer, the gradient check's all-reduce,
plus one all-reduce and one all-gather (of the scale bytes) when there are NVFP4 weights. Construction checks
with one all-gather that every rank passed the same parameters and options (`agreement`).

NVFP4 weights are `nn.Parameter(NVFP4Tensor)` (see `fp4_dist.convert_linear_weights`); every other
parameter (norms, biases, embeddings) is "dense": sharded the same way, gathered in its own dtype.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._user import user_stacklevel
from ..buffers import ShardBuffer, build_layout
from ..shared_amax import group_of
from ..tensor import FIELDS, is_nvfp4_tensor
from ..tensor.copy import weight_name
from ..cast.agreement import check_same_on_every_rank
from ..cast.sharded import ShardedCast
from ..cast.collectives import (
    CommStats,
    all_gather_inplace,
    all_gather_into,
    all_reduce_max_,
    all_reduce_sum_,
    rank_and_size,
    reduce_scatter_ordered,
    reduce_scatter_sum,
)

GRAD_REDUCTIONS = {"reduce_scatter": reduce_scatter_sum, "ordered": reduce_scatter_ordered}
NONFINITE_GRADS = ("raise", "skip")


@dataclass(frozen=True, kw_only=True)
class Zero1Config:
    """Options of `Zero1Optimizer`."""

    bucket_numel: Optional[int] = 40_000_000
    """A bucket closes once it holds this many elements (None: one bucket). One reduce-scatter and one
    all-gather per bucket and buffer."""
    align: int = 64
    """Even element alignment of every weight start and rank boundary (see `fp4_dist.buffers.layout`)."""
    grad_reduction: str = "reduce_scatter"
    """"reduce_scatter": the backend's sum (fastest). "ordered": all-to-all then a rank-ordered sum, bitwise
    equal to single-process gradient accumulation over the ranks' micro-batches for any world size."""
    average_grads: bool = True
    """Divide the summed grads by the world size (DDP semantics)."""
    nonfinite_grads: str = "raise"
    """What `Zero1Optimizer.step` does when a reduced gradient holds inf or NaN (found on every rank before the
    inner optimizer runs): "raise" a ValueError naming the parameters, with masters, optimizer state and weights
    left as they were; "skip" the step, as torch.amp.GradScaler and Megatron do (counted in
    ``Zero1Optimizer.skipped_steps``, with a warning)."""
    columnwise: bool = False
    """Also build the columnwise NVFP4 copies (nibble + scale transpose) after each gather. Only consumers of
    the packed columnwise layout read them (FP4 GEMMs on Blackwell, TransformerEngine interop); training
    through fp4_dist computes on the compute copies, so by default they are not built (each weight's
    ``columnwise_data`` stays None; ``make_columnwise()`` builds one on demand)."""

    def __post_init__(self):
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"grad_reduction must be one of {sorted(GRAD_REDUCTIONS)}, got {self.grad_reduction!r}")
        if self.nonfinite_grads not in NONFINITE_GRADS:
            raise ValueError(f"nonfinite_grads must be one of {NONFINITE_GRADS}, got {self.nonfinite_grads!r}")
        if not (isinstance(self.align, int) and self.align >= 2 and self.align % 2 == 0):
            raise ValueError(f"align must be a positive even int, got {self.align!r}")


class _Section:
    """Parameters that share one buffer: the NVFP4 weights, or the dense params of one dtype."""

    def __init__(self, indices: List[int], params, rank: int, size: int, config: Zero1Config, packed: bool):
        self.indices = indices
        self.packed = packed
        layout = build_layout([params[i].numel() for i in indices], size, bucket_numel=config.bucket_numel,
                              align=config.align)
        first = params[indices[0]]
        self.buf = ShardBuffer(layout, rank, packed=packed, param_dtype=first.dtype, device=first.device)


class _ParamStorage:
    """Which tensors back each parameter (an NVFP4 weight's fields, a dense parameter's data), to put back."""

    def __init__(self, params):
        self.saved = [(p, {f: getattr(p, f) for f in FIELDS}) if is_nvfp4_tensor(p) else (p, p.data)
                      for p in params]  # fmt: skip

    def restore(self) -> None:
        for p, old in self.saved:
            if isinstance(old, dict):
                for f, t in old.items():
                    setattr(p, f, t)
            else:
                p.data = old


def _normalise_groups(params) -> List[dict]:
    if params is None or isinstance(params, torch.Tensor):
        raise TypeError("Zero1Optimizer params must be an iterable of parameters or of param-group dicts (as for "
                        f"torch.optim), got {type(params).__name__}; e.g. model.parameters()")
    params = list(params)
    if not params:
        raise ValueError("Zero1Optimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    return [dict(g, params=list(g["params"])) for g in params]


def _split_names(groups: List[dict]) -> List[Optional[str]]:
    """Take the names out of groups given as ``model.named_parameters()`` (name, parameter) pairs, in place."""
    names = []
    for g in groups:
        plain = []
        for entry in g["params"]:
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                names.append(entry[0])
                plain.append(entry[1])
            else:
                names.append(None)
                plain.append(entry)
        g["params"] = plain
        g.pop("param_names", None)
    return names


def _structure(params, groups: List[dict], config: Zero1Config) -> dict:
    """What must be the same on every rank for the shard buffers and collectives to line up."""
    return {
        "number of parameters": len(params),
        "parameter shapes": [list(p.shape) for p in params],
        "parameter dtypes": [str(p.dtype) for p in params],
        "NVFP4 parameters": [is_nvfp4_tensor(p) for p in params],
        "NVFP4 numerics": [getattr(p, "numerics", None) for p in params],
        "amax groups": [str(group_of(p)) if group_of(p) else None for p in params],
        "requires_grad": [p.requires_grad for p in params],
        "param group sizes": [len(g["params"]) for g in groups],
        "config": config,
    }


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 over any ``torch.optim`` optimizer, gathering NVFP4 weights as packed 4-bit bytes.

    A ``torch.optim.Optimizer``: ``param_groups`` holds the model's parameters with the inner optimizer's
    hyperparameters (an LR scheduler or a manual ``group["lr"] = ...`` reaches the inner optimizer at the next
    `step`), `state_dict` / `load_state_dict` are sharded per parameter for ``torch.distributed.checkpoint``
    (save and load at any world size; `fp4_dist.optim.zero1_state`), and `clip_grad_norm_` clips the reduced
    gradients. ``add_param_group`` is refused: the shard buffers are laid out once, at construction. Without any
    NVFP4 weight among the parameters (`fp4_dist.convert_linear_weights` not called first) it is plain ZeRO-1, and
    construction warns.

    Args:
        params: parameters or param-group dicts (as for torch.optim); the same list on every rank.
        make_optimizer: builds the inner optimizer from param groups of fp32 master-shard views,
            e.g. ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``. Group options are passed through.
        group: data-parallel process group (None: default group, or a single process).
        config: `Zero1Config`.
        master_init: per parameter (same order as ``params`` flattened) the full-precision initial value,
            or None to start from the parameter's current value (an NVFP4 weight's dequantized value).
            Must be identical on every rank; each rank copies its shard.
        stats: optional `CommStats` that records every collective this optimizer issues.
    """

    # torch.amp.GradScaler.step hands such an optimizer its verdict instead of skipping step() on one rank alone:
    # step() refuses it (below) on every rank at once.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, make_optimizer: Callable[[List[dict]], torch.optim.Optimizer], *,
                 group=None, config: Zero1Config = Zero1Config(),
                 master_init: Optional[Sequence[Optional[torch.Tensor]]] = None, stats: Optional[CommStats] = None):
        groups = _normalise_groups(params)
        given_names = _split_names(groups)
        self.params = [p for g in groups for p in g["params"]]
        self.names = [weight_name(p, i, n) for i, (p, n) in enumerate(zip(self.params, given_names))]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed more than once (tied weights?); pass each parameter once, e.g. "
                             "list(dict.fromkeys(model.parameters())) — a shared tensor must own one shard slot")
        self.group, self.config, self.stats = group, config, stats
        self.rank, self.world_size = rank_and_size(group)
        check_same_on_every_rank(_structure(self.params, groups, config), group, "Zero1Optimizer")
        self._reduce = GRAD_REDUCTIONS[config.grad_reduction]
        self._sections = self._build_sections()
        self._init_masters(master_init)
        self.optimizer = make_optimizer(self._inner_groups(groups))
        if len(self.optimizer.param_groups) != len(groups):
            raise ValueError(f"make_optimizer returned an optimizer with {len(self.optimizer.param_groups)} param "
                             f"groups for the {len(groups)} it was given; build it from exactly those groups")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._grads_reduced = False
        self._reduced_from: Optional[list] = None  # the gradients `clip_grad_norm_` reduced (`_reduce_all_grads`)
        self._published: list = []  # the parameters' version counters when this optimizer last wrote them
        self._present = [False] * len(self.params)  # this rank's: requires_grad and a gradient, this step
        self._check = _GradCheck(self)
        self.skipped_steps = 0
        """Steps skipped for non-finite gradients (``Zero1Config.nonfinite_grads="skip"``)."""
        self.last_step_skipped = False
        self._constructing = True
        # torch.optim bookkeeping over the model's parameters, with the hyperparameters the inner optimizer chose.
        super().__init__([dict({k: v for k, v in inner.items() if k != "params"}, params=g["params"])
                          for g, inner in zip(groups, self.optimizer.param_groups)], dict(self.optimizer.defaults))
        self._constructing = False
        fp4 = self._fp4_section()
        self.nvfp4_params = [self.params[i] for i in fp4.indices] if fp4 else []
        saved = _ParamStorage(self.params)  # a construction that raises leaves every parameter as it was
        self._cast: Optional[ShardedCast] = None
        self._subset_casts: Dict[tuple, ShardedCast] = {}  # casts of the weights some steps change
        try:
            if fp4:
                for j, w in enumerate(self.nvfp4_params):
                    w.set_rowwise_storage(fp4.buf.param_view(j))
                # Built once: plans, bound launches (views into the buffers), the amax and scale exchange buffers.
                self._cast = ShardedCast.from_buffer(self.nvfp4_params, fp4.buf, columnwise=config.columnwise)
            self._bind_dense_params()
            self._publish_params()
        except BaseException:
            saved.restore()
            raise
        if not fp4:  # the same verdict on every rank: the agreement check compared which parameters are NVFP4
            dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.params}))
            warnings.warn(f"Zero1Optimizer: none of the {len(self.params)} parameters is an NVFP4 weight, so nothing "
                          f"is all-gathered in 4 bits (they train as plain ZeRO-1 in {dtypes}); call "
                          "fp4_dist.convert_linear_weights(model) before building the optimizer (or, for plain ZeRO-1 "
                          "on purpose, filter this warning)", UserWarning, stacklevel=user_stacklevel())

    @property
    def state(self) -> dict:
        """The inner optimizer's per-parameter state, by model parameter (what tools that inspect
        ``optimizer.state`` look at; torch's state-dict helpers step an optimizer whose state is empty)."""
        inner = getattr(self, "optimizer", None)
        if inner is None or not hasattr(self, "_master_pieces"):
            return {}
        return {self.params[i]: inner.state[piece] for i, piece in self._master_pieces.items()
                if piece in inner.state}  # fmt: skip

    @state.setter
    def state(self, value) -> None:
        """torch.optim.Optimizer.__init__ assigns an empty state; the state lives in the inner optimizer."""

    # --------------------------------------------------------------------------------------- construction
    def _build_sections(self) -> List[_Section]:
        fp4 = [i for i, p in enumerate(self.params) if is_nvfp4_tensor(p)]
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(self.params):
            if not is_nvfp4_tensor(p):
                by_dtype.setdefault(p.dtype, []).append(i)
        sections = [_Section(fp4, self.params, self.rank, self.world_size, self.config, True)] if fp4 else []
        sections += [_Section(idx, self.params, self.rank, self.world_size, self.config, False)
                     for idx in by_dtype.values()]
        return sections

    def _fp4_section(self) -> Optional[_Section]:
        return next((s for s in self._sections if s.packed), None)

    def _init_masters(self, master_init) -> None:
        if master_init is not None and len(master_init) != len(self.params):
            raise ValueError(f"master_init has {len(master_init)} entries for {len(self.params)} parameters")
        for sec in self._sections:
            for j, i in enumerate(sec.indices):
                piece = sec.buf.pieces[j]
                if piece is None:
                    continue
                p = self.params[i]
                init = master_init[i] if master_init is not None and master_init[i] is not None else None
                if init is None:
                    init = p.dequantize(torch.float32) if sec.packed else p.detach()
                if tuple(init.shape) != tuple(p.shape):
                    raise ValueError(f"master_init[{i}] has shape {list(init.shape)}, its parameter {list(p.shape)}")
                flat = init.detach().reshape(-1)[piece.span.start:piece.span.end]
                sec.buf.master_piece(j).copy_(flat.to(torch.float32))

    def _inner_groups(self, groups: List[dict]) -> List[dict]:
        """The user's param groups with each parameter replaced by this rank's master piece (grad bound once)."""
        where = {}
        for sec in self._sections:
            for j, i in enumerate(sec.indices):
                where[i] = (sec, j)
        out, k = [], 0
        self._master_pieces: Dict[int, torch.Tensor] = {}  # parameter index -> the inner optimizer's tensor
        for g in groups:
            pieces = []
            for _ in g["params"]:
                sec, j = where[k]
                piece = sec.buf.master_piece(j)
                if piece is not None:
                    piece.grad = sec.buf.grad_shard_piece(j)
                    pieces.append(piece)
                    self._master_pieces[k] = piece
                k += 1
            # torch.optim refuses empty groups; a rank may own nothing of a small group.
            out.append(dict(g, params=pieces or [torch.zeros(0, device=self.params[0].device)]))
        return out

    def _bind_dense_params(self) -> None:
        for sec in self._sections:
            if sec.packed:
                continue
            for j, i in enumerate(sec.indices):
                p = self.params[i]
                p.data = sec.buf.param_view(j).view(p.shape)

    def add_param_group(self, param_group: dict) -> None:
        if not self._constructing:
            raise NotImplementedError(
                "Zero1Optimizer lays out its shard and gather buffers once, for the parameters it was built with; "
                "it cannot take a param group later. Build it with every group (param-group dicts) from the start")
        super().add_param_group(param_group)

    # ------------------------------------------------------------ what its checkpoints (zero1_state) read
    @property
    def device(self) -> torch.device:
        """Where the master shards live."""
        return self._sections[0].buf.master.device

    @property
    def master_pieces(self) -> Dict[int, torch.Tensor]:
        """parameter index -> this rank's piece of its fp32 master: the tensor the inner optimizer keys its state
        by (empty before the masters exist)."""
        return getattr(self, "_master_pieces", {})

    def param_index(self, p: torch.Tensor) -> int:
        """The index of parameter `p` in `params` (checkpoints name parameters by it)."""
        return self._index[id(p)]

    def every_rank_pieces(self) -> Dict[int, List[Tuple[int, int, int]]]:
        """parameter index -> [(group rank, start, numel)] of every rank's piece of it, from the shared layouts."""
        out: Dict[int, List[Tuple[int, int, int]]] = {i: [] for i in range(len(self.params))}
        for sec in self._sections:
            for r in range(self.world_size):
                for j, piece in enumerate(sec.buf.layout.pieces(r)):
                    if piece is not None:
                        out[sec.indices[j]].append((r, piece.span.start, piece.span.numel))
        return out

    def after_load(self) -> None:
        """After a load changed the masters and hyperparameters: hand the hyperparameters to the inner optimizer,
        then cast and gather the weights from the loaded masters."""
        self._sync_hyperparameters()
        self._publish_params()

    def _sync_hyperparameters(self) -> None:
        """This optimizer's param_groups are the ones users and LR schedulers change; the inner optimizer steps."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    # ----------------------------------------------------------------------------------------------- step
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads_reduced = False
        self._reduced_from = None
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Reduce grads (unless `clip_grad_norm_` did), check them, step the inner optimizer on the master shard
        with this optimizer's hyperparameters, re-quantize and gather the params.

        As for a torch.optim optimizer, a parameter without a gradient is not stepped (no weight decay, no moment
        update): one with ``requires_grad=False``, and one no rank produced a gradient for in this step (the ranks
        agree through the step's flag all-reduce; a rank without a gradient contributes zeros).

        Raises:
            ValueError naming the parameters whose reduced gradients hold inf or NaN, on every rank, before the
            inner optimizer runs (masters, optimizer state and weights unchanged), unless
            ``Zero1Config.nonfinite_grads="skip"``: then the step is skipped with a warning. ValueError naming the
            weight, on every rank, when the inner optimizer made a master non-finite from finite gradients (the
            weights were cast from it in this step: resume from a checkpoint); raised by this call, so no forward
            reads those weights.
        """
        if closure is not None:
            raise ValueError("Zero1Optimizer.step does not take a closure; run forward/backward before step()")
        if hasattr(self, "found_inf") or hasattr(self, "grad_scale"):  # set by torch.amp.GradScaler.step
            for name in ("found_inf", "grad_scale"):
                self.__dict__.pop(name, None)
            raise RuntimeError(
                "Zero1Optimizer.step under torch.amp.GradScaler: the scaler checks each rank's own gradients, before "
                "they are reduced, so the ranks would skip different steps and reduce gradients of different steps "
                "together. Train with bf16 autocast, which needs no loss scaling; "
                "Zero1Config(nonfinite_grads=\"skip\") skips a step whose reduced gradients hold inf or NaN, on every "
                "rank together")
        clipped = self._grads_reduced
        if self._reduce_all_grads() and clipped:
            warnings.warn("Zero1Optimizer.step: the gradients changed after clip_grad_norm_ reduced them (zeroed, or "
                          "another backward), so this step reduced them again and uses them unclipped; call "
                          "clip_grad_norm_ after the last backward", UserWarning, stacklevel=user_stacklevel())
        self._grads_reduced, self._reduced_from = False, None
        written = [i for i, p in enumerate(self.params) if p._version != self._published[i]]
        absent = self._check.run(written)  # the step's read of its gradients' state
        self.last_step_skipped = absent is None
        if absent is None:
            return
        self._sync_hyperparameters()
        pieces = [self._master_pieces[i] for i in absent if i in self._master_pieces]
        grads = [p.grad for p in pieces]
        for p in pieces:  # torch.optim steps only what has a gradient
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in zip(pieces, grads):
                p.grad = g
        self._publish_params(frozen=absent, after_step=True)

    def _reduce_all_grads(self, remember: bool = False) -> bool:
        """Reduce the gradients unless `clip_grad_norm_` reduced these same ones (it passes `remember`): gradients
        zeroed or replaced since (``model.zero_grad()``, a backward of another batch) are reduced again, not the
        discarded ones used. Returns whether it reduced."""
        same = self._reduced_from is not None and all(a is b or (a and b and a[0] is b[0] and a[1] == b[1])
                                                      for a, b in zip(self._grad_refs(), self._reduced_from))
        if self._grads_reduced and same:
            return False
        for sec in self._sections:
            self._reduce_grads(sec)
        self._grads_reduced, self._reduced_from = True, self._grad_refs() if remember else None
        return True

    def _grad_refs(self) -> list:
        # The tensors themselves, held: a freed gradient's id can come back with the next batch's.
        return [(g, g._version) if (g := p.grad) is not None else None for p in self.params]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` over all parameters.

        Call it between ``backward()`` and `step`: it reduces the gradients now (step then uses them as they
        are) and scales this rank's reduced shard. Same formulas as torch: each parameter's norm, the norm of
        those norms, ``coef = min(max_norm / (total + 1e-6), 1)``. Bitwise equal to torch's on the same fp32
        gradients for every parameter a single rank holds whole (one process: all); a parameter split between
        ranks gets its norm from the ranks' partial norms (``(sum n_r^p)^(1/p)``), which can differ in the last
        bit. One all-reduce of one float per parameter.

        Returns:
            the total norm (fp32 scalar tensor, the same on every rank).
        """
        self._reduce_all_grads(remember=True)
        norm_type = float(norm_type)
        dev = self.device
        partial = torch.zeros(len(self.params), dtype=torch.float32, device=dev)
        pieces, where = [], []
        for sec in self._sections:
            for j, i in enumerate(sec.indices):
                g = sec.buf.grad_shard_piece(j)
                if g is not None:
                    pieces.append(g)
                    where.append(i)
        if pieces:
            norms = torch.stack(torch._foreach_norm(pieces, norm_type))
            idx = torch.tensor(where, dtype=torch.int64, device=dev)
            partial.index_copy_(0, idx, norms if norm_type == float("inf") else norms.pow(norm_type))
        if self.world_size > 1:
            (all_reduce_max_ if norm_type == float("inf") else all_reduce_sum_)(partial, self.group, self.stats)
        per_param = partial if norm_type == float("inf") else partial.pow(1.0 / norm_type)
        total = torch.linalg.vector_norm(per_param, norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                               "clipped; pass error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for sec in self._sections:
            sec.buf.grad_shard.mul_(coef)
        return total

    def _reduce_grads(self, sec: _Section) -> None:
        buf = sec.buf
        dst, src = [], []
        for j, i in enumerate(sec.indices):
            p = self.params[i]
            g = p.grad
            self._present[i] = g is not None and p.requires_grad
            if g is None or not p.requires_grad:
                replaced = getattr(self.params[i], "_fp4_dist_replaced_by", None)
                if replaced is not None:
                    raise ValueError(
                        f"parameter {i} of this Zero1Optimizer was replaced by the NVFP4 weight {replaced!r} "
                        "(fp4_dist.convert_linear_weights) after the optimizer was built, so it gets no gradient and "
                        "the new weight is not optimized: convert the model first, then build the optimizer")
                buf.grad_view(j).zero_()
            else:
                dst.append(buf.grad_view(j))
                src.append(g.reshape(-1))
        if dst:
            torch._foreach_copy_(dst, src)  # one fused launch on CUDA for all grads (dtype cast included)
        for b in range(len(buf.layout.buckets)):
            self._reduce(buf.bucket_grad_shard(b), buf.bucket_grad(b), self.group, self.stats)
        if self.config.average_grads and self.world_size > 1:
            buf.grad_shard.div_(self.world_size)

    def _cast_of(self, frozen: Sequence[int]) -> Optional[ShardedCast]:
        """The cast of the NVFP4 weights whose masters may have changed: all but the parameters in `frozen` (those
        no rank had a gradient for in a step), with every shared-amax group whole. All of them: the bound `_cast`;
        none: None; others: a cast built once per such set. A frozen weight keeps its bytes: its master did not
        change, and casting it again would only turn its -0 codes into +0 (the spec's code for a zero)."""
        fp4 = self._fp4_section()
        if fp4 is None:
            return None
        frozen = set(frozen)
        stepped = [j for j, i in enumerate(fp4.indices) if i not in frozen]
        if len(stepped) == len(fp4.indices):
            return self._cast
        groups = {group_of(self.nvfp4_params[j]) for j in stepped} - {None}
        changed = set(stepped)
        stepped = [j for j, w in enumerate(self.nvfp4_params) if j in changed or group_of(w) in groups]
        if not stepped:
            return None
        key = tuple(stepped)
        if key not in self._subset_casts:
            self._subset_casts[key] = self._cast.subset(stepped)
        return self._subset_casts[key]

    def _publish_params(self, *, frozen: Sequence[int] = (), after_step: bool = False) -> None:
        """Masters -> model params on every rank: the cast of the NVFP4 weights not `frozen` (`_cast_of`) + packed
        gather (none when nothing is cast: the packed bytes did not change), dense copy + gather.

        The cast's finite-master verdict: read before any byte is written, or `after_step` once the gathers are
        queued (the device keeps working through the read) and before this returns, so the caller's next forward
        never reads weights cast from a non-finite master; it raises naming the weight."""
        cast = self._cast_of(frozen)
        verdict = None
        if cast is not None:
            verdict = cast.cast(self.group, self.stats, defer_check=after_step)
            cast.gather_scales(self.group, self.stats)
        for sec in self._sections:
            if sec.packed and cast is None:
                continue
            for b in range(len(sec.buf.layout.buckets)):
                if not sec.packed:
                    sec.buf.shard_param_view(b).copy_(sec.buf.bucket_master(b))
                all_gather_inplace(sec.buf.bucket_param(b), self.group, self.stats)
        if cast is not None:
            cast.after_gather()
        self._published = [p._version for p in self.params]
        if verdict is not None and not bool(verdict):
            cast.core.raise_for(" after this optimizer step, from finite gradients: the inner optimizer made them "
                                "(check its hyperparameters)")

    # ---------------------------------------------------------------------------------------- reporting
    def gathered_bytes_per_step(self) -> Dict[str, int]:
        """Bytes each step's param all-gathers produce on every rank, bucket padding included.

        Returns:
            {"nvfp4": packed NVFP4 bytes, "nvfp4_scales": compact tile scale bytes (all ranks),
             "dense": dense-param bytes (their own dtype),
             "bf16_equivalent": the same elements gathered as bf16, Megatron's default}.
        """
        nbytes = {True: 0, False: 0}
        for sec in self._sections:
            nbytes[sec.packed] += sec.buf.param.numel() * sec.buf.param.element_size()
        bf16 = sum(sec.buf.layout.total * 2 for sec in self._sections)
        scales = self._cast.gathered.numel() if self.nvfp4_params else 0
        return {"nvfp4": nbytes[True], "nvfp4_scales": scales, "dense": nbytes[False], "bf16_equivalent": bf16}

    def param_memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for the model's parameters: {"nvfp4": the packed gather buffer, "dense": the
        dense params' buffers, "compute_copies": the NVFP4 weights' model-dtype compute copies}."""
        from ..tensor.copy import compute_copy_bytes

        nbytes = {True: 0, False: 0}
        for sec in self._sections:
            nbytes[sec.packed] += sec.buf.param.numel() * sec.buf.param.element_size()
        return {"nvfp4": nbytes[True], "dense": nbytes[False], "compute_copies": compute_copy_bytes(self.nvfp4_params)}

    def full_masters(self) -> List[torch.Tensor]:
        """Every parameter's full fp32 master value (shape of the parameter), assembled from all ranks.

        Collective (one all-gather per bucket): call it on every rank, e.g. for checkpoints or parity checks.
        """
        out: List[Optional[torch.Tensor]] = [None] * len(self.params)
        for sec in self._sections:
            layout = sec.buf.layout
            full = torch.empty(layout.total, dtype=torch.float32, device=sec.buf.master.device)
            for b, bucket in enumerate(layout.buckets):
                all_gather_into(full[bucket.span.start:bucket.span.end], sec.buf.bucket_master(b), self.group)
            for j, i in enumerate(sec.indices):
                span = layout.weights[j].span
                out[i] = full[span.start:span.end].view(self.params[i].shape)
        return out

    def state_dict(self) -> dict:
        """Masters, inner optimizer state and hyperparameters, sharded per parameter for
        ``torch.distributed.checkpoint`` (save at one world size, load at any; a collective when distributed).
        See `fp4_dist.optim.zero1_state`. The optimizer is Stateful: ``dcp.save({"optimizer": opt}, ...)`` and
        ``dcp.load({"optimizer": opt}, ...)`` work as for a torch optimizer, a fresh one included."""
        from .zero1_state import sharded_state_dict

        _refuse_torch_state_dict_api("get_state_dict")
        return sharded_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict` (after ``torch.distributed.checkpoint.load`` filled it), then cast and gather."""
        from .zero1_state import load_sharded_state_dict

        _refuse_torch_state_dict_api("set_state_dict")
        load_sharded_state_dict(self, state_dict)

    def local_state_dict(self) -> dict:
        """This rank's state alone (inner optimizer state and its master shards), for ``torch.save`` per rank
        and `load_local_state_dict` at the same world size and layout."""
        return {"optimizer": self.optimizer.state_dict(), "masters": [s.buf.master.clone() for s in self._sections]}

    def load_local_state_dict(self, state: dict) -> None:
        masters = state["masters"]
        if len(masters) != len(self._sections) or any(
                m.shape != s.buf.master.shape for m, s in zip(masters, self._sections)):
            raise ValueError("state_dict was saved with another parameter list, world size or bucket layout")
        for m, s in zip(masters, self._sections):
            s.buf.master.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        self._publish_params()


def _refuse_torch_state_dict_api(name: str) -> None:
    """torch.distributed.checkpoint.state_dict's get/set_state_dict reshape an optimizer's state assuming
    torch's own layout (a list of param groups, state keyed by parameter) and fail inside torch on ours
    (``TypeError: string indices must be integers``); say what to do instead, before that."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/distributed/checkpoint/state_dict.py"):
            raise TypeError(
                f"torch.distributed.checkpoint.state_dict.{name} does not support Zero1Optimizer: its state is "
                "sharded per rank in a layout of its own. Pass the optimizer itself to DCP, which calls its "
                "state_dict/load_state_dict: dcp.save({\"model\": get_model_state_dict(model), \"optimizer\": opt}, "
                "checkpoint_id=path) and dcp.load({...same keys...}, checkpoint_id=path), then "
                "set_model_state_dict(model, ...) for the model part")
        frame = frame.f_back


class _GradCheck:
    """The step's check of its reduced gradients, in one MAX all-reduce and one read of::

        [ gradient present, per parameter | gradient shard not finite, per buffer ]

    A present flag is 1 where the rank has a gradient for the parameter; the MAX says whether any rank has. A
    buffer's flag is 1 where this rank's reduced shard of it holds inf or NaN (the reduce-scatter carries any
    rank's into the owner's shard). With gradients checked, only the inner optimizer can make a master non-finite;
    the step reads the cast's verdict at its end. Naming the parameters behind a bad flag takes a second
    all-reduce, on the error path only.
    """

    def __init__(self, opt: "Zero1Optimizer"):
        self.opt = opt
        n, dev = len(opt.params), opt.device
        self.flags = torch.zeros(n + 1 + len(opt._sections), dtype=torch.float32, device=dev)
        self.presence = torch.zeros(n + 1, dtype=torch.float32, device=dev)
        self._pattern: Optional[list] = None
        self._staging = None  # the pinned source of the last presence upload, alive until it lands

    def _upload_presence(self, present: list) -> None:
        """Presence changes rarely (a frozen layer, an unused branch): upload it only when it does."""
        if present == self._pattern:
            return
        host = torch.tensor(present, dtype=torch.float32)
        if self.presence.is_cuda:
            host = host.pin_memory()
        self.presence.copy_(host, non_blocking=True)
        self._staging, self._pattern = host, list(present)

    def run(self, written: List[int]) -> Optional[List[int]]:
        """The parameters to leave out of this step (no rank has a gradient), or None to skip the step; raises
        for non-finite gradients (the default), and when some rank's parameters were `written` since the optimizer
        last set them (the flag after the presence)."""
        opt, n, sections = self.opt, len(self.opt.params), self.opt._sections
        self._upload_presence([*opt._present, bool(written)])
        flags = self.flags
        flags[:n + 1].copy_(self.presence)
        for k, sec in enumerate(sections):
            torch.logical_not(torch.isfinite(sec.buf.grad_shard).all(), out=flags[n + 1 + k])
        all_reduce_max_(flags, opt.group, opt.stats)
        values = flags.tolist()  # the step's read of its gradients' state
        if values[n]:
            self._written(written)
        if any(values[n + 1:]):
            return self._nonfinite(self._bad_parameters())
        return [i for i in range(n) if not values[i]]

    def _written(self, written: List[int]) -> None:
        opt = self.opt
        names = ", ".join(opt.names[i] for i in written[:8]) + (
            f" and {len(written) - 8} more" if len(written) > 8 else "")  # fmt: skip
        raise ValueError(
            "Zero1Optimizer.step: the model's parameters were written since the optimizer last set them "
            f"({'here: ' + names if names else 'on another rank'}), e.g. by model.load_state_dict after the optimizer "
            "was built. Its fp32 masters hold the weights, and this step would have cast them over the write; the "
            "step was not taken on any rank. Load the weights before building the optimizer, or restore a checkpoint "
            "through the optimizer (Zero1Optimizer.load_state_dict, fp4_dist.checkpoint), which sets the masters")

    def _bad_parameters(self) -> List[int]:
        """The parameters whose reduced gradient holds inf or NaN on some rank (every rank is here together)."""
        opt = self.opt
        bad = torch.zeros(len(opt.params), dtype=torch.float32, device=self.flags.device)
        for sec in opt._sections:
            for j, i in enumerate(sec.indices):
                g = sec.buf.grad_shard_piece(j)
                if g is not None:
                    bad[i] = torch.logical_not(torch.isfinite(g).all()).float()
        all_reduce_max_(bad, opt.group, opt.stats)
        return [i for i, b in enumerate(bad.tolist()) if b]

    def _nonfinite(self, bad: List[int]) -> None:
        opt = self.opt
        names = ", ".join(opt.names[i] for i in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        if opt.config.nonfinite_grads == "skip":
            opt.skipped_steps += 1
            warnings.warn(f"Zero1Optimizer: skipped step (skipped steps so far: {opt.skipped_steps}): the gradients "
                          f"of {names} hold inf or NaN on some rank; masters, optimizer state and weights are "
                          "unchanged", RuntimeWarning, stacklevel=user_stacklevel())
            return None
        raise ValueError(
            f"Zero1Optimizer.step: the gradients of {names} hold inf or NaN (non-finite) on some rank, so the step "
            "was not taken on any rank: masters, optimizer state and weights are unchanged. Find the cause (learning "
            "rate, loss scale, data), or pass Zero1Config(nonfinite_grads=\"skip\") to skip such steps as "
            "torch.amp.GradScaler does")
