"""Training checkpoints that a killed process cannot spoil: torch.distributed.checkpoint (DCP) folders committed
whole, one per step under a root, and the newest complete one found again on restart.

    root/step_00000040/                 .metadata, __0_0.distcp, __1_0.distcp, ...      complete
    root/.step_00000060.tmp-<writer>/   a save in progress, or one whose job was killed: never read

DCP writes ``.metadata`` last: rank 0, once every rank has written and fsynced its files, through a temporary file
and a rename. So a DCP folder holding ``.metadata`` is complete, unless a later save wrote into the same folder:
that save overwrites the data files in place under the earlier ``.metadata`` and, killed, leaves a mixture that
still looks complete. `save` therefore writes into a temporary folder beside the target and renames it into
place once DCP returns on every rank (`fp4_dist.checkpoint.atomic.swap_in`): the target holds the earlier checkpoint
or the new one at every instant. `latest_complete_checkpoint` takes the newest ``step_*`` folder that holds
``.metadata`` and names the ones it skipped.

Each rank hashes the files it wrote (DCP names them ``__<rank>_<n>.distcp``) while they are in its page cache, and
rank 0 writes the folder's manifest from those digests and its own before the rename
(`fp4_dist.checkpoint.manifest`), so no rank reads another host's files. The first save takes the root's lock
(`fp4_dist.checkpoint.lock`): one job writes into a root.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from . import atomic, manifest
from .lock import lock_root

__all__ = ["StepCheckpoint", "step_folder", "save", "latest_complete_checkpoint"]

METADATA = ".metadata"
_ENTRY = re.compile(r"step_(\d+)|\.step_(\d+)\.(tmp|old)-.+")  # a step folder, or what a save leaves beside it
_DIGITS = 8  # step_folder's zero padding


@dataclass(frozen=True)
class StepCheckpoint:
    """The checkpoint a run resumes from."""

    step: int
    """The step number in its folder's name (the number of steps trained when it was saved, by the recipe)."""
    path: Path
    """Its folder: pass it to ``dcp.load`` / `fp4_dist.optim.load_checkpoint`."""
    skipped: list[str] = field(default_factory=list)
    """What was passed over on the way, newest first, each with the reason: newer ``step_*`` folders without
    ``.metadata`` and the temporary folders of newer saves that did not finish."""


def step_folder(root, step: int) -> Path:
    """``root/step_<step, 8 digits>``: the folder of the checkpoint saved after `step` steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (a count of steps trained), got {step}")
    return Path(root) / f"step_{step:0{_DIGITS}d}"


def save(state_dict: dict[str, Any], path, *, process_group=None, take_over_other_host: bool = False) -> Path:
    """``torch.distributed.checkpoint.save(state_dict, checkpoint_id=path)`` committed whole, with a manifest of
    its files (collective: every rank of `process_group` calls). The first save into a root (`path`'s parent)
    takes the root's lock (`fp4_dist.checkpoint.lock.lock_root`; `take_over_other_host` as there): another job
    holding it raises RootLockedError on every rank before anything is written. DCP writes into a temporary folder
    beside `path` that rank 0 names; once ``dcp.save`` returns (every rank has written), rank 0 writes the manifest
    and renames the folder to `path`, replacing an earlier checkpoint there whole, and every rank returns after
    that. A job killed at any point leaves at `path` the earlier checkpoint (or none) or this one, never a part;
    what it leaves beside `path` is never read, and the next job to lock the root deletes it.

    Returns:
        `path` as a Path.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    lock_root(path.parent, take_over_other_host=take_over_other_host, process_group=process_group)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    box = [str(atomic.temporary_folder(path)) if rank == 0 else None]
    if distributed:  # one name for all ranks; rank 0's (a .tmp- name carries its host and pid)
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)  # fmt: skip
    tmp = Path(box[0])
    dcp.save(state_dict, checkpoint_id=tmp, process_group=process_group)
    mine = {p.name: manifest.file_digest(p) for p in sorted(tmp.glob(f"__{rank}_*"))}
    digests = [mine]
    if distributed:
        digests = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(digests, mine, group=process_group)
    if rank == 0:  # DCP's save ends when rank 0 has every rank's write results and has written .metadata
        atomic.swap_in(tmp, path, digests={k: v for d in digests for k, v in d.items()})
    if distributed:
        dist.barrier(group=process_group)  # no rank goes on (and reads `path`) before it is in place
    return path


def latest_complete_checkpoint(root) -> Optional[StepCheckpoint]:
    """The newest ``root/step_*`` folder that holds a complete DCP checkpoint (its ``.metadata``), or None when
    there is none (or no `root`). What it passes over on the way is named in the result and in a warning (on
    rank 0): newer ``step_*`` folders without ``.metadata`` (a plain ``dcp.save`` killed mid-write) and the
    temporary folders of newer `save` calls that did not finish. A ``step_*`` folder missing because a `save`
    replacing it was stopped between its two renames is read from its earlier version
    (`fp4_dist.checkpoint.atomic.resolve`).
    """
    root = Path(root)
    entries: dict[int, dict[str, list[Path]]] = {}
    skipped, odd = [], []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = _ENTRY.fullmatch(p.name)
        if m and p.is_dir():
            step, kind = (m.group(1), "") if m.group(1) else (m.group(2), m.group(3))
            if step != f"{int(step):0{_DIGITS}d}":  # step_12: not this module's name, and not read as step 12
                odd.append(f"{p} (not a name step_folder gives: step_<the step, {_DIGITS} digits>)")
                continue
            entries.setdefault(int(step), {}).setdefault(kind, []).append(p)
    for step in sorted(entries, reverse=True):
        kinds = entries[step]
        skipped += [f"{p} (a save of step {step} that did not finish)" for p in kinds.get("tmp", [])]
        folder = step_folder(root, step)
        if "" in kinds or "old" in kinds:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # said below with the rest
                found = atomic.resolve(folder)
            if (found / METADATA).is_file():
                if found != folder:
                    skipped.append(f"{folder} (missing: a save replacing it was stopped between its renames; "
                                   f"reading its earlier version {found.name})")
                _note(f"resuming from {found}", skipped + odd)
                return StepCheckpoint(step, found, skipped + odd)
            skipped.append(f"{folder} (no {METADATA}: its save did not finish)")
    _note(f"no complete checkpoint under {root}", skipped + odd)
    return None


def _note(head: str, skipped: list[str]) -> None:
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"fp4_dist: {head}; skipped " + "; ".join(skipped), UserWarning, stacklevel=3)
