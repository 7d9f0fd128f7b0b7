"""The package's import graph: no module imports one that imports it back (directly or through others), at module
level or inside a function, and nothing below the trainers imports them (the cast does not import optim/)."""

from __future__ import annotations

import ast
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


def test_the_layers_below_the_trainers_do_not_import_them():
    modules = _modules()
    below = ("fp4_dist.format", "fp4_dist.kernels", "fp4_dist.buffers", "fp4_dist.tensor", "fp4_dist.compute",
             "fp4_dist.cast", "fp4_dist.quantize", "fp4_dist.shared_amax")  # fmt: skip
    trainers = ("fp4_dist.optim", "fp4_dist.fsdp", "fp4_dist.megatron", "fp4_dist.export")
    wrong = [(m, t) for m, p in modules.items() if m.startswith(below)
             for t in _imports(m, p, modules) if t.startswith(trainers)]  # fmt: skip
    assert not wrong, f"imports of a trainer from below it: {wrong}"
