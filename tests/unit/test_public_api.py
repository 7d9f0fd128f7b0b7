"""The public API is what the docs say it is: every ``fp4_dist`` name that README.md and docs/*.md tell users to
use resolves, and a name that is not a module is exported by its module's ``__all__``; ``fp4_dist.__all__`` holds the
entry points its docstring lists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NAME = re.compile(r"\bfp4_dist(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"^\s*from (fp4_dist(?:\.[A-Za-z_][A-Za-z0-9_]*)*) import ([A-Za-z_][\w, ]*)", re.M)
# A path in a code-layout listing (fp4_dist/cast/core.py) is a file, not an API name: only dotted names count.


def _documented() -> dict[str, set[str]]:
    """{dotted name: the docs that use it}."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        names = set(NAME.findall(text))
        for module, imported in FROM_IMPORT.findall(text):
            names.update(f"{module}.{n.strip()}" for n in imported.split(",") if n.strip())
        for n in names:
            found.setdefault(n.rstrip("."), set()).add(doc.name)
    return found


def _resolve(name: str):
    """(module or None, the object): the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("fp4_dist"):
                pytest.skip(f"{name} needs {e.name}")
            continue
        obj, owner = module, module
        for attr in parts[i:]:
            owner, obj = obj, getattr(obj, attr)
        return owner, obj
    raise AssertionError(f"no module of {name} imports")


DOCUMENTED = _documented()


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_a_documented_name_is_exported_where_the_docs_say(name):
    owner, obj = _resolve(name)
    if obj is owner or type(obj).__name__ == "module":
        return  # a module the docs name (python -m ..., or to read)
    exported = getattr(owner, "__all__", None)
    leaf = name.rsplit(".", 1)[1]
    if isinstance(owner, type):  # a method or attribute of a documented class
        return
    assert exported is not None and leaf in exported, (
        f"{name} (used in {', '.join(sorted(DOCUMENTED[name]))}) is not in {owner.__name__}.__all__")


def test_the_package_exports_the_entry_points_its_docstring_lists():
    import fp4_dist

    listed = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", fp4_dist.__doc__.split("::", 1)[1].split("\n\n")[1]))
    for name in fp4_dist.__all__:
        assert name in listed, f"{name} is exported but not listed in fp4_dist's docstring"
        assert getattr(fp4_dist, name) is not None
    for name in ("Zero1Optimizer", "fully_shard_nvfp4", "export_compressed_tensors", "cast_master_weights_to_nvfp4",
                 "NVFP4Tensor", "quantize", "convert_linear_weights"):
        assert name in fp4_dist.__all__, name


def test_one_place_holds_the_default_numerics():
    import inspect

    import fp4_dist
    from fp4_dist.format import DEFAULT_NUMERICS

    for fn in (fp4_dist.quantize, fp4_dist.convert_linear_weights, fp4_dist.fully_shard_nvfp4,
               fp4_dist.NVFP4Tensor.empty):
        assert inspect.signature(fn).parameters["numerics"].default is DEFAULT_NUMERICS, fn
    lines = [line for path in (REPO / "fp4_dist").rglob("*.py") for line in path.read_text().splitlines()
             if re.search(r"""numerics[^=\n]*=\s*["']te["']""", line)]
    assert not lines, f"a default numerics written out instead of format.DEFAULT_NUMERICS: {lines}"
