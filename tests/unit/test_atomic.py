"""fp4_dist.checkpoint.atomic: a file or folder written by a process killed at any point is the old version or the new
one, and what killed writers leave is cleaned up only once they are gone."""

from __future__ import annotations

import os
import signal
import socket
import warnings
from pathlib import Path

from fp4_dist.checkpoint import atomic, manifest

from .killed_writer import die_at


def test_a_file_written_by_a_killed_process_holds_the_old_or_the_new_text(tmp_path):
    path = tmp_path / "run.json"
    seen = []
    for k in range(6):
        path.write_text("old")
        assert die_at(k, lambda: atomic.write_file_atomically(path, "new")) in (-signal.SIGKILL, 3)
        seen.append(path.read_text())
    assert set(seen) == {"old", "new"} and seen == sorted(seen, key=["old", "new"].index), seen


def folder(path: Path, text: str) -> None:
    with atomic.commit_folder(path) as w:
        w.file("a.txt").write_text(text)
        w.file("sub/b.txt").write_text(text * 2)


def read(path: Path) -> dict:
    """The folder's files but its manifest, which must match them: a committed folder is whole with it."""
    if path.is_dir():
        assert manifest.verify_folder(path)
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != manifest.MANIFEST}  # fmt: skip


def test_a_folder_committed_by_a_killed_process_is_the_old_or_the_new_one(tmp_path):
    outcomes = []
    for k in range(12):
        target = tmp_path / f"k{k}" / "out"
        folder(target, "old")
        assert die_at(k, lambda: folder(target, "new")) in (-signal.SIGKILL, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = read(atomic.resolve(target))
        assert found in ({"a.txt": "old", "sub/b.txt": "oldold"}, {"a.txt": "new", "sub/b.txt": "newnew"}), (k, found)
        outcomes.append(found["a.txt"])
        left = sorted(os.listdir(target.parent))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            notes = atomic.recover(target)  # what the next write does first: one note per thing put right
        assert len(notes) == len(left) - ("out" in left), (left, notes)
        assert os.listdir(target.parent) == ["out"] and read(target) == found
    assert outcomes[0] == "old" and outcomes[-1] == "new"


def test_what_a_live_writer_or_another_hosts_writer_left_is_not_deleted(tmp_path):
    target = tmp_path / "out"
    folder(target, "old")
    live = tmp_path / f".out.tmp-{socket.gethostname()}-{os.getpid()}-abcd"
    elsewhere = tmp_path / ".out.tmp-some-other-host-1-abcd"
    for side in (live, elsewhere):
        side.mkdir()
    assert atomic.recover(target) == []
    assert live.is_dir() and elsewhere.is_dir()


def test_a_committed_folder_gives_its_files_the_umasks_permissions(tmp_path):
    # safetensors creates its files readable by the owner alone; an export is read by servers running as others.
    old = os.umask(0o022)
    try:
        with atomic.commit_folder(tmp_path / "export") as w:
            fd = os.open(w.file("model.safetensors"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            w.file("sub/config.json").write_text("{}")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "export").rglob("*") if p.is_file()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644, manifest.MANIFEST: 0o644}, modes
