"""Buffers that a kernel writes whole, allocated without the fill of torch's deterministic mode.

Under ``torch.use_deterministic_algorithms(True)`` (Megatron's ``--deterministic-mode``) ``torch.empty`` fills new
memory (``torch.utils.deterministic.fill_uninitialized_memory``) so that a read of memory nobody wrote gives the same
values every run. A buffer that a kernel writes every byte of needs no fill: the FP8 compute mode's kernels that use
this do (their tests poison the outputs first and compare every byte), and so does a GEMM's result. The fills would
cost a Megatron step in the FP8 compute mode about 9 ms of device time at GPT 4096 (an activation's FP8 copies, the
dgrad's weight transpose, every `scaled_mm` result), where a bf16 step's GEMMs allocate without them.

The fill setting is torch's, process-wide: while `unfilled` holds it off (one allocation, or one GEMM call), another
thread's allocations skip the fill too. A training step allocates from one thread (its backward on the device's
autograd thread while the caller waits), so this touches nothing else there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.utils.deterministic as _deterministic

__all__ = ["empty", "unfilled"]


def _filling() -> bool:
    return torch.are_deterministic_algorithms_enabled() and _deterministic.fill_uninitialized_memory


@contextlib.contextmanager
def unfilled() -> Iterator[None]:
    """Allocations inside skip the deterministic fill: only for buffers that what runs inside writes whole."""
    if not _filling():
        yield
        return
    _deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        _deterministic.fill_uninitialized_memory = True


def empty(*size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for a kernel's output that it writes every byte of (no deterministic fill)."""
    if not _filling():
        return torch.empty(*size, dtype=dtype, device=device)
    with unfilled():
        return torch.empty(*size, dtype=dtype, device=device)
