"""Loading a ``torch.distributed.checkpoint`` (DCP) checkpoint without running code stored in it.

DCP unpickles twice on a load, both times in full: the checkpoint's ``.metadata`` file (``pickle.load``), and each
non-tensor entry of the state dict (an optimizer's step, its param groups: ``torch.load(weights_only=False)``). A
crafted checkpoint can run code at either. `load_distributed_checkpoint` loads the same state through `SafeReader`,
whose metadata unpickler builds only what DCP's metadata is made of (its own dataclasses and enums, torch sizes,
dtypes and layouts, paths), and `SafeLoadPlanner`, which reads the non-tensor entries with torch's weights-only
unpickler. A checkpoint that asks for anything else is refused with `UnsafeCheckpointError` naming it; ``trusted=True``
loads as DCP does.

Before either, the folder's files are checked against its manifest (`fp4_dist.checkpoint.manifest`), each rank a
share of them: a damaged file is refused on every rank, naming it, before anything is read or loaded.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .manifest import verify_folder_collective
from .safe_load import TRUST_REMEDY, UnsafeCheckpointError, refused_name

__all__ = ["load_distributed_checkpoint", "SafeReader", "SafeLoadPlanner"]

# Beyond the dataclasses and enums of torch.distributed.checkpoint.metadata: what DCP's metadata names (torch 2.13)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # a dataclass: offsets and lengths in a file
    ("torch.serialization", "_get_layout"),  # a torch layout by name (what torch's weights-only unpickler allows)
    ("torch", "Size"),
    *(("pathlib", c) for c in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:  # its classes, never a function of it
                obj = found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            obj = super().find_class(module, name)
        if obj is None:
            raise UnsafeCheckpointError(f"{self.where} asks to unpickle {module}.{name}, which a DCP checkpoint's "
                                        f"metadata does not hold, so it is not loaded (unpickling it could run "
                                        f"code); {TRUST_REMEDY}")  # fmt: skip
        return obj


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with only the classes DCP's metadata is made of."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads a state dict's non-tensor entries with torch's weights-only unpickler
    (numbers, strings, containers, tensors: what an optimizer's step and param groups are)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with weights_only=True: where the entry goes is its code, as of torch 2.13
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"the checkpoint's entry {read_item.dest_index.fqn} asks to unpickle "
                                        f"{refused_name(e)}, which is not loaded (unpickling it could run code); "
                                        f"{TRUST_REMEDY}") from None  # fmt: skip
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_distributed_checkpoint(state_dict: dict, path, *, trusted: bool = False,
                                planner: Optional[DefaultLoadPlanner] = None,
                                checked: Optional[SafeReader] = None, verify: bool = True) -> None:  # fmt: skip
    """``dcp.load(state_dict, checkpoint_id=path)`` without running code stored in the checkpoint (module
    docstring; collective, as dcp.load is), after checking its files against its manifest. `verify=False` skips
    that check (a folder without a manifest loads with a note either way); DamagedCheckpointError (a ValueError)
    names the first damaged file and offset, on every rank, before anything is loaded. `trusted`: load as DCP
    does, unpickling in full. `checked`: a `SafeReader` of `path` whose metadata the caller has read already (that
    read was the check; the caller verifies the files before it). Raises
    UnsafeCheckpointError, naming the file or the entry and what it asked for: for a crafted metadata file before
    anything is loaded, for an entry when its turn comes (entries loaded before it stay loaded). `planner`: a
    `SafeLoadPlanner` (it takes DefaultLoadPlanner's arguments, e.g. ``allow_partial_load=True``); another planner
    raises TypeError unless `trusted`, since DefaultLoadPlanner unpickles the entries in full."""
    if planner is not None and not trusted and not isinstance(planner, SafeLoadPlanner):
        raise TypeError(f"load_distributed_checkpoint: a {type(planner).__name__} reads the checkpoint's non-tensor "
                        "entries with torch.load(weights_only=False), which runs code stored in them; pass a "
                        "SafeLoadPlanner with the same arguments (e.g. SafeLoadPlanner(allow_partial_load=True)), or "
                        "trusted=True for a checkpoint you made")
    if verify and checked is None:
        verify_folder_collective(path)
    if trusted:
        dcp.load(state_dict, checkpoint_id=path, planner=planner)
        return
    reader = checked
    if reader is None:
        reader = SafeReader(Path(path))
        reader.read_metadata()  # refused here, in the caller's words (dcp.load would wrap it in its own exception)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner or SafeLoadPlanner())
    except CheckpointException as e:  # a refused entry, wrapped per rank: raised as itself
        for failure in e.failures.values():
            error = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(error, UnsafeCheckpointError):
                raise error from None
        raise
