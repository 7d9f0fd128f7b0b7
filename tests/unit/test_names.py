"""Names that docs, docstrings and comments give resolve, in every shape they take:

- a dotted `fp4_dist.` name imports (and its attributes exist);
- a repository path exists (`fp4_dist/cast/sharded.py`), and so does a path relative to the package
  (`cast/sharded.py`);
- a backticked `module.Name`, where Name is defined at the top level of a package module, names a module that holds
  it (`core.CastCore`, not a stem the module had before it moved);
- a bare module file name (`view.py`) is a file of the repository or a Megatron-LM file the adapter cites, and
  names one file: its folder's, or the only one of that name.

A module that moves fails here, not in a reader's hands. Each check is a function of a text and the file it comes
from, so that the tests at the end can plant a stale name of each shape and see it caught.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "fp4_dist"
SUFFIXES = (".py", ".md", ".cu", ".cuh", ".sh", ".cfg", ".toml", ".txt")
DOTTED = re.compile(r"\bfp4_dist(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/.-])((?:fp4_dist|bench|examples|tests|docs|scripts|requirements)/[\w./*-]*[\w*])")
BARE = re.compile(r"(?<![\w/.-])([A-Za-z_]\w*\.py)\b")
STEM = re.compile(r"`+([a-z_]\w*)\.([A-Za-z_]\w*)")
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
RELATIVE = re.compile(rf"(?<![\w/.-])((?:{'|'.join(SUBPACKAGES)})/\w+\.py)\b")
# Dotted strings that are not module paths: a safetensors metadata key.
NOT_MODULES = {"fp4_dist.amax"}
# Paths inside a written checkpoint (the export's side file) and placeholders of usage lines.
NOT_REPO_PATHS = {"fp4_dist/dense_nvfp4.safetensors", "bench/SCRIPT"}
# Megatron-LM / megatron-core files the adapter's notes cite by name, and placeholders of usage lines. A bare name
# here means Megatron-LM's file even where the repository has one of that name too (`pretrain_gpt.py`: the docs'
# "Megatron-LM's own `pretrain_gpt.py`"); the repository's own are named by path (`examples/pretrain_gpt.py`) or
# by module (`fp4_dist.megatron.pretrain_gpt`).
UPSTREAM_FILES = {"gpt_builders.py", "model_provider.py", "initialize.py", "training.py", "checkpointing.py",
                  "distrib_optimizer.py", "optimizer.py", "clip_grads.py", "utils.py", "param_and_grad_buffer.py",
                  "package_info.py", "_config.py", "pretrain_gpt.py", "SCRIPT.py", "script.py",
                  "your_script.py"}  # fmt: skip
# File names that say what a file is for, not which one: every package has them.
ROLE_FILES = {"__init__.py", "__main__.py"}
# Backticked prefixes that are no module of ours: torch.distributed.checkpoint's usual alias, and a variable
# holding a cast's DeferredCheck (`check.resolve()`).
NOT_STEMS = {"dcp", "check"}
def _sources() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in tracked if f.endswith(SUFFIXES) and (ROOT / f).is_file()
            and f != "tests/unit/test_names.py"]


@functools.lru_cache(maxsize=None)
def _repo_py_files() -> dict[str, tuple[str, ...]]:
    """Each tracked .py file name -> the repository paths that have it."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    found: dict[str, list[str]] = defaultdict(list)
    for f in tracked:
        found[Path(f).name].append(f)
    return {n: tuple(sorted(p)) for n, p in found.items()}


@functools.lru_cache(maxsize=None)
def _package_index() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(name -> stems of the package modules that define it at top level, stem -> every name such a module or
    package holds: its definitions, imports and, for a package, its modules). A package's stem is its folder's."""
    defined: dict[str, set[str]] = defaultdict(set)
    holds: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if path.name != "__init__.py":
            holds[path.parent.name].add(path.stem)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    holds[stem].update((a.asname or a.name).split(".")[0] for a in node.names)
                continue
            for name in names:
                defined[name].add(stem)
                holds[stem].add(name)
    return defined, holds


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


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


def stale_stems(text: str) -> list[tuple[int, str, str]]:
    """(line, name, what to write instead) of each backticked `module.Name` whose Name a package module defines but
    `module` does not hold: a module's old stem (`cast_core.CastCore` after cast_core.py became cast/core.py)."""
    defined, holds = _package_index()
    wrong = []
    for m in STEM.finditer(text):
        module, name = m.groups()
        if module == "fp4_dist" or module in NOT_STEMS or name not in defined or name in holds.get(module, ()):
            continue
        if module not in holds and importlib.util.find_spec(module) is not None:  # another library: `torch.empty`
            continue
        wrong.append((_line(text, m.start()), f"{module}.{name}",
                      " or ".join(f"{stem}.{name}" for stem in sorted(defined[name]))))
    return wrong


def stale_relative_paths(text: str, where: Path) -> list[tuple[int, str]]:
    """(line, path) of each `<subpackage>/<file>.py` that is a file neither of the package (`cast/sharded.py`), nor
    of the repository root (`examples/train_lm.py`), nor of a folder above `where` (a test citing a sibling
    folder's test: `kernels/test_stages_dequantize.py` from tests/unit/compute)."""
    bases = [PACKAGE, ROOT, *(p for p in where.parents if ROOT in p.parents)]
    return [(_line(text, m.start()), m.group(1)) for m in RELATIVE.finditer(text)
            if not any((base / m.group(1)).is_file() for base in bases)]


def unresolved_bare_names(text: str, where: Path) -> list[tuple[int, str, str]]:
    """(line, name, why) of each bare module file name that names no file, or several. A bare name resolves to the
    file of that name in `where`'s folder (a docstring of fp4_dist/X/ naming a module of fp4_dist/X/), else to the
    repository's only file of that name; one that exists in several other places names none of them."""
    files = _repo_py_files()
    wrong = []
    for m in BARE.finditer(text):
        name = m.group(1)
        if name in UPSTREAM_FILES or name in ROLE_FILES or (where.parent / name).is_file():
            continue
        found = files.get(name, ())
        if len(found) != 1:
            why = f"ambiguous: {', '.join(found)} (name it by path)" if found else "no such file"
            wrong.append((_line(text, m.start()), name, why))
    return wrong


def _hits(pattern: re.Pattern, sources) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sources:
        for m in pattern.finditer(path.read_text()):
            found.setdefault(m.group(m.lastindex or 0), set()).add(str(path.relative_to(ROOT)))
    return found


def _report(wrong: list[str], what: str) -> str:
    return f"{what}:\n" + "\n".join(sorted(wrong))


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


def test_every_path_relative_to_the_package_exists(sources):
    wrong = [f"{path.relative_to(ROOT)}:{line}  {name}" for path in sources
             for line, name in stale_relative_paths(path.read_text(), path)]
    assert not wrong, _report(wrong, "paths relative to fp4_dist/ that name no file (write the file's path now)")


def test_every_backticked_module_stem_holds_the_name_it_qualifies(sources):
    wrong = [f"{path.relative_to(ROOT)}:{line}  {name} -> {instead}" for path in sources
             for line, name, instead in stale_stems(path.read_text())]
    assert not wrong, _report(wrong, "backticked module.Name whose module does not hold Name")


def test_every_bare_module_file_name_names_one_file(sources):
    package_and_docs = [p for p in sources if p.suffix == ".md" or "fp4_dist" in p.relative_to(ROOT).parts[:1]]
    wrong = [f"{path.relative_to(ROOT)}:{line}  {name}: {why}" for path in package_and_docs
             for line, name, why in unresolved_bare_names(path.read_text(), path)]
    assert not wrong, _report(wrong, "bare module file names that name no file, or several")


# The checks themselves, each fed a stale name of its shape.

def test_a_stem_a_module_had_before_it_moved_is_caught_and_the_module_now_holding_the_name_offered():
    text = "The stages are\n`cast_core.CastCore`'s; ``core.CastCore`` and `torch.empty` and `x.shape` are fine."
    assert stale_stems(text) == [(2, "cast_core.CastCore", "core.CastCore")]


def test_a_module_stem_that_does_not_hold_the_name_is_caught():
    assert [name for _, name, _ in stale_stems("see `view.CastCore`")] == ["view.CastCore"]


def test_a_path_relative_to_the_package_that_names_no_file_is_caught():
    where = ROOT / "tests" / "distributed" / "suite_train.py"
    text = "the tile scales (optim/sharded_cast.py), the cast (cast/sharded.py), the trainer (examples/train_lm.py)"
    assert stale_relative_paths(text, where) == [(1, "optim/sharded_cast.py")]
    assert stale_relative_paths("fp4_dist/optim/sharded_cast.py", where) == []  # a repository path: checked above


def test_a_path_relative_to_a_folder_above_the_citing_file_resolves():
    text = "as kernels/test_stages_dequantize.py does"
    assert stale_relative_paths(text, ROOT / "tests" / "unit" / "compute" / "test_copy.py") == []
    assert stale_relative_paths(text, ROOT / "docs" / "zero.md") == [(1, "kernels/test_stages_dequantize.py")]


def test_a_bare_name_that_exists_in_several_places_names_none_unless_its_folder_has_it():
    text = "NVFP4Linear (linear.py) and the bench (linear.py)"
    ambiguous = unresolved_bare_names(text, ROOT / "docs" / "zero.md")
    assert [(line, name) for line, name, _ in ambiguous] == [(1, "linear.py"), (1, "linear.py")]
    assert "bench/linear.py" in ambiguous[0][2] and "fp4_dist/compute/linear.py" in ambiguous[0][2]
    assert unresolved_bare_names(text, PACKAGE / "compute" / "view.py") == []  # its folder's linear.py


def test_a_bare_name_of_no_file_is_caught_and_a_unique_one_resolves_anywhere():
    where = ROOT / "docs" / "zero.md"
    assert unresolved_bare_names("sharded_cast.py", where) == [(1, "sharded_cast.py", "no such file")]
    assert unresolved_bare_names("tile_owners.py, Megatron-LM's pretrain_gpt.py, __init__.py", where) == []


def test_every_markdown_link_into_the_repository_resolves_anchors_included(sources):
    wrong = []
    for path in (p for p in sources if p.suffix == ".md"):
        text = path.read_text()
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file = (path.parent / target).resolve() if target else path
            if not file.exists():
                wrong.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}  {m.group(1)}: no such file")
            elif anchor and anchor not in markdown_anchors(file.read_text()):
                wrong.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}  {m.group(1)}: no such heading")
    assert not wrong, _report(wrong, "links that lead nowhere")


def markdown_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped (`-` and `_` kept), spaces
    turned into hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_markdown_anchors_are_githubs():
    text = ("# Results\n## Megatron-LM's `pretrain_gpt.py` in TP, PP\n## A linear layer, forward + backward\n"
            "## FSDP2\n```bash\n# not a heading\n```\n## FSDP2\n")
    assert markdown_anchors(text) == {"results", "megatron-lms-pretrain_gptpy-in-tp-pp",
                                      "a-linear-layer-forward--backward", "fsdp2", "fsdp2-1"}
