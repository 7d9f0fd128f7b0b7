"""Checkpoints of an NVFP4 Megatron model and its DistributedOptimizer; resume continues bit for bit.

Folder layout (names follow Megatron's ``--ckpt-format torch`` so the files are familiar)::

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000010/common.pt           rank 0: iteration, run config, optimizer.state_dict() (param groups,
                                            step), LR scheduler state
    <save>/iter_0000010/distrib_optim.pt    Megatron's own DistributedOptimizer parameter state (fp32 masters
                                            and Adam moments, DP-rank-0 "dp_zero" format, written through
                                            ``optimizer.save_parameter_state``; element space, so independent
                                            of the packed NVFP4 layout)
    <save>/iter_0000010/model.pt            rank 0: the model weights, whole over data parallelism (the slices of
                                            its tensor-parallel rank, below); NVFP4 weights as their packed fields
                                            (rowwise_data, rowwise_scale_inv, amax), others as tensors
    <save>/iter_0000010/rng.pt              every rank's Python, NumPy, torch and tensor-parallel RNG states (rank 0
                                            writes them; a resume at another world size keeps its fresh seeds)

Under tensor parallelism each tensor-parallel rank holds its own slices of the weights and of the optimizer state:
``model.pt`` and ``distrib_optim.pt`` then go into ``iter_*/mp_rank_<tp rank, 2 digits>/``, each written by its
data-parallel rank 0, and a resume needs the same tensor-parallel size (the data-parallel size may change).

An iteration's folder is written whole into a temporary folder beside it and then renamed into place
(`fp4_dist.checkpoint.atomic`), and ``latest_checkpointed_iteration.txt`` moves on only after that: a process killed
at any instant of a save leaves every complete checkpoint as it was, also one of the same iteration being written
again (a load reads the earlier version while a rename is under way). A save refuses an iteration folder holding
files of anything else, since it replaces the folder whole, and names the temporary folders of killed saves that
it could not delete. The folder holds a manifest (``fp4_dist_manifest.json``: a digest of every file, each hashed by
the rank that wrote it), and a load checks every file against it before it reads one; the first save takes the
``--save`` folder's lock (`fp4_dist.checkpoint.lock`), so a second job saving there is refused.

The fp32 masters are the source of truth. Loading restores them and then re-casts every NVFP4 weight from
them and all-gathers (the same path as an optimizer step), so the bytes equal those of the run that saved;
`load_checkpoint` checks that against ``model.pt`` and raises if not. It reads every file weights-only, so a
checkpoint from elsewhere runs no code: one that holds anything but tensors, plain values and NumPy's RNG state is
refused (``--trust-checkpoint`` / ``trusted=True`` unpickles it in full).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from fp4_dist.checkpoint import atomic, lock_root, manifest
from fp4_dist.tensor import is_nvfp4_tensor
from fp4_dist.compare import bytes_mismatch
from fp4_dist.checkpoint.safe_load import load_checkpoint_file

LATEST = "latest_checkpointed_iteration.txt"
SAVED_BEFORE = {"tensor_model_parallel_size": 1}
"""Run settings that checkpoints written before they were recorded hold implicitly (only size 1 saved correctly)."""


def iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str) -> Optional[int]:
    path = Path(root) / LATEST
    return int(path.read_text().strip()) if path.is_file() else None


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """Weights of ``model`` by parameter name; NVFP4 weights as a dict of their packed fields (CPU copies)."""
    state = {}
    for name, p in model.named_parameters():
        if is_nvfp4_tensor(p):
            state[name] = {
                "shape": tuple(p.shape), "dtype": str(p.dtype), "numerics": p.numerics,
                "rowwise_data": p.rowwise_data.detach().cpu().clone(),
                "rowwise_scale_inv": p.rowwise_scale_inv.detach().cpu().clone(),
                "amax": p.amax.detach().cpu().clone(),
            }
        else:
            state[name] = p.detach().cpu().clone()
    return state


def compare_model_state(model: torch.nn.Module, saved: dict[str, Any]) -> list[str]:
    """Differences between ``model``'s weights and a `model_state` dict ('' list when identical)."""
    now = model_state(model)
    problems = sorted(set(now) ^ set(saved))
    problems = [f"{n}: present in only one of model / checkpoint" for n in problems]
    for name in sorted(set(now) & set(saved)):
        a, b = now[name], saved[name]
        pairs = ([(f"{name}.{f}", a[f], b[f]) for f in ("rowwise_data", "rowwise_scale_inv", "amax")]
                 if isinstance(a, dict) else [(name, a, b)])
        problems += [m for label, x, y in pairs if (m := bytes_mismatch(x, y, label))]
    return problems


def _numpy_rng_globals() -> tuple:
    """What pickle names for NumPy's RNG state (``np.random.get_state()``, whose keys are a uint32 array): the
    array's rebuild function, ndarray, dtype and the uint32 dtype class."""
    keys = np.random.get_state()[1]
    return keys.__reduce__()[0], np.ndarray, np.dtype, type(keys.dtype)


NUMPY_RNG_GLOBALS = _numpy_rng_globals()
"""What ``rng.pt`` may hold beyond torch's own types."""


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}  # dropout inside tensor-parallel regions
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, run_config: dict) -> Path:
    """Write a checkpoint of ``iteration`` (a collective: call on every rank with params already gathered).

    ``model`` is the DDP-wrapped model; with ``--overlap-param-gather`` the caller finishes the in-flight
    all-gather first (``model.disable_forward_pre_hook(param_sync=True)``) so the saved weights are current.
    """
    from megatron.core import parallel_state

    lock_root(root)  # at the first save; the entry point takes it at start-up already
    rank = dist.get_rank()
    folder = iteration_dir(root, iteration)
    # Every writer writes into rank 0's temporary folder; rank 0 renames it into place once all have. The folder
    # replaces iter_N whole: one that holds anything a checkpoint of ours does not is refused on every rank.
    made = [None, None]
    if rank == 0:
        try:
            made[0] = str(atomic.temporary_folder(folder, foreign=_foreign))
        except (OSError, ValueError) as e:
            made[1] = f"--save {root}: {e}"
    dist.broadcast_object_list(made, src=0)
    if made[1] is not None:
        raise ValueError(made[1])
    tmp = Path(made[0])
    slices = slice_dir(tmp, parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_tensor_model_parallel_world_size())
    writes_slices = _writes_parameter_state(optimizer)
    if writes_slices:
        slices.mkdir(exist_ok=True)
    dist.barrier()
    optimizer.save_parameter_state(str(slices / "distrib_optim.pt"))
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, _rng_state())
    if writes_slices:
        _save(model_state(model.module), slices / "model.pt")
        atomic.fsync_file(slices / "distrib_optim.pt")
        atomic.fsync_file(slices)  # the folder's entries, from the host that made them
    if rank == 0:
        common = {"iteration": iteration, "config": run_config, "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict()}
        _save(common, tmp / "common.pt")
        _save({"world_size": len(rng), "states": rng}, tmp / "rng.pt")
    # Each writer hashes its own files (still in its page cache; on another host rank 0 would read them remotely).
    written = [slices / name for name in sorted(_SLICE_FILES)] if writes_slices else []
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, {p.relative_to(tmp).as_posix(): manifest.file_digest(p) for p in written})
    if rank == 0:  # after every rank wrote: a process killed mid-save leaves the previous checkpoints as they were
        atomic.swap_in(tmp, folder, digests={k: v for d in digests for k, v in d.items()})
        atomic.write_file_atomically(Path(root) / LATEST, str(iteration))
        _warn_leftovers(Path(root))
    dist.barrier()
    return folder


_SLICE_FILES = {"model.pt", "distrib_optim.pt"}  # per tensor-parallel rank
_FILES = _SLICE_FILES | {"common.pt", "rng.pt", manifest.MANIFEST}


def _foreign(folder: Path) -> list[str]:
    """What an iteration folder holds that no checkpoint of this trainer writes (a save replaces the folder whole)."""
    strange = []
    for entry in folder.iterdir():
        if entry.is_dir() and re.fullmatch(r"mp_rank_\d{2}", entry.name):
            strange += [f"{entry.name}/{e.name}" for e in entry.iterdir() if e.name not in _SLICE_FILES]
        elif entry.name not in _FILES:
            strange.append(entry.name)
    return strange


def _writes_parameter_state(optimizer) -> bool:
    """Whether this rank writes its tensor-parallel rank's files: where Megatron's ``save_parameter_state`` writes
    (data-parallel rank 0 of the optimizer's own group; every chained optimizer agrees under this trainer's
    layouts, checked)."""
    groups = [o.data_parallel_group for o in getattr(optimizer, "chained_optimizers", [optimizer])
              if hasattr(o, "data_parallel_group")]
    firsts = {g.rank() == 0 for g in groups}
    if len(firsts) != 1:
        raise RuntimeError("save_checkpoint: the optimizers' data-parallel groups disagree on which rank writes "
                           "the parameter state; this trainer's checkpoint layout does not cover that setup")
    return firsts.pop()


def _warn_leftovers(root: Path) -> None:
    """Name what killed saves left under `root` that the commits could not delete (their writer may still run, or
    ran on another host): each is the size of a checkpoint."""
    left = sorted(p.name for p in root.glob(".iter_*") if re.search(r"\.(tmp|del)-", p.name))
    if left:
        print(f"save_checkpoint: {root} holds {len(left)} folder(s) that interrupted saves left ({', '.join(left[:3])}"
              f"{', ...' if len(left) > 3 else ''}); delete them when no save into {root} is running", flush=True)


def slice_dir(folder: Path, tp_rank: int, tp_size: int) -> Path:
    """Where an iteration folder holds the weights and optimizer state of one tensor-parallel rank: the folder
    itself at tensor-parallel size 1, else its ``mp_rank_<tp_rank>`` subfolder."""
    return folder if tp_size == 1 else folder / f"mp_rank_{tp_rank:02d}"


def _save(obj, path: Path) -> None:
    torch.save(obj, path)
    atomic.fsync_file(path)


def load_checkpoint(root: str, model, optimizer, scheduler, run_config: dict, *, trusted: bool = False,
                    verify: bool = True) -> int:
    """Restore the latest checkpoint under ``root`` (collective); returns its iteration.

    Every file of the iteration folder is first checked against its manifest, each rank a share of them
    (`fp4_dist.checkpoint.manifest`; ``verify=False`` skips it): a damaged one raises DamagedCheckpointError on
    every rank, naming it and its first bad offset, before any file is read. A checkpoint written before manifests
    loads with a one-line note that it is unverified.

    ``common.pt``, ``rng.pt`` and ``model.pt`` are read weights-only, before anything is restored: they may hold
    tensors, numbers, strings and containers, and ``rng.pt`` NumPy's RNG state (`NUMPY_RNG_GLOBALS`);
    ``distrib_optim.pt`` is read by Megatron's ``load_parameter_state``, weights-only too (torch.load's default).
    ``trusted`` unpickles the first three in full, which runs any code stored in them: only for a checkpoint you
    made or whose source you trust.

    Raises:
        FileNotFoundError if there is none; DamagedCheckpointError (a ValueError) naming a damaged file;
        UnsafeCheckpointError (a ValueError) naming the file and what it asked
        for when one holds anything else; ValueError if the model configuration differs from the one saved or the
        re-cast weights do not reproduce the saved ones.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {LATEST} there; nothing to resume")
    folder = atomic.resolve(iteration_dir(root, iteration))
    if verify:
        manifest.verify_folder_collective(folder)
    common = load_checkpoint_file(folder / "common.pt", trusted=trusted)
    saved_config = {**SAVED_BEFORE, **common["config"]}
    if "tensor_model_parallel_size" not in common["config"] and run_config.get("tensor_model_parallel_size", 1) != 1:
        raise ValueError(f"--load {folder}: this checkpoint was written before its tensor-parallel size was recorded, "
                         "when only tensor-parallel size 1 saved correctly: resume it with "
                         "--tensor-model-parallel-size 1 (a tensor-parallel checkpoint of that time cannot be resumed)")
    changed = {k: (saved_config.get(k), v) for k, v in run_config.items() if saved_config.get(k) != v}
    if changed:
        raise ValueError(f"--load {folder}: checkpoint was written with a different configuration "
                         f"(saved, now): {changed}")
    rng = load_checkpoint_file(folder / "rng.pt", NUMPY_RNG_GLOBALS, trusted=trusted)
    tp_size = saved_config["tensor_model_parallel_size"]  # this run's too (checked above)
    if tp_size == 1:
        slices = folder
    else:
        from megatron.core import parallel_state

        slices = slice_dir(folder, parallel_state.get_tensor_model_parallel_rank(), tp_size)
    saved_model = load_checkpoint_file(slices / "model.pt", trusted=trusted)
    wrong = _shape_mismatches(model, saved_model)
    if wrong:
        raise ValueError(f"--load {slices}: the saved weights' shapes differ from this model's ({'; '.join(wrong[:3])})"
                         ": a checkpoint of another model or tensor-parallel size")
    optimizer.load_state_dict(common["optimizer"])
    optimizer.load_parameter_state(str(slices / "distrib_optim.pt"))
    scheduler.load_state_dict(common["scheduler"])
    if rng["world_size"] == dist.get_world_size():
        _set_rng_state(rng["states"][dist.get_rank()])
    elif dist.get_rank() == 0:  # per-rank streams cannot map onto another number of ranks
        print(f"--load {folder}: saved at {rng['world_size']} ranks, resumed at {dist.get_world_size()}: the fp32 "
              "masters, optimizer state and LR schedule are restored bit for bit; RNG streams start from --seed",
              flush=True)
    recast_model_params(model, optimizer)
    problems = compare_model_state(model.module, saved_model)
    if problems:
        raise ValueError(f"--load {folder}: weights re-cast from the loaded masters differ from the saved model: "
                         + "; ".join(problems[:5]))
    return iteration


def _shape_mismatches(model, saved: dict) -> list[str]:
    """'name: saved [..], model [..]' for every weight whose saved shape is not the model's (None model: none)."""
    if model is None:
        return []
    wrong = []
    for name, p in model.module.named_parameters():
        v = saved.get(name)
        shape = tuple(v["shape"]) if isinstance(v, dict) else tuple(v.shape) if v is not None else None
        if shape is not None and shape != tuple(p.shape):
            wrong.append(f"{name}: saved {list(shape)}, model {list(p.shape)}")
    return wrong


def recast_model_params(model, optimizer) -> None:
    """fp32 masters -> model weights (NVFP4 shard cast or bf16 copy) -> all-gather, as after a step."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # The DistributedOptimizer's own main->model copy (the step's path); private in megatron-core 0.19.2.
        opt._copy_main_params_to_model_params()
    with torch.no_grad():
        model.start_param_sync(force_sync=True)
