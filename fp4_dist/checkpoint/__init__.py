"""What users keep on disk, written so that a killed process cannot spoil it and read so that it cannot run code.

    atomic.py     a whole folder (an export, a checkpoint) or one file (a run record) committed by renames: a
                  process killed at any instant leaves the old version or the new one
    manifest.py   a digest per chunk of every file of a committed folder, written inside the commit and checked
                  before a load (`verify_folder`, `DamagedCheckpointError`)
    lock.py       one writer per checkpoint root: a lock naming the job, taken before its first save (`lock_root`,
                  `RootLockedError`); the leftovers of unfinished saves deleted once it is taken
    steps.py      training checkpoints (torch.distributed.checkpoint) one folder per step, each committed whole
                  (`save`, `step_folder`), and the newest complete one found on restart (`latest_complete_checkpoint`)
    safe_load.py  the one reader of ``.pt`` files: weights-only, with an allow-list per kind of file
                  (`load_checkpoint_file`, `UnsafeCheckpointError`)
    options.py    the command-line options of a trainer that loads and saves through this package (``--no-verify``,
                  ``--take-over-lock``)
    safe_dcp.py   DCP checkpoints loaded without unpickling code: their metadata and non-tensor entries
                  (`load_distributed_checkpoint`, `SafeReader`, `SafeLoadPlanner`)
"""

from __future__ import annotations

from .lock import RootLockedError, lock_root, release_root
from .manifest import DamagedCheckpointError, verify_folder, verify_folder_collective
from .safe_dcp import SafeLoadPlanner, SafeReader, load_distributed_checkpoint
from .safe_load import NVFP4_GLOBALS, UnsafeCheckpointError, load_checkpoint_file
from .steps import StepCheckpoint, latest_complete_checkpoint, save, step_folder

__all__ = ["save", "step_folder", "latest_complete_checkpoint", "StepCheckpoint", "load_checkpoint_file",
           "UnsafeCheckpointError", "NVFP4_GLOBALS", "load_distributed_checkpoint", "SafeReader",
           "SafeLoadPlanner", "DamagedCheckpointError", "verify_folder", "verify_folder_collective", "lock_root",
           "release_root", "RootLockedError"]  # fmt: skip
