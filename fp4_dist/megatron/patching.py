"""The patch engine under the hook table: a `Hook` row names a binding in megatron-core (or megatron.training) and
how to replace it; `patch` installs rows and returns what `unpatch` needs to put every original object back.

A name bound by ``from x import name`` lives in every importing module's globals, so a row lists every module that
binds it and all of them are patched. The rows name line-level facts of the megatron-core releases in
`TESTED_VERSIONS`; `check_megatron_version` refuses others unless the user allows them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

TESTED_VERSIONS = ("0.19.1", "0.19.2")
"""megatron-core versions whose hook-table tests pass: the 0.19.2 wheel (CI) and a Megatron-LM ``core_r0.19.0``
source checkout, which reports 0.19.1 and carries the same ``megatron/training`` and hooked modules."""


@dataclass(frozen=True)
class Hook:
    """One patch: ``modules[i].<name>`` becomes ``make(original)`` for every module listed.

    ``name`` may be ``Class.attr`` to patch a class attribute. ``cpu_only`` rows are installed only when the
    run has no CUDA device (they work around gloo, see `cpu_compat`).
    """

    modules: tuple[str, ...]
    name: str
    make: Callable[[Any], Any]
    reason: str
    tested: tuple[str, ...] = TESTED_VERSIONS
    cpu_only: bool = False



# ------------------------------------------------------------------------------------------ version check
def _parse_version(version: str) -> tuple[int, int, int]:
    from packaging.version import Version  # a megatron-core dependency

    release = Version(version).release
    return tuple((list(release) + [0, 0, 0])[:3])  # type: ignore[return-value]


def check_megatron_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` is one of `TESTED_VERSIONS` (the hook table names line-level facts of
    exactly those; a later patch release is accepted once the tests pass against it and it is added there)."""
    if _parse_version(version) in {_parse_version(v) for v in TESTED_VERSIONS}:
        return
    raise RuntimeError(
        f"fp4_dist.megatron is tested with megatron-core {' and '.join(TESTED_VERSIONS)} (a Megatron-LM core_r0.19.0 "
        f"checkout reports 0.19.1); found {version}. Its hooks patch named internals of DistributedOptimizer, "
        "_ParamAndGradBuffer and megatron.training that other releases may lay out differently. Install "
        f"megatron-core=={TESTED_VERSIONS[-1]} (or check out Megatron-LM's core_r0.19.0 branch), or try anyway with "
        "`python -m fp4_dist.megatron.run --allow-untested-megatron ...` (the example trainer: "
        "--fp4-allow-untested-megatron; your own script: enable(allow_untested_version=True))")


def installed_megatron_version() -> str:
    """megatron-core's version, read from its ``package_info.py`` without importing ``megatron.core``: that import
    torch.compile's Megatron's fused kernels, and on CPU ranks `cpu_compat` must be in place before it."""
    try:
        core = sys.modules.get("megatron.core")
        if core is not None:
            return core.package_info.__version__
        megatron = importlib.util.find_spec("megatron")
        if megatron is None or not megatron.submodule_search_locations:
            raise ImportError("No module named 'megatron'")
        path = next((Path(p) / "core" / "package_info.py" for p in megatron.submodule_search_locations
                     if (Path(p) / "core" / "package_info.py").is_file()), None)  # fmt: skip
        if path is None:
            raise ImportError("No module named 'megatron.core'")
        spec = importlib.util.spec_from_file_location("_fp4_dist_megatron_package_info", path)
        package_info = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(package_info)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "fp4_dist.megatron needs megatron-core 0.19.x: pip install 'fp4_dist[megatron]' (Python 3.12+); on "
            "Python 3.11 first pip install --ignore-requires-python --no-binary megatron-core "
            f"'megatron-core=={TESTED_VERSIONS[-1]}'. Import failed: {e}"
        ) from e
    return package_info.__version__



def python_311_shim() -> None:
    """megatron.training (0.19) imports ``typing.override`` (Python 3.12); megatron-core runs on 3.11, so there
    the same decorator is provided from typing_extensions before anything imports megatron.training."""
    import sys
    import typing

    if sys.version_info < (3, 12) and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _resolve(module_name: str, name: str) -> tuple[Any, str]:
    python_311_shim()
    owner: Any = importlib.import_module(module_name)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, attr):
        raise RuntimeError(
            f"fp4_dist.megatron: hook target {module_name}.{name} does not exist in this megatron-core; "
            "the hook table was written for " + ", ".join(TESTED_VERSIONS)
        )
    return owner, attr



def patch(rows: Sequence[Hook]) -> list[tuple[Any, str, Any, bool]]:
    """Patch every binding of `rows`; returns (owner, attribute, original, whether the owner held it itself) per
    binding, in order. Every target is resolved before any is patched, so a missing one patches nothing."""
    targets = [(h, _resolve(m, h.name)) for h in rows for m in h.modules]
    done = []
    replacements: dict[int, Any] = {}
    for hook, (owner, attr) in targets:
        original = _raw_attr(owner, attr)
        owned = not isinstance(owner, type) or attr in owner.__dict__
        # One replacement object per row, built from the first binding's original, so identity checks
        # (`a is b`) across modules keep holding.
        if id(hook) not in replacements:
            replacements[id(hook)] = _wrap_like(original, hook.make(_unwrap(original)))
        setattr(owner, attr, replacements[id(hook)])
        done.append((owner, attr, original, owned))
    return done


def unpatch(done: Sequence[tuple[Any, str, Any, bool]]) -> None:
    """Put back every binding `patch` replaced, in reverse order."""
    for owner, attr, original, owned in reversed(done):
        if owned:
            setattr(owner, attr, original)
        else:  # an inherited method: the class gets its base's back, not a copy of it
            delattr(owner, attr)


def _raw_attr(owner, attr):
    # Class attributes: keep staticmethod/classmethod wrappers so uninstall restores them exactly.
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _unwrap(original):
    return original.__func__ if isinstance(original, (staticmethod, classmethod)) else original


def _wrap_like(original, replacement):
    if isinstance(original, staticmethod):
        return staticmethod(replacement)
    if isinstance(original, classmethod):
        return classmethod(replacement)
    return replacement

