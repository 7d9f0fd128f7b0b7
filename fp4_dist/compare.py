"""Byte comparison with a message that says where: the run-time parity checks (Megatron's --fp4-check-every,
the examples) and the tests share it."""

from __future__ import annotations

import torch


def bytes_mismatch(got: torch.Tensor, ref: torch.Tensor, label: str = "") -> str | None:
    """None when `got` and `ref` have the same shape and bits, else 'label: k/n bytes differ at first index i'."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"{label}: shape {list(got.shape)} != expected {list(ref.shape)}"
    g = _flat_bytes(got).cpu()
    r = _flat_bytes(ref).cpu()
    diff = (g != r).nonzero()
    if diff.numel() == 0:
        return None
    i = int(diff[0])
    return f"{label}: {diff.numel()}/{g.numel()} bytes differ, first at byte {i} (got {int(g[i]):#04x}, want {int(r[i]):#04x})"


def mismatches(pairs) -> list[str]:
    """`bytes_mismatch` of each (label, got, ref) in `pairs`, for the pairs that differ. The bytes are compared
    where they live, and one host read of all the verdicts follows (a GPU's tensors are not copied to the host
    unless they differ, and then only to say where)."""
    pairs = list(pairs)
    shaped = [tuple(got.shape) == tuple(ref.shape) for _, got, ref in pairs]
    flags = [differs(got, ref) for (_, got, ref), same in zip(pairs, shaped) if same]
    verdicts = iter(torch.stack([f.to(flags[0].device) for f in flags]).tolist() if flags else [])
    # A pair of other shapes has no verdict: it differs, and `next` is not called for it.
    return [bytes_mismatch(got, ref, label) for (label, got, ref), same in zip(pairs, shaped)
            if not same or next(verdicts)]


def differs(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on `got`'s device: whether the bytes of `got` and `ref` (same shape) differ anywhere. No
    host read: the caller reads many at once."""
    return torch.ne(_flat_bytes(got), _flat_bytes(ref).to(got.device)).any()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes in element order, flat (a size-1 last dimension may carry any stride, which a byte view refuses)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
