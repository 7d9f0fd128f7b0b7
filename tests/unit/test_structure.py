"""The package's import graph: no module imports one that imports it back (directly or through others), at module
level or inside a function, and every import points down the layers of `LAYERS` (the storage knows nothing of what
computes with it, the cast nothing of the trainers). And its maps: each package's __init__ docstring names every
module file of the package."""



from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "fp4_dist"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The fp4_dist modules `name` imports anywhere in its file, less its own parent packages (a package's
    __init__ runs before any of its modules: importing it is no cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# The package's layers, bottom first. A module imports only from layers below its own (and from its own package):
# the storage (`tensor`) knows nothing of what computes with it, the cast nothing of the trainers.
LAYERS = (
    ("format", "_user", "compare", "_moved"),
    ("kernels", "shared_amax", "launch"),
    ("buffers",),
    ("tensor",),
    ("quantize", "compute", "cast", "checkpoint"),
    ("convert", "testing"),
    ("optim", "fsdp", "megatron", "examples"),
    ("export",),  # reads what every trainer saved (Megatron's checkpoints name Megatron's classes)
)


def _unit(module: str) -> str:
    """The top-level unit of `module` below fp4_dist ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_sits_in_a_layer():
    layered = {u for layer in LAYERS for u in layer}
    missing = sorted({_unit(m) for m in _modules()} - layered - {""})
    assert not missing, f"units of fp4_dist in no layer of LAYERS (add them where their imports put them): {missing}"


def test_no_module_imports_from_a_layer_above_or_beside_its_own():
    modules = _modules()
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    wrong = []
    for m, p in modules.items():
        if _unit(m) == "":  # the package's face imports what it exports
            continue
        for t in _imports(m, p, modules):
            if _unit(t) != _unit(m) and level[_unit(t)] >= level[_unit(m)]:
                wrong.append(f"{m} (layer {level[_unit(m)]}) imports {t} (layer {level[_unit(t)]})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def test_the_package_root_holds_at_most_ten_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 10, f"{len(root)} modules in fp4_dist/ (at most 10: give new ones a package): {root}"


def _unmapped() -> dict[str, list[str]]:
    """Each package (the root included) -> its module files that its __init__'s docstring does not name."""
    out = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        files = sorted(p.name for p in init.parent.glob("*.py") if p.name != "__init__.py")
        missing = [f for f in files if not re.search(rf"(?<![\w./]){re.escape(f)}\b", doc)]
        if missing:
            out[".".join(init.parent.relative_to(PACKAGE.parent).parts)] = missing
    return out


def test_every_package_docstring_maps_every_file_of_the_package():
    wrong = _unmapped()
    assert not wrong, "packages whose __init__ docstring leaves out files (a line `name.py  what it holds` each):\n" + \
        "\n".join(f"{p}: {', '.join(m)}" for p, m in sorted(wrong.items()))


def test_the_map_check_sees_a_file_left_out(tmp_path, monkeypatch):
    root = tmp_path / "pkg"
    (root / "demo").mkdir(parents=True)
    (root / "__init__.py").write_text('"""The root.\n\n    nothing mapped\n"""\n')
    (root / "format.py").write_text("")
    (root / "demo" / "__init__.py").write_text('"""A demo.\n\n    core.py        the core\n'
                                               '    core_extra.py  another module\n"""\n')
    for name in ("core.py", "extra.py", "__main__.py"):
        (root / "demo" / name).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    assert _unmapped() == {"pkg": ["format.py"], "pkg.demo": ["__main__.py", "extra.py"]}
