"""What `fp4_dist.megatron.enable()` chooses for the whole run, and the choice in force."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from ..format import DEFAULT_NUMERICS


@dataclass(frozen=True, kw_only=True)
class AdapterOptions:
    """Choices `install` makes for the whole Megatron run."""

    columnwise: bool = False
    """Build the columnwise NVFP4 copies after every param all-gather, as TransformerEngine does. Nothing in
    Megatron's compute path through fp4_dist reads them (linears run on each weight's compute copy), so by
    default they are not built: ``columnwise_data`` stays None and ``make_columnwise()`` builds it on demand."""
    numerics: str = DEFAULT_NUMERICS
    """Block-scale formula of the weights converted when Megatron wraps the model in DDP ("te" or "te-2.14")."""
    compute_copy: bool = True
    """Converted weights keep a bf16 compute copy between updates (False: dequantize on every use)."""
    check_every: int = 0
    """Every N training iterations of ``megatron.training``'s loop, check on every rank that the gathered NVFP4
    weights equal ``quantize(full fp32 master)`` and stop with an error if not (0: off)."""
    log_json: Optional[str] = None
    """Rank 0 writes the run's record here (per-iteration loss, checks, master digests; `monitor`)."""


_options = AdapterOptions()


def current_options() -> AdapterOptions:
    """The options of the installed adapter (defaults when it is not installed)."""
    return _options


def set_options(options: AdapterOptions) -> None:
    global _options
    _options = options
