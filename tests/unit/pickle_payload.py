"""A pickled object whose unpickling runs code: what a hostile checkpoint carries, made harmless (it creates one
empty file). Unpickled in full, `TouchOnLoad(path)` calls `touch(path)`; a weights-only reader must refuse it
before that call."""

from __future__ import annotations

from pathlib import Path

GLOBAL = f"{__name__}.touch"
"""The name the refusal must report."""


def touch(path: str) -> None:
    Path(path).touch()


class TouchOnLoad:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return touch, (self.path,)


def assert_refused(error: Exception, path: Path, marker: Path) -> None:
    """The refusal names the file and what it asked for, says how to proceed, and the payload did not run."""
    text = str(error)
    assert str(path) in text and GLOBAL in text and "trusted=True" in text and "--trust-checkpoint" in text, text
    assert not marker.exists(), f"the payload ran: {marker} exists"
