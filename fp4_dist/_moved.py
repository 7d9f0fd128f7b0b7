"""The entry points that moved out of the package with the example applications (one release of grace)."""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path


def run_moved_example(old: str, new: str) -> None:
    """Say that ``python -m {old}`` is now ``python -m {new}`` (run from a checkout of the repository), then run it
    when this package sits in such a checkout; exit 2 with the new command otherwise."""
    message = (f"`python -m {old}` is deprecated and goes away in the next release: the example applications moved "
               f"out of the installed package; run `python -m {new}` from the root of the fp4_dist repository")
    warnings.warn(message, FutureWarning, stacklevel=2)
    print(f"fp4_dist: {message}", file=sys.stderr, flush=True)
    root = Path(__file__).resolve().parents[1]
    if not (root / "examples" / "__init__.py").is_file():
        raise SystemExit(f"fp4_dist: {root} holds no examples/ folder (an installed package); {message}")
    sys.path.insert(0, str(root))
    runpy.run_module(new, run_name="__main__", alter_sys=True)
