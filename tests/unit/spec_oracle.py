"""An independent statement of the spec in numpy float32, used to check `fp4_dist.kernels.reference`.

Written from docs/nvfp4_spec.md without looking at the torch reference: tiles by padding and reshaping,
E4M3 by nearest search in the table of all E4M3 values, E2M1 by nearest search in the E2M1 grid with ties to the
even code. Slow but obvious; use on small tensors.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _e4m3_table() -> np.ndarray:
    """Value of every non-negative finite E4M3 code 0..126 (0x7F is NaN)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _nearest_even(values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value; on a tie the even index. Values above the top saturate."""
    v = np.asarray(values, dtype=np.float64).reshape(-1, 1)
    dist = np.abs(v - grid.reshape(1, -1))
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    idx = np.where(cand.sum(axis=1) > 1, np.argmax(cand & (np.arange(grid.size) % 2 == 0), axis=1), np.argmax(cand, axis=1))
    idx = np.where(v[:, 0] >= grid[-1], grid.size - 1, idx)
    return idx.reshape(np.shape(values))


def e4m3_code(d: np.ndarray) -> np.ndarray:
    return _nearest_even(np.minimum(np.asarray(d, dtype=np.float64), 448.0), E4M3).astype(np.uint8)


def e2m1_code(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y, dtype=np.float32)
    mag = _nearest_even(np.abs(y).astype(np.float64), E2M1).astype(np.uint8)
    return mag | (np.signbit(y) & (y != 0)).astype(np.uint8) << 3


def quantize(w: np.ndarray, numerics: str = "te"):
    """-> (codes uint8 [M, K], tile scale codes uint8 [tm, tk], amax float32)."""
    x = np.asarray(w, dtype=np.float32)
    m, k = x.shape
    tm, tk = -(-m // 16), -(-k // 16)
    amax = F32(np.abs(x).max())
    s = F32(1.0) if amax == 0 else F32(min(F32(2688.0) / amax, FLT_MAX))
    s_dec = F32(F32(1.0) / s)
    padded = np.zeros((tm * 16, tk * 16), dtype=np.float32)
    padded[:m, :k] = np.abs(x)
    tile_amax = padded.reshape(tm, 16, tk, 16).max(axis=(1, 3))
    if numerics == "te":
        d = tile_amax * F32(s * F32(F32(1.0) / F32(6.0)))
    else:
        d = (tile_amax / F32(6.0)) * s
    d = np.minimum(d, FLT_MAX)
    scales = e4m3_code(d)
    with np.errstate(divide="ignore"):
        prod = (E4M3[scales].astype(np.float32) * s_dec).astype(np.float32)
        enc = np.minimum(F32(1.0) / prod, FLT_MAX).astype(np.float32)
    per_elem = np.repeat(np.repeat(enc, 16, axis=0), 16, axis=1)[:m, :k]
    codes = e2m1_code((x * per_elem).astype(np.float32))
    return codes, scales, amax


def pack(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
