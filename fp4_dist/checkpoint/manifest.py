"""A digest of every file of a committed folder (a training checkpoint, an export), checked before a load reads it.

    <folder>/fp4_dist_manifest.json     {"format": ..., "hash": "xxh3_64", "chunk_bytes": 4194304,
                                         "files": {"<relative path>": {"size": n, "chunks": ["<16 hex>", ...]}},
                                         "digest": "<xxh3_64 of the rest of this object, canonical JSON>"}

Each file is hashed in fixed-size chunks, so that a mismatch names the first damaged chunk's byte range, not only
the file. The manifest is written into the temporary folder of a commit just before it is flushed and renamed into
place (`fp4_dist.checkpoint.atomic.swap_in`), so a committed folder is always whole with its manifest. The manifest
carries a digest of itself: a flipped byte in it is refused like one in any other file, never read as "no manifest".

xxh3_64 (the ``xxhash`` package) hashes several GB/s on one CPU core, faster than most disks read, so checking a
checkpoint costs about one extra read of it from the page cache (bench/RESULTS.md). It detects damage (disks, copies
between clusters, object stores), not tampering: it is not a cryptographic hash.

A folder without a manifest (written before manifests existed, or by another program) still loads, with a one-line
note that it is unverified.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import xxhash

from .._user import user_stacklevel

__all__ = ["MANIFEST", "CHUNK_BYTES", "FileDigest", "DamagedCheckpointError", "file_digest", "write_manifest",
           "check_folder", "verify_folder", "verify_folder_collective"]

MANIFEST = "fp4_dist_manifest.json"
FORMAT = "fp4_dist_manifest/1"
HASH = "xxh3_64"
CHUNK_BYTES = 4 << 20
"""4 MiB: a 1 GB shard has 239 digests (4 KB of JSON), and a mismatch is placed within 4 MiB of the bad byte."""
SKIP_REMEDY = "verify=False (--no-verify on the command lines that load checkpoints) loads it unchecked"


class DamagedCheckpointError(ValueError):
    """A checkpoint or export file that is missing, truncated or corrupt (its bytes differ from its manifest's
    digest, or it cannot be parsed); the message names the file, and nothing was loaded."""


@dataclass(frozen=True)
class FileDigest:
    size: int
    """The file's length in bytes."""
    chunks: tuple[str, ...]
    """xxh3_64 hex digest of each `CHUNK_BYTES` chunk, in order (one empty-input digest for an empty file)."""


def file_digest(path) -> FileDigest:
    """The chunk digests of the file at `path`, read once, one chunk at a time."""
    chunks, size = [], 0
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if not block and chunks:
                break
            chunks.append(xxhash.xxh3_64_hexdigest(block))
            size += len(block)
            if len(block) < CHUNK_BYTES:
                break
    return FileDigest(size, tuple(chunks))


def _self_digest(body: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _relative_files(folder: Path) -> list[str]:
    names = []
    for where, _, files in os.walk(folder):
        for name in files:
            rel = (Path(where) / name).relative_to(folder).as_posix()
            if rel != MANIFEST:
                names.append(rel)
    return sorted(names)


def write_manifest(folder, known: Optional[Mapping[str, FileDigest]] = None) -> Path:
    """Hash every file under `folder` (but those whose digests `known` gives: ranks hash the files they wrote) and
    write the manifest into it. Returns the manifest's path. The caller flushes it with the folder."""
    folder = Path(folder)
    known = dict(known or {})
    files = {}
    for rel in _relative_files(folder):
        d = known.get(rel) or file_digest(folder / rel)
        files[rel] = {"size": d.size, "chunks": list(d.chunks)}
    body = {"format": FORMAT, "hash": HASH, "chunk_bytes": CHUNK_BYTES, "files": files}
    path = folder / MANIFEST
    path.write_text(json.dumps({**body, "digest": _self_digest(body)}, indent=0, sort_keys=True))
    return path


def _read_manifest(folder: Path) -> Optional[dict]:
    """The manifest's body, None when the folder has none; DamagedCheckpointError when it is damaged."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_bytes())
        body = {k: v for k, v in manifest.items() if k != "digest"}
        intact = manifest.get("digest") == _self_digest(body)
    except (ValueError, AttributeError) as e:  # not JSON, not UTF-8, not an object
        raise DamagedCheckpointError(f"{path}: the manifest cannot be read ({type(e).__name__}); it is damaged, so "
                                     f"no file of {folder} can be checked. Nothing was loaded; {SKIP_REMEDY}") from e
    if not intact:
        raise DamagedCheckpointError(f"{path}: the manifest's own digest does not match its contents; it is damaged, "
                                     f"so no file of {folder} can be checked. Nothing was loaded; {SKIP_REMEDY}")
    if body.get("format") != FORMAT or body.get("hash") != HASH:
        raise DamagedCheckpointError(f"{path}: manifest format {body.get('format')!r} with hash {body.get('hash')!r}; "
                                     f"this fp4_dist reads {FORMAT!r} with {HASH!r} (a newer fp4_dist wrote it?); "
                                     f"{SKIP_REMEDY}")
    return body


def _check_file(folder: Path, rel: str, entry: dict, chunk_bytes: int) -> Optional[str]:
    """What is wrong with one listed file, or None when its bytes match."""
    path = folder / rel
    if not path.is_file():
        return f"{path}: missing (the manifest lists it)"
    size = path.stat().st_size
    chunks = entry["chunks"]
    with open(path, "rb", buffering=0) as f:
        for i, want in enumerate(chunks):
            if xxhash.xxh3_64_hexdigest(f.read(chunk_bytes)) != want:
                start = i * chunk_bytes
                end = min(start + chunk_bytes, size, entry["size"])
                return (f"{path}: bytes {start}..{max(end - 1, start)} (chunk {i + 1} of {len(chunks)}) differ from "
                        f"the manifest's digest: the first damaged byte is at offset {start} or after"
                        + (f" (the file has {size} bytes, the manifest says {entry['size']})"
                           if size != entry["size"] else ""))  # fmt: skip
    if size != entry["size"]:  # every listed chunk matches: bytes were appended
        return f"{path}: {size} bytes, the manifest says {entry['size']}: bytes were added from offset {entry['size']}"
    return None


def _listed(body: dict, rank: int, world: int) -> list[str]:
    return sorted(body["files"])[rank::world]


def check_folder(folder, *, rank: int = 0, world: int = 1) -> tuple[bool, list[str]]:
    """(whether `folder` has a manifest, the problems of the listed files this rank checks: every `world`-th file
    from the `rank`-th, in name order). Raises DamagedCheckpointError when the manifest itself is damaged."""
    folder = Path(folder)
    body = _read_manifest(folder)
    if body is None:
        return False, []
    problems = []
    for rel in _listed(body, rank, world):
        problem = _check_file(folder, rel, body["files"][rel], body["chunk_bytes"])
        if problem:
            problems.append(problem)
    return True, problems


def _refuse(folder: Path, problems: list[str]) -> DamagedCheckpointError:
    more = f" (and {len(problems) - 1} more damaged file(s): {'; '.join(problems[1:4])})" if len(problems) > 1 else ""
    return DamagedCheckpointError(f"{problems[0]}{more}. {folder} does not hold what was written; nothing was loaded. "
                                  f"Restore it from a copy or load another checkpoint; {SKIP_REMEDY}")


def _note_unverified(folder: Path) -> None:
    warnings.warn(f"fp4_dist: {folder} has no {MANIFEST} (written before fp4_dist wrote manifests, or by another "
                  "program): loading it unverified", UserWarning, stacklevel=user_stacklevel())  # fmt: skip


def verify_folder(folder) -> bool:
    """Check every file `folder`'s manifest lists against its digests, in this process. Returns True when checked,
    False (with a one-line warning) when the folder has no manifest. Raises DamagedCheckpointError naming the first
    damaged file and its first bad chunk's offsets (and how many others are damaged)."""
    folder = Path(folder)
    found, problems = check_folder(folder)
    if problems:
        raise _refuse(folder, problems)
    if not found:
        _note_unverified(folder)
    return found


def verify_folder_collective(folder, *, group=None) -> bool:
    """`verify_folder` shared among the ranks of `group` (collective: every rank calls, with the same folder): each
    rank reads a share of the files, and every rank raises the same DamagedCheckpointError when any file is damaged,
    so no rank goes on to load. The note about a folder without a manifest comes from the group's rank 0."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return verify_folder(folder)
    folder = Path(folder)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        found, problems = check_folder(folder, rank=rank, world=world)
    except DamagedCheckpointError as e:  # the manifest itself: every rank reads it, and says it the same way
        found, problems = True, [str(e)]
    verdicts = [None] * world
    dist.all_gather_object(verdicts, (found, problems), group=group)
    problems = sorted({p for _, ps in verdicts for p in ps})
    if problems:
        if any(p.endswith(SKIP_REMEDY) for p in problems):  # a damaged manifest: its own message
            raise DamagedCheckpointError(next(p for p in problems if p.endswith(SKIP_REMEDY)))
        raise _refuse(folder, problems)
    found = all(f for f, _ in verdicts)
    if not found and rank == 0:
        _note_unverified(folder)
    return found
