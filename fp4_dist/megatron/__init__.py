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
from ..format import DEFAULT_NUMERICS

__all__ = ["enable", "disable", "is_enabled"]


def enable(*, cpu: Optional[bool] = None, allow_untested_version: bool = False, columnwise: bool = False,
           numerics: str = DEFAULT_NUMERICS, compute_copy: bool = True, check_every: int = 0,
           log_json: Optional[str] = None) -> None:  # fmt: skip
    """Install the hook table into megatron-core (idempotent).

    Args:
        cpu: also install the CPU/gloo compatibility rows; default: when CUDA is unavailable.
        allow_untested_version: accept a megatron-core release outside the tested range.
        columnwise: build the NVFP4 weights' columnwise copies after every param all-gather (as
            TransformerEngine does). Off by default: the compute path reads the compute copies, not these.
        numerics, compute_copy: for the weights converted when ``megatron.training`` wraps the model in DDP.
        check_every: every N iterations of ``megatron.training``'s loop, check on every rank that the gathered
            NVFP4 weights equal ``quantize(full fp32 master)`` (0: off).
        log_json: rank 0 writes the run's record (losses, checks, master digests) to this path.
    Raises:
        RuntimeError for an unsupported megatron-core version or a missing hook target (nothing patched).
    """
    from . import adapter

    options = adapter.AdapterOptions(columnwise=columnwise, numerics=numerics, compute_copy=compute_copy,
                                     check_every=check_every, log_json=log_json)  # fmt: skip
    adapter.install(cpu=cpu, allow_untested_version=allow_untested_version, options=options)


def disable() -> None:
    """Undo `enable` (idempotent): every patched name gets its original object back."""
    from . import adapter

    adapter.uninstall()


def is_enabled() -> bool:
    from . import adapter

    return adapter.is_installed()
