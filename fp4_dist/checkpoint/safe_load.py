"""Reading a checkpoint file without running code stored in it.

A ``.pt`` file is a pickle, and unpickling calls whatever functions the file names. `load_checkpoint_file` reads
with torch's weights-only unpickler, which builds tensors, containers and plain values and calls no function but
those allowed: the reader passes exactly what its kind of file holds (`NVFP4_GLOBALS` for NVFP4Tensors,
Megatron's own list for its checkpoints), inside a `torch.serialization.safe_globals` block, so nothing widens
what other code's ``torch.load`` accepts. A file that asks for anything else is refused with
`UnsafeCheckpointError`, naming the file and what it asked for; ``trusted=True`` is the explicit way to unpickle
a file in full.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from ..tensor import _rebuild

__all__ = ["load_checkpoint_file", "UnsafeCheckpointError", "NVFP4_GLOBALS"]

NVFP4_GLOBALS = (_rebuild,)
"""What a pickled NVFP4Tensor names: its rebuild, which takes plain tensors, a dtype, a shape and a string.
(`fp4_dist.tensor` also allows it globally, so that a plain ``torch.load`` restores NVFP4 weights.)"""

TRUST_REMEDY = ("if you made the file or trust its source, pass trusted=True (--trust-checkpoint on the command "
                "lines that read checkpoints), which unpickles it in full and so runs any code it holds")

SOUND_TORCH = (2, 6)
"""The first torch whose weights-only unpickler cannot be bypassed by a crafted file (CVE-2025-32434)."""

# Torch's weights-only unpickler names what it refused in one of these forms (torch 2.13).
_REFUSED = (re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global"),
            re.compile(r"unsupported GLOBAL (\S+) whose module \S+ is blocked"),
            re.compile(r"but got <class '([^']+)'>"))  # fmt: skip


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to unpickle something that its kind of file does not hold; nothing was loaded."""


def load_checkpoint_file(path, allowed: Iterable[Any] = (), *, trusted: bool = False) -> Any:
    """The object `torch.save` wrote to `path`, on the CPU, unpickled weights-only.

    Args:
        path: a file written by `torch.save`.
        allowed: the classes and functions this kind of file may name beyond torch's own (tensors, dtypes,
            containers, numbers, strings): e.g. `NVFP4_GLOBALS`.
        trusted: unpickle in full (``weights_only=False``), which calls whatever the file names; only for files
            you made or whose source you trust.
    Raises:
        UnsafeCheckpointError naming the file and what it asked for, when it names anything not allowed;
        RuntimeError under a torch older than `SOUND_TORCH` (unless trusted).
    """
    path = Path(path)
    if trusted:
        return torch.load(path, map_location="cpu", weights_only=False)
    version = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    if version < SOUND_TORCH:
        raise RuntimeError(f"reading {path} weights-only needs torch {'.'.join(map(str, SOUND_TORCH))} or later: the "
                           f"weights-only unpickler of torch {torch.__version__} can be made to run code by a crafted "
                           f"file (CVE-2025-32434); upgrade torch, or {TRUST_REMEDY}")
    # The block removes what it added when it ends, even entries that were allowed globally before it
    # (NVFP4Tensor's rebuild, megatron-core's list): it adds only the others.
    registered = torch.serialization.get_safe_globals()
    try:
        with torch.serialization.safe_globals([g for g in allowed if g not in registered]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path} asks to unpickle {refused_name(e)}, which this kind of checkpoint "
                                    f"does not hold, so it is not loaded (unpickling it could run code); "
                                    f"{TRUST_REMEDY}") from None


def refused_name(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its message (its own reason when no name is there)."""
    text = str(error)
    for pattern in _REFUSED:
        found = pattern.search(text)
        if found:
            return found.group(1)
    reason = text.split("WeightsUnpickler error:")[-1].strip().splitlines()
    return f"something torch's weights-only unpickler refuses ({reason[0] if reason else text})"
