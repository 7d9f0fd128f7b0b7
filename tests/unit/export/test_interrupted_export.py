"""An export over an earlier export, its process killed (SIGKILL) at evenly spaced points of the write: the folder
then loads as the earlier export or the new one, byte for byte, never a mixture and never nothing.

Each kill runs in a forked child that exports and stops itself at its k-th write, fsync, rename or delete
(`killed_writer.die_at`); the folder is then read as a user would read it."""

from __future__ import annotations

import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

from fp4_dist.checkpoint import atomic
from fp4_dist.export import export_compressed_tensors, load_compressed_tensors

from ..killed_writer import die_at
from .test_export import llama

pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

POINTS = 20
SHARD_BYTES = 4_000  # a file per weight or two, so the kills land between files as well as in the commit's renames


def files_of(folder: Path) -> dict[str, object]:
    """{file: its contents}: a safetensors file as (its tensors' bytes by name, its metadata), since the writer
    orders the metadata differently from one write to the next; any other file as its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                out[str(p.relative_to(folder))] = (
                    {n: f.get_tensor(n).contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n in f.keys()},
                    f.metadata())  # fmt: skip
        elif p.is_file():
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


def side_entries(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def export_quietly(model, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_compressed_tensors(model, folder, max_shard_bytes=SHARD_BYTES)


def steps_of_an_export(model, tmp_path: Path) -> list[str]:
    """The hook points an export over an earlier one passes, in order (recorded in this process)."""
    seen = []
    target = tmp_path / "count"
    export_quietly(model, target)
    saved = atomic._step
    atomic._step = lambda action, path: seen.append(action)
    try:
        export_quietly(model, target)
    finally:
        atomic._step = saved
    return seen


@pytest.fixture(scope="module")
def two_exports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exports")
    old_model, new_model = llama(seed=1), llama(seed=2)
    export_quietly(old_model, tmp / "old")
    export_quietly(new_model, tmp / "new")
    return tmp, new_model, files_of(tmp / "old"), files_of(tmp / "new")


def test_an_export_killed_at_any_point_leaves_the_old_or_the_new_export_never_a_mixture(two_exports, tmp_path):
    tmp, new_model, old_files, new_files = two_exports
    differ = [f for f in old_files if old_files[f] != new_files[f]]
    assert old_files.keys() == new_files.keys() and len(differ) >= 10  # (shards of norm weights, all ones, agree)
    steps = steps_of_an_export(new_model, tmp_path)
    total = len(steps)
    assert total >= 2 * len(old_files) + 4  # a write and an fsync per file, the renames, the delete
    points = sorted({round(i * (total - 1) / (POINTS - 1)) for i in range(POINTS)})
    assert len(points) == POINTS
    # and the one instant the target is absent: the old export set aside, the new one not yet renamed in
    between = [i for i, action in enumerate(steps) if action == "rename"][1]
    points = sorted(set(points) | {between})
    outcomes, missing = [], []
    for k in points:
        target = tmp_path / f"at{k}" / "llama"
        shutil.copytree(tmp / "old", target)
        stopped = die_at(k, lambda: export_quietly(new_model, target))
        assert stopped == -signal.SIGKILL, f"point {k} of {total} not reached"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = files_of(atomic.resolve(target))
            load_compressed_tensors(llama(seed=3), target)  # transformers' loader reads the same files
        assert found in (old_files, new_files), (
            f"killed at point {k} of {total}: the folder is neither export "
            f"({sum(found.get(f) == old_files[f] for f in old_files)} files of the old one, "
            f"{sum(found.get(f) == new_files[f] for f in new_files)} of the new one, {len(found)} in all)")
        outcome = "old" if found == old_files else "new"
        outcomes.append(outcome)
        if not target.exists():  # killed between the two renames: read from the earlier version, said so
            assert outcome == "old" and any("is missing and" in str(w.message) for w in caught)
            missing.append(k)
        # The next export puts everything right: the new export in place, nothing left beside it.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            export_quietly(new_model, target)
        assert files_of(target) == new_files and side_entries(target) == [], (k, side_entries(target))
    # The points span the write: the first ones leave the old export, the last ones the new one.
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    assert outcomes == sorted(outcomes, key=["old", "new"].index), outcomes
    assert missing == [between]


def test_an_export_into_a_folder_holding_other_files_is_refused_naming_them(two_exports, tmp_path):
    tmp, new_model, old_files, _ = two_exports
    target = tmp_path / "llama"
    shutil.copytree(tmp / "old", target)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes\.txt.*refuses"):
        export_compressed_tensors(new_model, target)
    assert (target / "notes.txt").read_text() == "mine"
    assert {k: v for k, v in files_of(target).items() if k != "notes.txt"} == old_files
    assert side_entries(target) == []


def test_an_export_into_an_empty_or_missing_folder_writes_it(two_exports, tmp_path):
    _, new_model, _, new_files = two_exports
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "a" / "b" / "missing"):
        export_quietly(new_model, target)
        assert files_of(target) == new_files and side_entries(target) == []


def test_a_failing_export_leaves_the_earlier_one_and_no_temporary_folder(two_exports, tmp_path):
    tmp, new_model, old_files, _ = two_exports
    target = tmp_path / "llama"
    shutil.copytree(tmp / "old", target)

    def fail(action, path):
        if action == "fsync":
            raise OSError(28, "No space left on device")

    saved, atomic._step = atomic._step, fail
    try:
        with pytest.raises(OSError, match="No space left"):
            export_quietly(new_model, target)
    finally:
        atomic._step = saved
    assert files_of(target) == old_files and side_entries(target) == []
