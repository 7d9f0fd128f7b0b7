"""Names that docs, docstrings and comments give resolve: every dotted `fp4_dist.` name imports (and its attributes
exist), every repository path exists, and every bare module file name (`view.py`) is a file of the repository or a
Megatron-LM file the adapter cites. A module that moves fails here, not in a reader's hands."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SUFFIXES = (".py", ".md", ".cu", ".cuh", ".sh", ".cfg", ".toml", ".txt")
DOTTED = re.compile(r"\bfp4_dist(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:fp4_dist|bench|examples|tests|docs|scripts|requirements)/[\w./*-]*[\w*])")
BARE = re.compile(r"(?<![\w/.-])([A-Za-z_]\w*\.py)\b")
# Dotted strings that are not module paths: a safetensors metadata key.
NOT_MODULES = {"fp4_dist.amax"}
# Paths inside a written checkpoint (the export's side file) and placeholders of usage lines.
NOT_REPO_PATHS = {"fp4_dist/dense_nvfp4.safetensors", "bench/SCRIPT"}
# Megatron-LM / megatron-core files the adapter's notes cite by name, and placeholders of usage lines.
UPSTREAM_FILES = {"gpt_builders.py", "model_provider.py", "initialize.py", "training.py", "checkpointing.py",
                  "distrib_optimizer.py", "optimizer.py", "clip_grads.py", "utils.py", "param_and_grad_buffer.py",
                  "package_info.py", "_config.py", "SCRIPT.py", "script.py", "your_script.py"}  # fmt: skip


def _sources() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in tracked if f.endswith(SUFFIXES) and (ROOT / f).is_file()
            and f != "tests/unit/test_names.py"]


def _resolves(name: str) -> bool:
    """Whether `name` is a module of the package, or one of its modules followed by attributes that exist."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        obj = importlib.import_module(module) if i < len(parts) else None
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _hits(pattern: re.Pattern, sources) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sources:
        for m in pattern.finditer(path.read_text()):
            found.setdefault(m.group(m.lastindex or 0), set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.fixture(scope="module")
def sources():
    return _sources()


def test_every_dotted_fp4_dist_name_resolves(sources):
    wrong = {n: f for n, f in _hits(DOTTED, sources).items() if n not in NOT_MODULES and not _resolves(n)}
    assert not wrong, "names that do not resolve (refer to what exists now):\n" + "\n".join(
        f"{n}  in {sorted(f)}" for n, f in sorted(wrong.items()))


def test_every_repository_path_exists(sources):
    wrong = {}
    for raw, where in _hits(PATH, sources).items():
        path = re.sub(r":[\d,-]+$", "", raw).rstrip(".")
        if "*" not in path and path not in NOT_REPO_PATHS and not (ROOT / path).exists():
            wrong[path] = where
    assert not wrong, "paths that do not exist:\n" + "\n".join(f"{p}  in {sorted(f)}" for p, f in sorted(wrong.items()))


def test_every_bare_module_file_name_exists(sources):
    ours = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    package_and_docs = [p for p in sources if p.suffix == ".md" or "fp4_dist" in p.relative_to(ROOT).parts[:1]]
    wrong = {n: f for n, f in _hits(BARE, package_and_docs).items() if n not in ours and n not in UPSTREAM_FILES}
    assert not wrong, "module files that do not exist:\n" + "\n".join(
        f"{n}  in {sorted(f)}" for n, f in sorted(wrong.items()))
