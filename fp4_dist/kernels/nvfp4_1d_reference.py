"""Activations and gradients as NVFP4 with one E4M3 scale per 1 x 16 block, in plain eager PyTorch: the CPU path of
the nvfp4 compute mode and the oracle of its CUDA kernels (`kernels.nvfp4_1d`). Equal, bit for bit, to
TransformerEngine's pure-PyTorch reference quantizer (`NVFP4QuantizerRef`, 1 x 16 tiles) on the golden data of
tests/unit/kernels/golden/.

A row of x [R, C] is cut into blocks of 16 along C (the last one ragged: zero padding, which changes no amax), and
the scale chain is the weight's (`kernels.reference`), with a block of 1 x 16 where a weight has a tile of 16 x 16:

    A    = max|x| over the whole tensor (fp32 of the model-dtype values)
    S    = min(2688 / A, FLT_MAX);  S = 1 if A == 0
    d_b  = min(a_b * (S * fp32(1/6)), FLT_MAX);  s_b = e4m3_rne_satfinite(d_b)    a_b = max|x| over block b
    e_b  = min(1 / (float(s_b) * (1 / S)), FLT_MAX)
    y    = x * e_b  ->  E2M1 code: round to nearest even (`quantize_rows_1x16`) or stochastically (`..._sr`)

Stochastic rounding takes 8 random bits r per element, as TransformerEngine's software fallback for Blackwell's
``cvt.rs`` does (`transformer_engine/common/util/ptx.cuh`, `stochastic_round_fp4_e2m1`): with `step` the E2M1
spacing at |y| (0.5 below 2, 1 below 4, else 2), t = |y| + r * step / 256 (exact: one fp32 add, no product rounds),
then t floored to the E2M1 grid at t's own spacing and saturated at 6; NaN gives +6. |y| rounds up to the next grid
value with probability (|y| - lo) / step, to 1/256: unbiased wherever that fraction is a multiple of 1/256. The bits
are a counter-based hash: the top byte of splitmix64 at (seed, i) for element i of the block-padded tensor
(`stochastic_bits`), computed here in torch int64 and in the CUDA kernel in uint64, so one seed gives the same bits
on the CPU and on a GPU. Each quantization takes one seed (`draw_seed`: from torch's default CPU generator, a host
draw). TransformerEngine draws its bits from Philox streams laid out by its kernels' threads, which no other code
reproduces (docs/nvfp4_recipe.md).

The random Hadamard transform (`rht_16`) multiplies each 16-element group of a row by H = diag(signs) @ H16 / 4,
H16 the Sylvester Hadamard matrix and `signs` TransformerEngine's fixed sign vector: fp32 sums of the 16 products
(each exact) in a fixed order, rounded once to the input's dtype, as TransformerEngine's kernels and its reference
give wherever the sum is exact (bf16 data spanning up to 16 binades in a group; the golden cases). H is
orthogonal, so (a H)(b H)^T = a b^T: applied to both operands along the contraction, it changes nothing but the
rounding.

Details that are easy to "simplify" wrongly:
- The per-tensor amax of a transformed operand is taken after the transform (TransformerEngine's post-RHT amax).
- The sign bit is set when y < 0: exact -0.0 gives code 0, a negative value that rounds to zero gives 0x8.
- Never run this under torch.compile: compiled code was measured to give other bytes (spec section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..format import E2M1_VALUES, TILE, ceil_div
from .reference import e2m1_codes, e4m3_to_float, encode_multipliers, pack_nibbles, tile_scales, unpack_nibbles

__all__ = ["RHT_SIGNS", "Nvfp4Rows", "hadamard_16", "rht_16", "quantize_rows_1x16", "quantize_rows_1x16_sr",
           "transposed_operand", "quantize_cols_1x16", "quantize_cols_1x16_sr", "draw_seed", "splitmix64",
           "stochastic_bits", "stochastic_e2m1_codes", "unscaled_values", "values", "gemm_alpha"]  # fmt: skip

BLOCK = TILE
"""Elements per scale along a row."""

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TransformerEngine's sign vector of the wgrad transform (`get_wgrad_sign_vector`): fixed, not drawn at run time."""

GEMM_ALPHA_DIVISOR = 36.0 * 448.0 * 448.0
"""2688^2: a product of two NVFP4 values carries (A_a / 2688) (A_b / 2688), applied once in the GEMM's epilogue."""


@dataclass(frozen=True)
class Nvfp4Rows:
    """A [rows, cols] tensor in NVFP4 with 1 x 16 block scales: value[r, c] = e2m1(code[r, c]) * float(scales[r,
    c // 16]) * (amax / 2688)."""

    data: torch.Tensor
    """uint8 [rows, ceil(cols / 2)]: packed codes, even column in the low nibble (an odd last column's high
    nibble holds code 0)."""
    scales: torch.Tensor
    """uint8 [rows, ceil(cols / 16)]: E4M3 bits of each block's scale (compact: no padding rows or columns)."""
    amax: torch.Tensor
    """fp32 [1]: the tensor's amax (after the transform, for a transformed operand)."""
    cols: int
    """The logical number of columns."""


def hadamard_16(device=None) -> torch.Tensor:
    """fp32 [16, 16]: diag(RHT_SIGNS) @ H16 * 1/4 (every entry +-1/4, exact), orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < BLOCK:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)
    return signs[:, None] * h * 0.25


def rht_16(x: torch.Tensor) -> torch.Tensor:
    """x [R, C] (C % 16 == 0) with each 16-element group of a row times `hadamard_16`, in x's dtype: out_k = the fp32
    products x_i * H[i, k] (each exact) added to +0 in the order i = 0..15, rounded once to x's dtype. The order is
    fixed (not a matmul's) so that the CUDA kernel gives the same bits where a sum rounds (fp32 inputs, or bf16 ones
    whose 16 values span more than 16 binades)."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"rht_16: x must be 2D with a multiple of {BLOCK} columns, got shape {list(x.shape)}")
    groups = x.to(torch.float32).reshape(-1, BLOCK)
    h = hadamard_16(x.device)
    out = torch.zeros_like(groups)
    for i in range(BLOCK):
        out = out + groups[:, i : i + 1] * h[i]
    return out.reshape(x.shape).to(x.dtype)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """fp32 [R, ceil(C/16), 16]: x's values, zero-padded to whole blocks."""
    if x.dim() != 2:
        raise ValueError(f"NVFP4 1 x 16 quantization takes a 2D tensor [rows, columns], got shape {list(x.shape)}")
    r, c = x.shape
    padded = x.new_zeros(r, ceil_div(c, BLOCK) * BLOCK, dtype=torch.float32)
    padded[:, :c] = x
    return padded.view(r, -1, BLOCK)


def _scaled(x: torch.Tensor, amax: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y = x * e_b [R, ceil16(C)] fp32, scale bytes [R, ceil(C/16)], amax [1]) of x [R, C]."""
    blocks = _blocks(x)
    a = blocks.abs().amax(dim=(0, 1, 2)).reshape(1) if amax is None else amax.reshape(1).to(torch.float32)
    if blocks.numel() == 0:
        a = torch.zeros(1, dtype=torch.float32, device=x.device)
    scales = tile_scales(blocks.abs().amax(dim=-1), a)
    y = blocks * encode_multipliers(scales, a).unsqueeze(-1)
    return y.reshape(x.shape[0], -1), scales, a


def quantize_rows_1x16(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Nvfp4Rows:
    """x [R, C] (any float dtype) in NVFP4 1 x 16 blocks, E2M1 round to nearest even. `amax`: the tensor's amax
    when known (one all-reduced over ranks, say); None: max|x|."""
    y, scales, a = _scaled(x, amax)
    return Nvfp4Rows(_packed(e2m1_codes(y), x.shape[1]), scales, a, x.shape[1])


def quantize_rows_1x16_sr(x: torch.Tensor, seed: Optional[int] = None,
                          amax: Optional[torch.Tensor] = None) -> Nvfp4Rows:  # fmt: skip
    """`quantize_rows_1x16` with stochastic rounding of the E2M1 values (module docstring): the 8 random bits of
    element i of the block-padded [R, 16 ceil(C/16)] are `stochastic_bits` of (`seed`, i) (None: `draw_seed()`), so
    a seed gives the same bits on every device. The scales and amax are those of round to nearest."""
    y, scales, a = _scaled(x, amax)
    rbits = stochastic_bits(draw_seed() if seed is None else seed, y.shape[0], y.shape[1], y.device)
    return Nvfp4Rows(_packed(stochastic_e2m1_codes(y, rbits), x.shape[1]), scales, a, x.shape[1])


def transposed_operand(t: torch.Tensor, rht: bool) -> torch.Tensor:
    """t [T, C] (tokens first) as the wgrad GEMM reads it before quantization: pad16(t)^T [C, T16] (tokens
    zero-padded to 16 | T16), through `rht_16` along the tokens when `rht`."""
    padded = t.new_zeros(ceil_div(t.shape[0], BLOCK) * BLOCK, t.shape[1])
    padded[: t.shape[0]] = t
    transposed = padded.t().contiguous()
    return rht_16(transposed) if rht else transposed


def quantize_cols_1x16(t: torch.Tensor, rht: bool) -> Nvfp4Rows:
    """`quantize_rows_1x16` of `transposed_operand(t, rht)`: a wgrad operand, round to nearest even (its amax the
    transformed values' when `rht`)."""
    return quantize_rows_1x16(transposed_operand(t, rht))


def quantize_cols_1x16_sr(t: torch.Tensor, rht: bool, seed: Optional[int] = None) -> Nvfp4Rows:
    """`quantize_rows_1x16_sr` of `transposed_operand(t, rht)`: a wgrad operand, rounded stochastically."""
    return quantize_rows_1x16_sr(transposed_operand(t, rht), seed)


SEED_BOUND = 1 << 63
"""Seeds of the stochastic rounding are integers in [0, SEED_BOUND) (int64 on both sides)."""


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A seed for one stochastic rounding, drawn from `generator` (None: torch's default CPU generator, so
    ``torch.manual_seed`` reproduces it and a checkpoint's RNG state resumes it). A host draw: no device sync."""
    return int(torch.randint(0, SEED_BOUND - 1, (1,), generator=generator, dtype=torch.int64))


_GAMMA = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _signed(c: int) -> int:
    """The int64 with the 64 bits of c (0 <= c < 2^64)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift of int64 bits (torch's >> on int64 is arithmetic: the sign bits are masked off)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def splitmix64(seed: int, index: torch.Tensor) -> torch.Tensor:
    """int64 bits of splitmix64's output at counter index + 1 of the stream `seed` (wrapping int64 arithmetic, the
    same bits as the CUDA kernel's uint64): z = seed + (i + 1) * gamma, then the murmur3-style finalizer."""
    if not 0 <= seed < SEED_BOUND:
        raise ValueError(f"stochastic rounding seed must be in [0, 2^63), got {seed}")
    z = (index + 1) * _signed(_GAMMA) + seed
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX[0])
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX[1])
    return z ^ _shift_right(z, 31)


def stochastic_bits(seed: int, rows: int, cols: int, device=None) -> torch.Tensor:
    """int16 [rows, cols] in 0..255: the top byte of `splitmix64(seed, i)` for element i = r * cols + c. A pure
    function of (seed, i), unlike TransformerEngine's Philox streams laid out by its kernels' threads, so the CPU
    and the CUDA kernel (`cuda/nvfp4_1d.cu`, sr_byte) give the same bits."""
    index = torch.arange(rows * cols, dtype=torch.int64, device=device).view(rows, cols)
    return _shift_right(splitmix64(seed, index), 56).to(torch.int16)


def _packed(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """The packed bytes of the logical columns (TransformerEngine's shape): the block padding is dropped."""
    return pack_nibbles(codes)[:, : ceil_div(cols, 2)].contiguous()


def _spacing(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid's spacing at magnitude a: 0.5 below 2, 1 below 4, 2 from 4 on."""
    return torch.where(a >= 4.0, 2.0, torch.where(a >= 2.0, 1.0, 0.5)).to(torch.float32)


def stochastic_e2m1_codes(y: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of fp32 `y`, rounded stochastically with the random bytes `rbits` (integers 0..255,
    y's shape); sign bit when y < 0, NaN gives +6 (code 7)."""
    a = y.abs()
    # r * step / 256 is exact (step a power of two), so this one add is TransformerEngine's fmaf(u, step, a).
    t = a + rbits.to(torch.float32) * (_spacing(a) / 256.0)
    step_t = _spacing(t)  # the jitter may carry t into the next binade: floor at t's own spacing
    q = torch.clamp(torch.floor(t / step_t) * step_t, max=6.0)
    q = torch.where(torch.isnan(y), torch.full_like(q, 6.0), q)
    return e2m1_codes(q) | ((y < 0).to(torch.uint8) << 3)


def _e2m1(q: Nvfp4Rows) -> torch.Tensor:
    """fp32 [rows, cols]: the signed E2M1 values of q's codes."""
    codes = unpack_nibbles(q.data)[:, : q.cols].to(torch.int64)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=q.data.device)
    mags = table[codes & 0x7]
    return torch.where((codes & 0x8) != 0, -mags, mags)


def _block_scales(q: Nvfp4Rows) -> torch.Tensor:
    """fp32 [rows, cols]: each element's block scale."""
    return e4m3_to_float(q.scales).repeat_interleave(BLOCK, dim=1)[:, : q.cols]


def unscaled_values(q: Nvfp4Rows) -> torch.Tensor:
    """fp32 [rows, cols]: e2m1(code) * float(block scale), each product exact in fp32 (2 x 4 significant bits): what
    a block-scaled NVFP4 GEMM multiplies before its epilogue applies `gemm_alpha`."""
    return _e2m1(q) * _block_scales(q)


def values(q: Nvfp4Rows) -> torch.Tensor:
    """fp32 [rows, cols]: the dequantized values, e2m1 * ((float(s_b) * A) * fp32(1/2688)) (the weights' rule)."""
    a = q.amax.reshape(1).to(torch.float32)
    return _e2m1(q) * ((_block_scales(q) * a) * (torch.ones_like(a) / torch.full_like(a, 2688.0)))


def gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: (amax_a * amax_b) * fp32(1 / 2688^2), left to right, as TransformerEngine's NVFP4 GEMM alpha."""
    a = amax_a.reshape(1).to(torch.float32)
    return (a * amax_b.reshape(1).to(torch.float32)) * (torch.ones_like(a) / torch.full_like(a, GEMM_ALPHA_DIVISOR))

