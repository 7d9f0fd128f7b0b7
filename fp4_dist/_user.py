"""Where the user's code is on the stack: warnings point at the user's line, not at fp4_dist's or torch's."""

from __future__ import annotations

import os
import sys

import torch

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called from here that names the first frame outside fp4_dist and
    torch (optimizer hooks, dispatch and autograd add frames of their own between the user and the warning)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith((_OURS, _TORCH))
                                 or frame.f_code.co_filename.startswith("<")):  # fmt: skip
        frame, level = frame.f_back, level + 1
    return level
