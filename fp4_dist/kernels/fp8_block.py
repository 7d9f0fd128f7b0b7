"""The CUDA FP8 block copy of an NVFP4 weight (`cuda/fp8_block.cu`): the bits and scales of
`fp8_block_reference.fp8_block_copy`, in one launch per weight; with `fp8_block_operand`, in the same launch, the
copy transposed and both sets of block scales as cuBLAS reads them (what a weight update makes for the GEMMs). The
FP8 compute mode uses it on a GPU where it gave the reference's bits (`fp4_dist.compute.fp8_gemm.require_fp8_gemm`
checks, once per device)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..format import FP8_BLOCK, TILE, ceil_div, is_tile_grid, tile_grid
from . import _launch, outputs

__all__ = ["can_copy", "fp8_block_copy", "fp8_block_operand", "BlockOperand", "transposed_bytes"]


def can_copy(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor) -> bool:
    """Whether the kernel reads this NVFP4 weight as it is laid out (row-major packed codes in 4-byte aligned rows,
    K a multiple of 16, row-major tile scales on the same device); `fp8_block_copy` raises where it does not."""
    data, scales = rowwise_data, rowwise_scale_inv
    return (data.is_cuda and data.dtype == torch.uint8 and data.dim() == 2 and scales.dim() == 2
            and scales.device == data.device and scales.dtype == torch.uint8 and data.stride(1) == 1
            and scales.stride(1) == 1 and (data.shape[1] * 2) % TILE == 0 and data.stride(0) % 4 == 0
            and data.data_ptr() % 4 == 0)  # fmt: skip


def fp8_block_copy(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor,
                   amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(E4M3 bits, uint8 [M, K]; block scales, fp32 [ceil(M/128), ceil(K/128)]) of the NVFP4 weight [M, K] held
    on a CUDA device as packed codes [M, K/2], E4M3 tile scales (row-expanded or the compact tile grid) and its
    fp32 amax; on torch's current stream, without a host synchronization. Row-expanded scales are read from each
    tile's first row (an NVFP4 weight's 16 rows of a tile hold the same scales)."""
    m, k, scales = _checked(rowwise_data, rowwise_scale_inv, "fp8_block_copy")
    amax = amax.reshape(1).to(device=rowwise_data.device, dtype=torch.float32)
    bits = outputs.empty(m, k, dtype=torch.uint8, device=rowwise_data.device)
    out_scales = outputs.empty(ceil_div(m, FP8_BLOCK), ceil_div(k, FP8_BLOCK), dtype=torch.float32,
                             device=rowwise_data.device)  # fmt: skip
    if m and k:
        _launch.launch_fp8_block_copy(rowwise_data, scales, TILE, m, k, amax, bits, out_scales)
    return bits, out_scales


def _checked(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, name: str):
    """(M, K, the tile scales as the kernels read them: one row per tile row) of an NVFP4 weight's rowwise fields,
    or ValueError where the kernels cannot read them."""
    if not rowwise_data.is_cuda or rowwise_data.dtype != torch.uint8 or rowwise_data.dim() != 2:
        raise ValueError(f"fp8_block.{name}: rowwise_data must be 2D uint8 on a CUDA device, got "
                         f"{rowwise_data.dtype} {list(rowwise_data.shape)} on {rowwise_data.device}")  # fmt: skip
    m, k = rowwise_data.shape[0], rowwise_data.shape[1] * 2
    scales = rowwise_scale_inv
    tile_rows, tile_cols = tile_grid(m, k)
    grid = is_tile_grid(scales.shape, m, k)
    if (scales.device != rowwise_data.device or scales.dtype != torch.uint8 or scales.dim() != 2
            or scales.shape[0] < (tile_rows if grid else m) or scales.shape[1] < tile_cols):  # fmt: skip
        raise ValueError(f"fp8_block.{name}: the tile scales {scales.dtype} {list(scales.shape)} on "
                         f"{scales.device} do not cover an NVFP4 weight [{m}, {k}] on {rowwise_data.device}")
    if rowwise_data.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"fp8_block.{name}: the packed codes and the tile scales must be row-major")
    if k % TILE or rowwise_data.stride(0) % 4 or rowwise_data.data_ptr() % 4:  # the kernel reads 32-bit words
        raise ValueError(f"fp8_block.{name}: an NVFP4 weight's K is a multiple of 16 and its packed rows "
                         f"are 4-byte aligned; got K = {k}, row stride {rowwise_data.stride(0)} bytes")
    if not grid:  # row-expanded: each tile's first row stands for its 16 (they are equal in an NVFP4 weight)
        scales = scales[::TILE]
    return m, k, scales


class BlockOperand(NamedTuple):
    """An NVFP4 weight's FP8 block copy as the GEMMs read it (`fp8_block_operand`): for W [M, K], with bm, bk =
    ceil(M/128), ceil(K/128)."""

    bits: torch.Tensor
    """E4M3, uint8 [M, K] row-major."""
    scales: torch.Tensor
    """fp32 [bm, bk] row-major: value = float(e) * scale of its 128 x 128 block."""
    bits_t: Optional[torch.Tensor]
    """The copy of W^T: bits transposed, uint8 [K, M] row-major (the dgrad's operand); None where the copy is
    made without it (the dgrad then transposes the bits at each use: `transposed_bytes`)."""
    cublas_scales: torch.Tensor
    """scales as cuBLAS's 128 x 128 recipe reads them: [roundup(bk, 4), bm] with strides (1, roundup(bk, 4)),
    zero padded (`fp8_gemm._block_scales(scales, M, bk)`)."""
    cublas_scales_t: torch.Tensor
    """Those of the transpose: [roundup(bm, 4), bk], strides (1, roundup(bm, 4)), zero padded."""


def block_operand_empty(m: int, k: int, device, transposed: bool = True) -> BlockOperand:
    """Unwritten tensors of a `BlockOperand` for a weight [M, K] (the kernel writes every byte, padding too);
    without `bits_t` unless `transposed`."""
    bm, bk = ceil_div(m, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    pk, pm = ceil_div(bk, 4) * 4, ceil_div(bm, 4) * 4
    with outputs.unfilled():
        return BlockOperand(torch.empty(m, k, dtype=torch.uint8, device=device),
                            torch.empty(bm, bk, dtype=torch.float32, device=device),
                            torch.empty(k, m, dtype=torch.uint8, device=device) if transposed else None,
                            torch.empty_strided((pk, bm), (1, pk), dtype=torch.float32, device=device),
                            torch.empty_strided((pm, bk), (1, pm), dtype=torch.float32, device=device))


def fp8_block_operand(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, amax: torch.Tensor,
                      out: Optional[BlockOperand] = None, variant: Optional[str] = None,
                      transposed: bool = True) -> BlockOperand:  # fmt: skip
    """The FP8 block copy of the NVFP4 weight [M, K] (as `fp8_block_copy`), its transpose and both sets of block
    scales as cuBLAS reads them (`BlockOperand`), into `out` where given (a weight's kept copy, rewritten in place:
    its tensors keep their addresses; without the transpose where `out` has none), else into new tensors (without
    the transpose unless `transposed`); on torch's current stream, without a host synchronization. `variant`
    (default `_launch.FP8_BLOCK_COPY`): "fused", one launch for all; "split", the copy's kernel, the byte-transpose
    kernel and torch copies for the scales (the same bytes)."""
    m, k, scales = _checked(rowwise_data, rowwise_scale_inv, "fp8_block_operand")
    device = rowwise_data.device
    if out is None:
        out = block_operand_empty(m, k, device, transposed)
    else:
        want = block_operand_empty(m, k, "meta", out.bits_t is not None)
        for name, got, like in zip(BlockOperand._fields, out, want):
            if got is None and like is None:
                continue
            if (got.device != device or got.dtype != like.dtype or got.shape != like.shape
                    or got.stride() != like.stride() or got.data_ptr() % 16):  # fmt: skip
                raise ValueError(f"fp8_block.fp8_block_operand: out.{name} must be {like.dtype} {list(like.shape)} "
                                 f"with strides {like.stride()} on {device}, 16-byte aligned; got {got.dtype} "
                                 f"{list(got.shape)} with strides {got.stride()} on {got.device}")  # fmt: skip
    amax = amax.reshape(1).to(device=device, dtype=torch.float32)
    if not (m and k):
        return out
    if (variant or _launch.FP8_BLOCK_COPY) == "fused":
        _launch.launch_fp8_block_copy_fused(rowwise_data, scales, TILE, m, k, amax, *out)
        return out
    _launch.launch_fp8_block_copy(rowwise_data, scales, TILE, m, k, amax, out.bits, out.scales)
    if out.bits_t is not None and m % 16 == 0 and k % 16 == 0:
        _launch.launch_transpose_bytes(out.bits, out.bits_t)
    elif out.bits_t is not None:
        out.bits_t.copy_(out.bits.t())
    for dst, src in ((out.cublas_scales, out.scales.t()), (out.cublas_scales_t, out.scales)):
        dst.zero_()
        dst[: src.shape[0], : src.shape[1]].copy_(src)
    return out


def transposed_bytes(x: torch.Tensor) -> torch.Tensor:
    """x^T made row-major, for a uint8 CUDA tensor x [R, C] (the weight copy's transpose that the dgrad's GEMM
    reads): by the tiled kernel where x is contiguous with R and C multiples of 16, else by torch."""
    if x.is_cuda and x.dtype == torch.uint8 and x.dim() == 2 and x.is_contiguous() and x.data_ptr() % 16 == 0 \
            and x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0 and x.numel():  # fmt: skip
        out = outputs.empty(x.shape[1], x.shape[0], dtype=torch.uint8, device=x.device)
        _launch.launch_transpose_bytes(x, out)
        return out
    return x.t().contiguous()
