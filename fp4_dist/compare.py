"""Byte comparison with a message that says where: the run-time parity checks (Megatron's --fp4-check-every,
the examples) and the tests share it."""

from __future__ import annotations

import torch


def bytes_mismatch(got: torch.Tensor, ref: torch.Tensor, label: str = "") -> str | None:
    """None when `got` and `ref` have the same shape and bits, else 'label: k/n bytes differ at first index i'."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"{label}: shape {list(got.shape)} != expected {list(ref.shape)}"
    g = got.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
    r = ref.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
    diff = (g != r).nonzero()
    if diff.numel() == 0:
        return None
    i = int(diff[0])
    return f"{label}: {diff.numel()}/{g.numel()} bytes differ, first at byte {i} (got {int(g[i]):#04x}, want {int(r[i]):#04x})"
