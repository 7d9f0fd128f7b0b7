"""fp4_dist as the NVFP4 backend of Megatron-Core's ``--fp4-param-gather`` path (no TransformerEngine).

Megatron-LM's own scripts need one changed launch line::

    torchrun --nproc-per-node 8 -m fp4_dist.megatron.run pretrain_gpt.py <Megatron arguments> --fp4-param-gather

Your own script::

    import fp4_dist.megatron
    fp4_dist.megatron.enable()        # patch megatron-core's NVFP4 hook points (see adapter.HOOKS)
    ... megatron.training.pretrain(...)   # converts the linear weights before DDP; or, building DDP yourself,
    ... fp4_dist.megatron.model.convert_to_nvfp4(model, config) before DistributedDataParallel
    fp4_dist.megatron.disable()       # restore megatron-core exactly

Importing this package does not import megatron; `enable()` does. On a machine without CUDA, `enable()`
also installs the small CPU/gloo compatibility layer (`cpu_compat`), so the same Megatron code runs on CPU
ranks (docs/megatron.md).
"""

from __future__ import annotations

from typing import Optional

from .options import AdapterOptions

__all__ = ["enable", "disable", "is_enabled", "AdapterOptions"]


def enable(*, cpu: Optional[bool] = None, options: Optional[AdapterOptions] = None, **choices) -> None:
    """Install the hook table into megatron-core (idempotent).

    Args:
        cpu: also install the CPU/gloo compatibility rows; default: when CUDA is unavailable.
        options: the run's `AdapterOptions` (numerics, lean compute, columnwise copies, parity checks, run record,
            untested megatron-core versions: one definition, shared with the launcher's flags); or give its fields
            as keywords (``enable(check_every=10)``), not both.
    Raises:
        TypeError for an unknown option; RuntimeError for an unsupported megatron-core version or a missing hook
        target (nothing patched).
    """
    from dataclasses import fields

    from . import adapter

    if options is not None and choices:
        raise TypeError(f"fp4_dist.megatron.enable: give options= or its fields as keywords, not both (got options "
                        f"and {sorted(choices)})")
    if options is None:
        known = [f.name for f in fields(AdapterOptions)]
        unknown = sorted(set(choices) - set(known))
        if unknown:
            raise TypeError(f"fp4_dist.megatron.enable: unknown option(s) {unknown}; the options are {known}")
        options = AdapterOptions(**choices)
    adapter.install(cpu=cpu, allow_untested_version=options.allow_untested_version, options=options)


def disable() -> None:
    """Undo `enable` (idempotent): every patched name gets its original object back."""
    from . import adapter

    adapter.uninstall()


def is_enabled() -> bool:
    from . import adapter

    return adapter.is_installed()
