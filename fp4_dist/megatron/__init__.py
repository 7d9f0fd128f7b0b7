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

Modules::

    run.py           the launcher: ``python -m fp4_dist.megatron.run SCRIPT ...``
    spawned.py       the main of a process multiprocessing spawns from a launcher rank on Python 3.11 (the shim first)
    options.py       AdapterOptions: what a run chooses, its flags, the choice in force
    defaults.py      the Megatron flags a machine needs and a command line may leave out
    adapter.py       the hook table: every patch fp4_dist makes to megatron-core, one row each
    patching.py      the patch engine under it (`Hook`, `patch`, `unpatch`)
    startup.py       start-up rows: argument checks, refusals, the conversion before DDP, initialization
    buffers.py       the byte path's rows: tensor test, storage alias, shard cast, post-all-gather, packed layout
    layers.py        layer rows: the parallel linears compute on the weight's copy (or in the FP8 mode)
    lean_claim.py    the lean uses Megatron's linear function claims, refilled before its backward reads them
    mode_linear.py   the parallel linear of a compute mode with GEMMs of its own (--compute fp8)
    gradnorm.py      the distributed optimizer's gradient norm, summed by parameter name, read once
    checkpoint.py    checkpoint rows: the distributed optimizer's own checkpoints load without apex or TE
    safe_globals.py  what a ``--ckpt-format torch`` checkpoint may hold beyond tensors
    model.py         GPTModel with NVFP4 linear weights from init (`convert_to_nvfp4`)
    parallel.py      which of Megatron's process groups a weight's NVFP4 scales and masters follow
    parity.py        the check that the gathered weights equal ``quantize(full master)`` on every rank
    monitor.py       the parity check and the run record inside ``megatron.training``'s loop
    cpu_compat.py    the CPU/gloo layer: Megatron-Core's DDP, optimizer and GPTModel on CPU ranks
    pretrain_gpt.py  deprecated: ``python -m fp4_dist.megatron.pretrain_gpt`` runs
                     ``python -m examples.megatron_pretrain_gpt`` (one release of grace)
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
