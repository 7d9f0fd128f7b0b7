"""Zero1Optimizer's checkpoint state: per-parameter sharded tensors that `torch.distributed.checkpoint` (DCP)
saves at one world size and loads at another.

Each rank owns one contiguous range of each parameter's flat elements, or none: its fp32 master piece and the
inner optimizer's per-element state of that piece (Adam's ``exp_avg``, ...). `sharded_state_dict` describes
every parameter's master and per-element state as a ShardedTensor of the parameter's full numel whose local
shard is this rank's piece at its element offset; the other ranks' pieces are in the global metadata, computed
from the buffer layout (no collective per tensor). Scalar state (Adam's ``step``) and hyperparameters are plain
values, the same on every rank. DCP writes each element once and, at load, reads the range the loading rank
owns, whatever the world size, bucket size or alignment of either run::

    {"state": {parameter index: {"master": ShardedTensor[numel], key: ShardedTensor[numel] or a tensor}},
     "param_groups": JSON text [{hyperparameters..., "params": [parameter index, ...]}, ...],
     "fp4_dist": JSON text {"format": 1, "state_keys": {parameter index: [per-element keys]}}}

The non-tensor parts are JSON strings, single leaves: DCP flattens nested lists and dicts of plain values
differently when it saves and when it loads (a load then asks for keys the checkpoint does not have).

Why not plain tensors: DCP treats a plain tensor with the same key on every rank as replicated and keeps one
copy, so per-rank master shards saved that way come back as some other rank's shard (the corruption this
replaces). A fresh optimizer has no per-element state yet, so before its state dict is made that state is
materialized as its first step would create it (`materialize_fresh_state`, as torch's ``get_state_dict`` does for
torch optimizers): ``dcp.load({"optimizer": opt})`` into a new optimizer then loads every entry. State keys
that only a later step creates come from the checkpoint's own metadata in `load_checkpoint`, and
`load_sharded_state_dict` refuses a state dict that lacks keys the checkpoint has (rather than silently
starting from zero moments).
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..checkpoint import atomic, manifest, safe_dcp, steps as checkpoint
from ..cast.collectives import in_distributed_job

try:
    from torch.distributed._shard._utils import DEPRECATE_MSG
except ImportError:  # the text torch 2.4-2.13 warn with
    DEPRECATE_MSG = "Please use DTensor instead and we are deprecating ShardedTensor."

FORMAT = 1
_PieceMap = Dict[int, List[Tuple[int, int, int]]]  # parameter index -> [(group rank, start, numel)]


def _distributed(opt) -> bool:
    return in_distributed_job() and opt.world_size > 1


def _all_pieces(opt) -> _PieceMap:
    """Every rank's piece of every parameter, from the (shared) layouts."""
    return opt.every_rank_pieces()


def _local_pieces(opt) -> Dict[int, torch.Tensor]:
    """parameter index -> this rank's master piece: the tensor the inner optimizer keys its state by."""
    return opt.master_pieces


def _per_element_keys(state: dict, piece: torch.Tensor) -> List[str]:
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1
                  and v.numel() == piece.numel())  # fmt: skip


class _Sharder:
    """Builds ShardedTensors of full parameters from this rank's pieces (global metadata from the layout)."""

    def __init__(self, opt, devices: List[str]):
        from torch.distributed._shard.metadata import ShardMetadata

        self.opt, self.pieces = opt, _all_pieces(opt)
        group_ranks = [dist.get_global_rank(opt.group, r) if opt.group is not None else r
                       for r in range(opt.world_size)]  # fmt: skip
        self.meta = {i: [ShardMetadata([start], [n], f"rank:{group_ranks[r]}/{devices[r]}") for r, start, n in ps]
                     for i, ps in self.pieces.items()}  # fmt: skip

    def __call__(self, i: int, local: Optional[torch.Tensor], dtype: torch.dtype):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        numel = self.opt.params[i].numel()
        mine = [(md, local) for (r, _, _), md in zip(self.pieces[i], self.meta[i]) if r == self.opt.rank]
        shards = [Shard(t.reshape(-1), md) for md, t in mine if t is not None]
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
        meta = ShardedTensorMetadata(self.meta[i], torch.Size([numel]), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=self.opt.group)


def _quiet_sharded_tensor_deprecation() -> None:
    """DCP's planners warn once per call site for every ShardedTensor they touch ("Please use DTensor instead");
    ours are the only form that fits a rank's uneven contiguous piece of a flat parameter (a DTensor shards
    evenly), so that exact warning says nothing a user can act on. Filter exactly it, once a Zero1Optimizer
    hands DCP its first ShardedTensor."""
    warnings.filterwarnings("ignore", message=re.escape(DEPRECATE_MSG), category=FutureWarning)


def materialize_fresh_state(opt) -> None:
    """Give a fresh inner optimizer (no state yet) its per-parameter state, as its first step would create it,
    so that its state dict can ask a checkpoint for every entry (``dcp.load({"optimizer": opt})`` into a new
    optimizer, as torch's ``get_state_dict`` does for torch optimizers): one step on zero gradients with every
    learning rate 0, then every ``step`` count back to 0, and the masters restored bit for bit. The next real
    step then does what a fresh optimizer's first step does (Adam's zero moments, step 1)."""
    inner = opt.optimizer
    if inner.state or not opt.master_pieces:
        return
    pieces = list(opt.master_pieces.values())
    grads, masters = [p.grad for p in pieces], [p.detach().clone() for p in pieces]
    lrs = [g.get("lr") for g in inner.param_groups]
    try:
        for p in pieces:
            p.grad = torch.zeros_like(p)
        for g in inner.param_groups:
            if "lr" in g:
                g["lr"] = g["lr"] * 0 if isinstance(g["lr"], torch.Tensor) else 0.0
        inner.step()
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        with torch.no_grad():
            for p, g, m in zip(pieces, grads, masters):
                p.copy_(m)
                p.grad = g
    for st in inner.state.values():
        if "step" in st:
            st["step"] = st["step"].zero_() if isinstance(st["step"], torch.Tensor) else 0


def sharded_state_dict(opt) -> dict:
    """The optimizer's state as described in the module docstring (a collective when distributed: one small
    all-gather of every rank's device and state keys). A fresh optimizer's state is materialized first
    (`materialize_fresh_state`), so a checkpoint can be loaded into it the standard way."""
    materialize_fresh_state(opt)
    local = _local_pieces(opt)
    inner = opt.optimizer.state
    keys = {i: _per_element_keys(inner.get(piece, {}), piece) for i, piece in local.items()}
    device = str(opt.device)
    if _distributed(opt):
        _quiet_sharded_tensor_deprecation()
        gathered: List = [None] * opt.world_size
        dist.all_gather_object(gathered, (device, keys), group=opt.group)
        devices = [d for d, _ in gathered]
        union: Dict[int, set] = {}
        for _, k in gathered:
            for i, names in k.items():
                union.setdefault(i, set()).update(names)
        keys = {i: sorted(v) for i, v in union.items()}
        make = _Sharder(opt, devices)
    else:
        make = None
    state = {}
    for i in range(len(opt.params)):
        piece = local.get(i)
        st = inner.get(piece, {}) if piece is not None else {}
        entry = {"master": piece if make is None else make(i, piece, torch.float32)}
        for k in keys.get(i, []):
            v = st.get(k)
            if piece is not None and v is None:
                raise ValueError(f"parameter {i}: other ranks hold optimizer state {k!r} for it, this rank does not "
                                 "for its piece (was the inner optimizer stepped on every rank?)")
            entry[k] = v if make is None else make(i, v, v.dtype if v is not None else torch.float32)
        for k, v in st.items():  # scalars (Adam's step): plain, the same on every rank that steps this parameter
            if k not in entry:
                entry[k] = v
        state[i] = entry
    groups = [dict({k: _plain(v) for k, v in outer.items() if k != "params"},
                   params=[opt.param_index(p) for p in outer["params"]]) for outer in opt.param_groups]  # fmt: skip
    info = {"format": FORMAT, "state_keys": {str(i): k for i, k in keys.items()}}
    return {"state": state, "param_groups": json.dumps(groups), "fp4_dist": json.dumps(info)}


def _plain(v):
    """A hyperparameter as JSON can hold it (a tensor LR becomes its number; tuples become lists)."""
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _restore(new, old):
    """A JSON-loaded hyperparameter in the type the optimizer holds it in."""
    if isinstance(old, torch.Tensor):
        return old.fill_(new)
    if isinstance(old, tuple):
        return tuple(new)
    return new


def _local_tensor(v) -> Optional[torch.Tensor]:
    """This rank's data of a loaded entry: a ShardedTensor's local shard, or the tensor itself."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(v, ShardedTensor):
        shards = v.local_shards()
        return shards[0].tensor if shards else None
    return v


@torch.no_grad()
def load_sharded_state_dict(opt, sd: dict) -> None:
    """Put a (DCP-loaded) `sharded_state_dict` back: masters, the inner optimizer's state, hyperparameters; then
    cast and gather the parameters. Raises ValueError if it cannot restore everything the checkpoint holds."""
    try:
        info, saved_groups = json.loads(sd["fp4_dist"]), json.loads(sd["param_groups"])
    except (KeyError, TypeError, ValueError):
        info, saved_groups = {}, []
    if not isinstance(info, dict) or info.get("format") != FORMAT or "state" not in sd:
        raise ValueError("not a Zero1Optimizer state dict (fp4_dist format 1); Zero1Optimizer.local_state_dict() "
                         "output goes to load_local_state_dict()")
    if len(sd["state"]) != len(opt.params) or len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(sd['state'])} parameters in {len(saved_groups)} groups; "
                         f"this optimizer has {len(opt.params)} in {len(opt.param_groups)}")
    ours = [[opt.param_index(p) for p in g["params"]] for g in opt.param_groups]
    theirs = [g.get("params") for g in saved_groups]
    if theirs != ours:  # DCP loads only what this optimizer's state dict asks for: a bigger model's rest is dropped
        count = sum(len(p) for p in theirs if isinstance(p, list))
        raise ValueError(f"the checkpoint's optimizer holds {count} parameters in groups of "
                         f"{[len(p) if isinstance(p, list) else p for p in theirs]}; this one holds {len(opt.params)} "
                         f"in groups of {[len(p) for p in ours]} (a checkpoint of another model, or the parameters "
                         "passed in another grouping). DCP loads into this optimizer's own tensors, so its masters "
                         "and state may hold part of the checkpoint now: build it again (load_checkpoint checks "
                         "before it loads)")
    saved_keys = info.get("state_keys", {})
    local = _local_pieces(opt)
    inner = opt.optimizer.state
    for i, entry in sd["state"].items():
        i = int(i)
        piece = local.get(i)
        if piece is None:
            continue
        want = set(saved_keys.get(str(i), []))
        missing = sorted(k for k in want if _local_tensor(entry.get(k)) is None)
        if missing:
            raise ValueError(
                f"parameter {i}: the checkpoint holds optimizer state {missing} that this state dict could not "
                "take (this optimizer has no state yet, so its state_dict() did not ask for it); load with "
                "fp4_dist.optim.zero1_state.load_checkpoint(optimizer, path), which builds it from the checkpoint")
        piece.copy_(_local_tensor(entry["master"]))
        st = inner.setdefault(piece, {})
        for k, v in entry.items():
            if k == "master":
                continue
            t = _local_tensor(v)
            if k in want:
                st[k] = t.to(piece.device).clone()
            elif t is not None:
                st[k] = t.clone() if isinstance(t, torch.Tensor) else t
    for outer, saved in zip(opt.param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params":
                outer[k] = _restore(v, outer.get(k))
    opt.after_load()


def save_checkpoint(opt, path) -> None:
    """``torch.distributed.checkpoint.save`` of the optimizer's sharded state dict to ``path`` (collective),
    committed whole (`fp4_dist.checkpoint.save`): a job killed mid-save leaves ``path`` as it was, and an earlier
    checkpoint there is replaced at once. Save each checkpoint to a folder of its own
    (`fp4_dist.checkpoint.step_folder`) to keep the earlier ones."""
    checkpoint.save({"optimizer": sharded_state_dict(opt)}, path)


def load_checkpoint(opt, path, *, trusted: bool = False, verify: bool = True) -> None:
    """Load a `save_checkpoint` (or DCP) checkpoint saved at any world size into ``opt`` (collective): checks its
    files against its manifest (`fp4_dist.checkpoint.manifest`; `verify=False` skips it), builds the per-element
    optimizer state the checkpoint holds (an optimizer that has not stepped has none yet) from the checkpoint's
    metadata, loads, and restores as `load_sharded_state_dict`. Nothing stored in the checkpoint runs
    (`fp4_dist.checkpoint.safe_dcp`; `trusted=True` unpickles in full, as dcp.load does). A damaged file raises
    DamagedCheckpointError on every rank, naming it, before anything is read into ``opt``."""
    import torch.distributed.checkpoint as dcp

    path = atomic.resolve(path)
    if verify:
        manifest.verify_folder_collective(path)
    materialize_fresh_state(opt)
    reader = dcp.FileSystemReader(path) if trusted else safe_dcp.SafeReader(path)
    meta = reader.read_metadata().state_dict_metadata
    prefix = "optimizer.state."
    saved = {int(fqn[len(prefix):].split(".", 1)[0]) for fqn in meta if fqn.startswith(prefix)}
    if saved != set(range(len(opt.params))):  # before anything is loaded: DCP would fill ours and drop the rest
        raise ValueError(f"{path} holds optimizer state of {len(saved)} parameters; this optimizer has "
                         f"{len(opt.params)} (a checkpoint of another model?); nothing was loaded")
    meta_items = meta.items()
    local = _local_pieces(opt)
    for fqn, md in meta_items:
        if not fqn.startswith(prefix) or not hasattr(md, "size"):
            continue
        index, key = fqn[len(prefix):].split(".", 1)
        piece = local.get(int(index))
        if piece is None or key == "master":
            continue
        st = opt.optimizer.state.setdefault(piece, {})
        if key not in st:
            shape = tuple(md.size)
            dtype = md.properties.dtype
            st[key] = torch.zeros(piece.shape if shape == (opt.params[int(index)].numel(),) else shape,
                                  dtype=dtype, device=piece.device)  # fmt: skip
    sd = {"optimizer": sharded_state_dict(opt)}
    safe_dcp.load_distributed_checkpoint(sd, path, trusted=trusted, checked=None if trusted else reader,
                                         verify=False)  # verified above, before the metadata was read
    load_sharded_state_dict(opt, sd["optimizer"])
