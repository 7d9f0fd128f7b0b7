"""Atomic commits of what fp4_dist writes for users to keep: a whole folder (an export, a checkpoint) or one file
(a run record). A process killed at any instant leaves the complete old version or the complete new one.

A folder is written into a temporary folder beside its target, flushed, and swapped in by renames::

    1. write every file into  <parent>/.<name>.tmp-<host>-<pid>-<token>/   and its manifest (the digest of each
       file, `fp4_dist.checkpoint.manifest`), then fsync each file and each folder
    2. rename <name>                  -> .<name>.old-<token>     (only when an earlier version is there)
    3. rename .<name>.tmp-...         -> <name>                  fsync <parent>
    4. rename .<name>.old-<token>     -> .<name>.del-<token>     then delete it

POSIX cannot rename a folder onto a non-empty one, hence two renames. At every instant ``<name>`` is the complete
old version or the complete new one, except between 2 and 3, when it is absent and ``.<name>.old-*`` holds the
complete old version: `resolve` reads that one, and the next commit renames it back (rolling the interrupted
write back). An ``.old-`` name always denotes a complete folder; a folder being deleted is renamed ``.del-`` first.
What a killed writer leaves (``.tmp-`` and ``.del-`` folders) is never read; the next commit to the same target
deletes it, with a warning, once the writer's process is gone (``.tmp-`` names carry host and pid).

Files are flushed with fsync, so a committed version also survives the loss of the machine, where the file
system honours fsync.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import warnings
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from . import manifest

__all__ = ["FolderWrite", "commit_folder", "temporary_folder", "swap_in", "resolve", "recover", "write_file_atomically",
           "fsync_file"]

_TMP, _OLD, _DEL = "tmp", "old", "del"


def _step(action: str, path: Path) -> None:
    """Reached before every write, fsync, rename and delete of a commit (the places a process can die between):
    a test replaces it to stop the process at a chosen one. Does nothing."""


def _side(target: Path, kind: str, token: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{token}"


def _sides(target: Path, kind: str) -> list[Path]:
    """The ``.<name>.<kind>-*`` entries beside `target`, oldest rename first."""
    prefix = f".{target.name}.{kind}-"
    if not target.parent.is_dir():
        return []
    return sorted((p for p in target.parent.iterdir() if p.name.startswith(prefix)), key=lambda p: p.lstat().st_ctime)


def _writer_token() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _writer_gone(side: Path, target: Path) -> bool:
    """Whether the writer named in a ``.tmp-<host>-<pid>-<token>`` folder is a process of this host that has ended
    (a folder of another host's writer cannot be judged from here)."""
    token = side.name[len(f".{target.name}.{_TMP}-"):]
    host, _, rest = token.rpartition("-")[0].rpartition("-")
    pid = rest
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def fsync_file(path: Path) -> None:
    """Flush `path` (a file or a folder) to its disk. A rank that writes a file into a folder another rank commits
    flushes it itself: on a shared file system another host's fsync does not reach this host's cache."""
    _step("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every folder bottom-up, so that the names are durable after their contents."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in sorted(files):
            fsync_file(Path(folder) / name)
        fsync_file(Path(folder))


def _plain_permissions(root: Path) -> None:
    """Give every file under `root` the permissions a plain ``open()`` gives under the process's umask: some writers
    (safetensors) create theirs readable by the owner alone, and an export is read by servers running as others."""
    mask = os.umask(0)
    os.umask(mask)
    for folder, _, files in os.walk(root):
        for name in files:
            os.chmod(Path(folder) / name, 0o666 & ~mask)


def _rename(src: Path, dst: Path) -> None:
    _step("rename", dst)
    os.rename(src, dst)


def _delete(folder: Path) -> None:
    _step("delete", folder)
    shutil.rmtree(folder, ignore_errors=True)


def resolve(target) -> Path:
    """The folder a reader of `target` reads: `target` itself, or, when it is missing because a commit was stopped
    between its two renames, the complete earlier version beside it (with a warning naming both). Changes nothing
    on disk."""
    target = Path(target)
    if target.exists():
        return target
    old = _sides(target, _OLD)
    if not old:
        return target
    warnings.warn(f"fp4_dist: {target} is missing and {old[-1]} holds its complete earlier version (a write was "
                  "stopped between its two renames); reading that one. The next write to the same path puts it back",
                  UserWarning, stacklevel=2)  # fmt: skip
    return old[-1]


def recover(target) -> list[str]:
    """Before writing `target`: put back a complete earlier version left aside by a stopped commit (when `target`
    is missing), delete what stopped writers of this host left (``.tmp-``, ``.del-``, surplus ``.old-``), and
    return one note per action (also warned)."""
    target = Path(target)
    notes = []
    old = _sides(target, _OLD)
    if old and not target.exists():
        _rename(old.pop(), target)
        notes.append(f"{target} was missing: put back its complete earlier version (a write to it was stopped "
                     "between its two renames)")
    for side in old:
        trash = _side(target, _DEL, side.name.rpartition(f".{_OLD}-")[2])
        _rename(side, trash)
        _delete(trash)
        notes.append(f"deleted {side}, an earlier version of {target} left aside by a stopped write")
    for side in _sides(target, _DEL):
        _delete(side)
        notes.append(f"deleted {side}, left by a write to {target} stopped while it deleted the earlier version")
    for side in _sides(target, _TMP):
        if _writer_gone(side, target):
            _delete(side)
            notes.append(f"deleted {side}, the unfinished temporary folder of a stopped write to {target}")
    for note in notes:
        warnings.warn(f"fp4_dist: {note}", UserWarning, stacklevel=2)
    return notes


class FolderWrite:
    """The temporary folder a commit writes into; `file` names each file written there."""

    def __init__(self, path: Path):
        self.path = path

    def file(self, name: str) -> Path:
        """The path to write file `name` (relative; its subfolder is made) inside the temporary folder."""
        path = self.path / name
        _step("write", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def temporary_folder(target, *, foreign: Optional[Callable[[Path], list[str]]] = None) -> Path:
    """Step 1's folder for a new version of `target` (made empty, beside it), after `recover`; the caller writes
    into it and then calls `swap_in`, or deletes it.

    Args:
        target: the folder to (re)place; its parent is made if missing.
        foreign: names of entries in an existing `target` that an earlier version would not hold; any raises
            ValueError naming them, before anything is written.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a folder; pass a folder path (it is created)")
    strange = foreign(target) if foreign is not None and target.is_dir() else []
    if strange:
        shown = ", ".join(strange[:5]) + (f" and {len(strange) - 5} more" if len(strange) > 5 else "")
        raise ValueError(f"{target} holds files that are not part of an earlier version ({shown}); a write replaces "
                         "the whole folder, so it refuses: move them, or write to another folder")
    tmp = _side(target, _TMP, _writer_token())
    tmp.mkdir()
    return tmp


def swap_in(tmp, target, *, digests: Optional[Mapping[str, manifest.FileDigest]] = None) -> None:
    """The end of step 1 and steps 2-4: write the manifest of the written folder `tmp` (the digests of every file;
    `digests` gives those of files hashed already, by the ranks that wrote them), flush it all and make it `target`,
    deleting the earlier version after. The manifest is written inside the commit, so that `target` is never there
    without it."""
    tmp, target = Path(tmp), Path(target)
    _step("write", tmp / manifest.MANIFEST)
    manifest.write_manifest(tmp, digests)
    _plain_permissions(tmp)
    _fsync_tree(tmp)
    old = _side(target, _OLD, tmp.name.rpartition(f".{_TMP}-")[2]) if target.exists() else None
    if old is not None:
        _rename(target, old)
    _rename(tmp, target)
    fsync_file(target.parent)
    if old is not None:
        trash = _side(target, _DEL, old.name.rpartition(f".{_OLD}-")[2])
        _rename(old, trash)
        _delete(trash)


@contextlib.contextmanager
def commit_folder(target, *, foreign: Optional[Callable[[Path], list[str]]] = None) -> Iterator[FolderWrite]:
    """``with commit_folder(target) as w: write into w.file(name)...``: the files written replace `target` whole
    when the block ends without an error (`temporary_folder`, then `swap_in`); on an error the temporary folder
    is deleted and `target` is left as it was. `foreign`: as for `temporary_folder`."""
    tmp = temporary_folder(target, foreign=foreign)
    try:
        yield FolderWrite(tmp)
        swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file_atomically(path, data: bytes | str) -> None:
    """Write one file so that a reader sees the old content or the new one, never a part: a temporary file beside
    it, fsync, rename over it, fsync of the folder. The temporary files of stopped writes to `path` (their writer
    gone) are deleted first: nothing else would."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for side in _sides(path, _TMP):
        if side.is_file() and _writer_gone(side, path):
            side.unlink(missing_ok=True)
    tmp = _side(path, _TMP, _writer_token())
    raw = data.encode() if isinstance(data, str) else data
    _step("write", tmp)
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            _step("fsync", tmp)
            os.fsync(f.fileno())
        _rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_file(path.parent)
