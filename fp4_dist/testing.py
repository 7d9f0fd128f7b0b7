"""Pytest-free helpers for bitwise tests: byte comparison with a useful message, poisoning, awkward shapes."""

from __future__ import annotations

import random
from typing import Iterator

import torch

from .compare import bytes_mismatch  # noqa: F401  (re-exported for tests)

POISON_BYTE = 0xA5
"""Written into outputs before a kernel runs: a byte the kernel should have written but did not shows up."""


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with a value no correct kernel output has by accident (uint8 0xA5, NaN for floats)."""
    if t.dtype == torch.uint8:
        return t.fill_(POISON_BYTE)
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-0x5A5A5A5A)


def assert_bytes_equal(got: torch.Tensor, ref: torch.Tensor, label: str = "") -> None:
    msg = bytes_mismatch(got, ref, label)
    if msg is not None:
        raise AssertionError(msg)


def random_weight(m: int, k: int, *, heavy_tailed: bool = False, generator=None, device="cpu") -> torch.Tensor:
    """fp32 [m, k] values, Gaussian or heavy-tailed (Student-t-like), with a spread of tile magnitudes."""
    x = torch.randn(m, k, generator=generator)
    if heavy_tailed:
        x = x / torch.rand(m, k, generator=generator).clamp_min(1e-3).sqrt()
    rows = torch.exp(torch.randn(m, 1, generator=generator) * 2)  # tiles with very different amaxes
    return (x * rows).to(device)


def awkward_shapes(rng: random.Random, count: int, max_m: int = 80, ks=(16, 48, 80, 128, 144)) -> list[tuple[int, int]]:
    """Shapes with ragged M (not a multiple of 16, sometimes odd) and K % 64 != 0."""
    return [(rng.randint(1, max_m), rng.choice(ks)) for _ in range(count)]


def shard_cuts(numel: int, parts: int, rng: random.Random, even: bool = True) -> Iterator[tuple[int, int]]:
    """`parts` contiguous [start, end) ranges covering [0, numel) cut at random points (mid-tile, mid-row);
    some ranges may be empty. With even=True every cut is an even element offset."""
    cuts = sorted(rng.randint(0, numel) for _ in range(parts - 1))
    if even:
        cuts = [c - (c % 2) for c in cuts]
    bounds = [0, *cuts, numel]
    for a, b in zip(bounds, bounds[1:]):
        yield a, b


def numerics_sensitive_weight(m: int = 32, k: int = 32) -> torch.Tensor:
    """fp32 [m, k] (bf16 values) on which the two numerics, "te" and "te-2.14", give different scale bytes: one
    element is the tensor amax A, another a tile amax where a_t * (S * fp32(1/6)) and (a_t / 6) * S round to
    different E4M3 codes (found by search, as in the reference tests)."""
    import numpy as np

    from .kernels import reference as R

    def bf16(v):
        return torch.tensor(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).float()

    rng = np.random.default_rng(0)
    for a in bf16(rng.uniform(1, 100, 2000)).tolist():
        tiles = torch.unique(bf16(np.geomspace(a / 1024, a, 4000)))
        amax = torch.tensor([a])
        new, old = R.tile_scales(tiles, amax, "te"), R.tile_scales(tiles, amax, "te-2.14")
        diff = (new != old).nonzero()
        if diff.numel():
            w = torch.zeros(m, k)
            w[0, 0], w[min(5, m - 1), min(17, k - 1)] = a, float(tiles[int(diff[0])])
            return w
    raise AssertionError("no tile amax found on which the numerics differ")


def extreme_nvfp4_bytes(seed: int, m: int = 256, k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [m, k/2], compact tile scales [m/16, k/16]) of an NVFP4 weight with every kind of value side by
    side: random codes under tile scales anywhere in E4M3's range, the largest (448) beside subnormal ones, so one
    128 x 128 block holds the largest element values (6 x 448 = 2688 in units of the global scale) and the finest
    (2^-10)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8)
    tiles = torch.randint(0, 0x7F, (m // 16, k // 16), generator=g, dtype=torch.uint8)
    tiles[::3, ::2] = torch.randint(0, 4, tiles[::3, ::2].shape, generator=g, dtype=torch.uint8)
    tiles[0, 0] = 0x7E
    return data, tiles
