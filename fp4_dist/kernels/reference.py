"""The NVFP4 2D numeric contract in plain eager PyTorch: CPU path and the oracle of every kernel.

Formula chain for a weight W[M, K] (spec docs/nvfp4_spec.md section 2), all IEEE fp32, one op at a time:

    x    = fp32(round_to(W))                      masters are rounded to the model dtype (bf16) first
    A    = max|x|                                 (NaN counts as +inf, so it can never hide)
    S    = min(2688 / A, FLT_MAX);  S = 1 if A == 0
    Sdec = 1 / S
    a_t  = max|x| over 16x16 tile t
    d_t  = min(a_t * (S * R6), FLT_MAX)           R6 = fp32(1/6); numerics "te-2.14": (a_t / 6) * S
    s_t  = e4m3_rne_satfinite(d_t)                stored scale byte; a_t == 0 gives 0
    e_t  = min(1 / (float(s_t) * Sdec), FLT_MAX)  multiply first, then one reciprocal; s_t == 0 gives FLT_MAX
    y    = x * e_t  ->  E2M1 code by the RNE threshold table, sign bit when y < 0
    byte = code(2i) | code(2i + 1) << 4           even column in the low nibble

Details that are easy to "simplify" wrongly:
- Every division here divides two full tensors. PyTorch's CUDA `tensor / python_scalar` multiplies by the
  reciprocal (not correctly rounded) and `S * (1/6)` is not `S / 6`; both change bytes.
- The reciprocal of the product `float(s_t) * Sdec` is not `S / float(s_t)`: those differ by an ulp.
- Dequantization uses `(float(s_t) * A) * fp32(1/2688)`, not `float(s_t) * Sdec`.
- A tile scale of 0 (all-zero tile, or d_t below half the smallest E4M3 subnormal) makes e_t = FLT_MAX; the
  codes of such a tile can be nonzero but dequantize to 0, exactly as TransformerEngine stores them.
- The stage functions work on a flat shard [start, start + n) of the row-major weight, so the partial cast
  (ZeRO) and the full quantization are one code path: the full weight is the shard starting at 0.
- Never run this under torch.compile: compiled code was measured to give other bytes (spec section 2).
"""

from __future__ import annotations

import torch

from ..format import (
    DEFAULT_NUMERICS,
    has_columnwise,
    E2M1_VALUES,
    E4M3_MAX,
    GLOBAL_SCALE_NUMERATOR,
    TILE,
    check_numerics,
    columnwise_data_shape,
    columnwise_scale_shape,
    is_tile_grid,
    rowwise_scale_shape,
    tile_grid,
)

FLT_MAX = torch.finfo(torch.float32).max

# E2M1 round-to-nearest-even as thresholds on |y|: the code is the number of thresholds passed.
# Ties at 0.25, 1.25, 2.5 round down to the even code, ties at 0.75, 1.75, 3.5 round up to it.
_STRICT = (0.25, 1.25, 2.5, 5.0)  # |y| >  t
_INCLUSIVE = (0.75, 1.75, 3.5)  # |y| >= t


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value, dtype=torch.float32)


def round_to_model_dtype(x: torch.Tensor, round_to: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp32 copy of `x` after round-to-nearest-even to the model dtype (bf16 values promote exactly)."""
    return x.to(round_to).to(torch.float32)


def _abs_nan_as_inf(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)


def _shard_coords(start: int, n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each element of the flat shard [start, start + n) in a row-major [*, k] weight."""
    idx = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return idx // k, idx % k


def _shard_tile_index(start: int, n: int, m: int, k: int, device) -> torch.Tensor:
    rows, cols = _shard_coords(start, n, k, device)
    return (rows // TILE) * tile_grid(m, k)[1] + cols // TILE


def shard_tile_amax(
    shard: torch.Tensor | None,
    start: int,
    m: int,
    k: int,
    round_to: torch.dtype = torch.bfloat16,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile and whole-shard max|x| of the owned elements.

    Args:
        shard: flat fp32/bf16 elements [start, start + n) of the row-major [m, k] weight, or None.
    Returns:
        (tile_amax fp32 [tiles_m, tiles_k], 0 where the shard owns nothing; shard_amax fp32 [1]).
    """
    tm, tk = tile_grid(m, k)
    dev = shard.device if shard is not None else device
    tiles = torch.zeros(tm * tk, dtype=torch.float32, device=dev)
    if shard is None or shard.numel() == 0:
        return tiles.view(tm, tk), torch.zeros(1, dtype=torch.float32, device=dev)
    a = _abs_nan_as_inf(round_to_model_dtype(shard.reshape(-1), round_to))
    tiles.scatter_reduce_(0, _shard_tile_index(start, a.numel(), m, k, dev), a, reduce="amax")
    return tiles.view(tm, tk), a.max().reshape(1)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S = min(2688 / A, FLT_MAX), or 1 where A == 0. Shape of `amax`, fp32."""
    s = torch.clamp(_full(amax, GLOBAL_SCALE_NUMERATOR) / amax, max=FLT_MAX)
    return torch.where(amax == 0, _full(amax, 1.0), s)


def e4m3_rne_satfinite(d: torch.Tensor) -> torch.Tensor:
    """E4M3 bits (uint8) of non-negative fp32 values: RNE, subnormals kept, >= 448 and inf give 448, NaN gives 0x7F
    (the kernels' `e4m3_rne_satfinite`, and TransformerEngine's): whatever its sign bit, which the NaN an x86 CPU
    computes (inf * 0) carries and torch's conversion would keep."""
    bits = torch.clamp(d, max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(d), torch.full_like(bits, 0x7F), bits)


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def tile_scales(tile_amax: torch.Tensor, amax: torch.Tensor, numerics: str = DEFAULT_NUMERICS) -> torch.Tensor:
    """E4M3 tile scale bytes s_t (uint8, shape of `tile_amax`) from tile amaxes and the tensor amax."""
    s = global_encode_scale(amax.reshape(1))
    if check_numerics(numerics) == "te":
        r6 = _full(s, 1.0) / _full(s, 6.0)
        d = tile_amax * (s * r6)
    else:
        d = (tile_amax / _full(tile_amax, 6.0)) * s
    return e4m3_rne_satfinite(torch.clamp(d, max=FLT_MAX))


def encode_multipliers(scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """e_t = min(1 / (float(s_t) * Sdec), FLT_MAX), fp32, shape of `scales`."""
    s = global_encode_scale(amax.reshape(1))
    s_dec = _full(s, 1.0) / s
    prod = e4m3_to_float(scales) * s_dec
    return torch.clamp(_full(prod, 1.0) / prod, max=FLT_MAX)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8 0..15) of fp32 `y` by RNE with saturation; sign bit when y < 0."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t in _STRICT:
        code += (a > t).to(torch.uint8)
    for t in _INCLUSIVE:
        code += (a >= t).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def expand_rowwise_scales(scales: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Row-expanded `rowwise_scale_inv`: row r holds the scales of tile row r // 16; padding zero."""
    out = torch.zeros(rowwise_scale_shape(m, k), dtype=torch.uint8, device=scales.device)
    out[:m, : scales.shape[1]] = scales.repeat_interleave(TILE, dim=0)[:m]
    return out


def cast_shard(
    shard: torch.Tensor | None,
    start: int,
    m: int,
    k: int,
    enc: torch.Tensor,
    fragment: torch.Tensor | None,
    round_to: torch.dtype = torch.bfloat16,
) -> None:
    """Write the E2M1 nibbles of the owned elements into `fragment`, leaving every other nibble as it was.

    Args:
        shard: flat fp32/bf16 elements [start, end) of the row-major [m, k] weight (None/empty: no-op).
        enc: fp32 [tiles_m, tiles_k] encode multipliers (`encode_multipliers`).
        fragment: uint8 bytes [start >> 1, (end + 1) >> 1) of `rowwise_data.view(-1)`; the byte of element
            j is (j >> 1) - (start >> 1), its low nibble when j is even.
    """
    if shard is None or shard.numel() == 0:
        return
    n = shard.numel()
    x = round_to_model_dtype(shard.reshape(-1), round_to)
    codes = e2m1_codes(x * enc.reshape(-1)[_shard_tile_index(start, n, m, k, x.device)])
    first = 2 * (start >> 1)  # element held by the low nibble of fragment[0]
    nibbles = torch.stack((fragment & 0x0F, fragment >> 4), dim=1).reshape(-1)
    nibbles[start - first : start - first + n] = codes
    pairs = nibbles.view(-1, 2)
    fragment.copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] packed bytes -> uint8 [..., n] codes, even index from the low nibble."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] codes (n even) -> [..., n/2] bytes, even index into the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def transpose_nibbles(rowwise_data: torch.Tensor) -> torch.Tensor:
    """[M, K/2] packed rowwise codes -> [K, M/2] packed codes of the transpose (M even)."""
    m, k = rowwise_data.shape[0], rowwise_data.shape[1] * 2
    if not has_columnwise(m):
        raise ValueError(f"columnwise NVFP4 data needs an even M to pack pairs of rows, got M = {m}")
    out = pack_nibbles(unpack_nibbles(rowwise_data).t().contiguous())
    assert out.shape == columnwise_data_shape(m, k), "nibble transpose produced a wrong shape"
    return out


def transpose_scales(rowwise_scale_inv: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Columnwise scales [roundup(K,128), roundup(ceil(M/16),4)] from the rowwise ones; padding zero."""
    tm, tk = tile_grid(m, k)
    tiles = rowwise_scale_inv[0 : m : TILE, :tk]  # [tm, tk]: row 16*t holds tile row t
    out = torch.zeros(columnwise_scale_shape(m, k), dtype=torch.uint8, device=rowwise_scale_inv.device)
    out[:k, :tm] = tiles.t().repeat_interleave(TILE, dim=0)[:k]
    return out


def quantize(x: torch.Tensor, numerics: str = DEFAULT_NUMERICS, round_to: torch.dtype = torch.bfloat16):
    """Quantize a whole 2D weight: (rowwise_data [M, K/2], rowwise_scale_inv, amax [1], tile scales [tm, tk])."""
    m, k = x.shape
    flat = x.reshape(-1)
    tile_amax, amax = shard_tile_amax(flat, 0, m, k, round_to)
    scales = tile_scales(tile_amax, amax, numerics)
    data = torch.zeros(m, k // 2, dtype=torch.uint8, device=x.device)
    cast_shard(flat, 0, m, k, encode_multipliers(scales, amax), data.view(-1), round_to)
    return data, expand_rowwise_scales(scales, m, k), amax, scales


def dequantize(
    rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, amax: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """[M, K] values: e2m1_value * ((float(s_t) * A) * fp32(1/2688)), evaluated left to right.

    `rowwise_scale_inv` is the row-expanded form or the compact tile grid [ceil(M/16), ceil(K/16)] (one byte per
    16x16 tile, as all-gathered): the same tile scales, so the same values.
    """
    m, k = rowwise_data.shape[0], rowwise_data.shape[1] * 2
    if is_tile_grid(rowwise_scale_inv.shape, m, k):
        rowwise_scale_inv = expand_rowwise_scales(rowwise_scale_inv, m, k)
    codes = unpack_nibbles(rowwise_data).to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=rowwise_data.device)
    values = table[codes & 0x7]
    values = torch.where((codes & 0x8) != 0, -values, values)
    tile_row_scales = e4m3_to_float(rowwise_scale_inv[:m, : tile_grid(m, k)[1]])
    per_elem = tile_row_scales.repeat_interleave(TILE, dim=1)[:, :k]
    a = amax.reshape(1).to(torch.float32)
    inv = _full(a, 1.0) / _full(a, GLOBAL_SCALE_NUMERATOR)
    return (values * ((per_elem * a) * inv)).to(dtype)
