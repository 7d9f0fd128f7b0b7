"""The FP8 compute mode's GEMMs: `fp8_mm(a, b)` = a @ b^T for two block-scaled operands (`Fp8Operand`), by
cuBLAS on Hopper (``torch.nn.functional.scaled_mm``, sm_90) and emulated in fp32 on the CPU; any other device is
refused (`check_device`), never served by a slower stand-in.

cuBLAS reads the operands as its block-scaled recipes want them (1 x 128 scales outer-dim-major, 128 x 128 scales
with their K blocks padded to a multiple of 4, K a multiple of 128, both operands' rows a multiple of 16): the
operands are padded with zeros, which add nothing to any sum, and the padding is cut off the result. Its sums differ
from the emulation's only in the order of the additions; `check_device` checks the two agree on a device at
set-up, before the first GEMM there, so a recipe this torch or cuBLAS reads otherwise stops the run instead of
training on wrong values.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..format import FP8_BLOCK, ceil_div
from ..kernels import fp8_block, fp8_rows, outputs
from ..kernels import reference as nvfp4_reference
from ..kernels.fp8_block_reference import fp8_block_copy, pow2
from ..kernels.fp8_rows_reference import quantize_rows_1x128

__all__ = ["Fp8Operand", "fp8_mm", "emulated_mm", "cublas_mm", "require_fp8_gemm", "check_device", "device_report",
           "DeviceReport", "DEVICES", "fp8_gemm_missing"]


class Fp8Operand(NamedTuple):
    """One GEMM operand [rows, K] as the block-scaled GEMM reads it: E4M3 bits (uint8) and fp32 scales, either one
    per 1 x 128 group ([rows, ceil(K/128)]) or one per 128 x 128 block ([ceil(rows/128), ceil(K/128)]).

    A block operand may carry its scales as cuBLAS reads them, for itself and for its transpose
    (`with_cublas_scales`: made once with a weight's copy, instead of at every GEMM that reads it), and its bits
    transposed, row-major (`bits_t`: made by the CUDA copy in the same launch, instead of by every dgrad)."""

    bits: torch.Tensor
    scales: torch.Tensor
    blocks: bool
    cublas_scales: Optional[torch.Tensor] = None
    cublas_scales_t: Optional[torch.Tensor] = None
    bits_t: Optional[torch.Tensor] = None

    @classmethod
    def rows(cls, x: torch.Tensor) -> Fp8Operand:
        """x [rows, K] quantized in 1 x 128 groups along K: by the CUDA kernel on a GPU where it gave the
        reference's bits (`DEVICES`), else by the PyTorch reference (the same bits)."""
        if x.is_cuda and device_report(x.device).rows_kernel and x.dtype in fp8_rows.DTYPES:
            return cls(*fp8_rows.quantize_rows_1x128(x), blocks=False)
        return cls(*quantize_rows_1x128(x), blocks=False)

    @classmethod
    def both(cls, x: torch.Tensor) -> tuple[Fp8Operand, Fp8Operand]:
        """(`rows(x)`, `rows(x.t())`), the same bits: on a GPU where the kernels gave the reference's bits, a bf16
        or fp16 x is read once for both (an activation's forward and weight-gradient operands, an output
        gradient's dgrad and weight-gradient ones)."""
        if x.is_cuda and device_report(x.device).rows_kernel and x.dtype in fp8_rows.DTYPES:
            (a, sa), (b, sb) = fp8_rows.quantize_both(x)
            return cls(a, sa, blocks=False), cls(b, sb, blocks=False)
        return cls.rows(x), cls.rows(x.t())

    @classmethod
    def weight(cls, w, transposed: bool = True) -> Fp8Operand:
        """NVFP4 weight `w` [N, K] as its FP8 block copy (`block_copy` of its rowwise fields)."""
        return cls.block_copy(w.rowwise_data, w.rowwise_scale_inv, w.amax, transposed)

    @classmethod
    def block_copy(cls, rowwise_data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor,
                   transposed: bool = True) -> Fp8Operand:  # fmt: skip
        """The FP8 block copy of the NVFP4 weight [N, K] these fields hold (packed codes, E4M3 tile scales
        row-expanded or as the tile grid, fp32 amax): by the CUDA kernel on a GPU where it gave the reference's bits
        (`DEVICES`), with its transpose in the same launch unless not `transposed`, else by the PyTorch reference
        (the same bits); on a GPU with its scales laid out for cuBLAS too."""
        fields = (rowwise_data, scale_inv, amax)
        if _kernel_copies(rowwise_data, scale_inv):
            return cls._of_block_operand(fp8_block.fp8_block_operand(*fields, transposed=transposed))
        if rowwise_data.is_cuda:
            return cls(*fp8_block_copy(*fields), blocks=True).with_cublas_scales()
        return cls(*fp8_block_copy(*fields), blocks=True)

    @classmethod
    def _of_block_operand(cls, op: fp8_block.BlockOperand) -> Fp8Operand:
        return cls(op.bits, op.scales, True, op.cublas_scales, op.cublas_scales_t, op.bits_t)

    def rewrite_block_copy(self, rowwise_data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> bool:
        """Write the FP8 block copy of the NVFP4 weight these fields hold (as `block_copy`) into this operand's
        tensors in place, by the one launch that made them (`fp8_block.fp8_block_operand`), and say so; False (and
        nothing written) where this operand was not made so (the reference's copies, a CPU weight)."""
        if not (self.blocks and self.cublas_scales is not None and self.bits.is_cuda
                and _kernel_copies(rowwise_data, scale_inv)):  # fmt: skip
            return False
        out = fp8_block.BlockOperand(self.bits, self.scales, self.bits_t, self.cublas_scales, self.cublas_scales_t)
        fp8_block.fp8_block_operand(rowwise_data, scale_inv, amax, out=out)
        return True

    def t(self) -> Fp8Operand:
        """The transposed operand: only a 128 x 128 block copy transposes without requantizing."""
        if not self.blocks:
            raise ValueError("a 1 x 128 operand does not transpose: quantize the transposed tensor instead")
        if self.bits_t is not None:  # the copy's transpose, made with it
            return Fp8Operand(self.bits_t, self.scales.t(), True, self.cublas_scales_t, self.cublas_scales, self.bits)
        return Fp8Operand(self.bits.t(), self.scales.t(), True, self.cublas_scales_t, self.cublas_scales)

    def with_cublas_scales(self) -> Fp8Operand:
        """This block operand with its scales as cuBLAS's 128 x 128 recipe reads them, for itself and for its
        transpose (`_block_scales`): a weight's copy is read by every forward and backward until the next step."""
        if not self.blocks:
            raise ValueError("only a 128 x 128 block operand carries cuBLAS's block scales")
        rows, k = self.bits.shape
        return self._replace(cublas_scales=_block_scales(self.scales, rows, ceil_div(k, FP8_BLOCK)),
                             cublas_scales_t=_block_scales(self.scales.t(), k, ceil_div(rows, FP8_BLOCK)))

    def group_scales(self, j: int) -> torch.Tensor:
        """fp32 [rows]: each row's scale for the contraction group j."""
        column = self.scales[:, j]
        return column.repeat_interleave(FP8_BLOCK)[: self.bits.shape[0]] if self.blocks else column


# torch's scaled_mm wants the right operand's rows (the output's columns) in 16s, the left's (the 1 x 128 scales'
# leading dimension) in 4s: both are padded to 16.
_ROWS_ALIGN = 16


class DeviceReport(NamedTuple):
    """What the one-time check of a device found (`check_device`): why the FP8 GEMMs are refused there (None: they
    run and agree with the emulation), and whether the CUDA 1 x 128 quantization and weight copy gave the
    references' bits there (else the references serve, the same bits, slower)."""

    refusal: Optional[str]
    rows_kernel: bool = False
    block_kernel: bool = False


DEVICES: dict = {}
"""torch.device (with its index) -> its `DeviceReport`: written once per device by `check_device`, at set-up
(`convert_linear_weights`, `fully_shard_nvfp4`, the Megatron adapter: `fp4_dist.compute.modes.prepare`); the data
path only reads it."""
_CPU = DeviceReport(None)


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _kernel_copies(rowwise_data: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """Whether the one-launch CUDA copy (`fp8_block.fp8_block_operand`) makes this weight's FP8 block copy: a GPU
    where the kernel gave the reference's bits (`DEVICES`), and fields it reads."""
    return (rowwise_data.is_cuda and device_report(rowwise_data.device).block_kernel
            and fp8_block.can_copy(rowwise_data, scale_inv))  # fmt: skip


def device_report(device: torch.device) -> DeviceReport:
    """`DEVICES`' entry for a tensor's device (which names its index): a lookup, or the check itself where a
    tensor reached a device that set-up never saw (a model moved after its conversion)."""
    report = DEVICES.get(device)
    return report if report is not None else check_device(device)


def emulated_mm(a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """fp32 [rows of a, rows of b] = a @ b^T over their common K, group by group: for each 128-group of K the
    fp32 product of the E4M3 values, times both operands' scales of the group (what a block-scaled GEMM computes;
    only the order of additions differs)."""
    k = _common_k(a, b)
    with torch.autocast(a.bits.device.type, enabled=False):  # fp32 products, whatever region the caller is in
        return _emulated_mm(a, b, k)


def _common_k(a: Fp8Operand, b: Fp8Operand) -> int:
    k = a.bits.shape[1]
    if b.bits.shape[1] != k:
        raise ValueError(f"fp8 GEMM: the operands' K differ ({k} and {b.bits.shape[1]})")
    return k


def _emulated_mm(a: Fp8Operand, b: Fp8Operand, k: int) -> torch.Tensor:
    out = torch.zeros(a.bits.shape[0], b.bits.shape[0], dtype=torch.float32, device=a.bits.device)
    ea = a.bits.view(torch.float8_e4m3fn).to(torch.float32)
    eb = b.bits.view(torch.float8_e4m3fn).to(torch.float32)
    for j in range(ceil_div(k, FP8_BLOCK)):
        cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
        partial = ea[:, cols] @ eb[:, cols].t()
        out += partial * a.group_scales(j)[:, None] * b.group_scales(j)[None, :]
    return out


def _padded(x: torch.Tensor, rows: int, cols: int, outer_major: bool = False) -> torch.Tensor:
    """x zero-padded to [rows, cols] (x itself when it has that shape), row-major; or, `outer_major`, always a new
    tensor stored column after column with strides exactly (1, rows): torch checks the scales' strides as numbers,
    also along a dimension of size 1, where a contiguous tensor's stride is 1."""
    fits = tuple(x.shape) == (rows, cols)
    if fits and not outer_major:
        return x
    out = torch.empty_strided((rows, cols), (1, rows) if outer_major else (cols, 1), dtype=x.dtype, device=x.device)
    if not fits:
        out.zero_()
    out[: x.shape[0], : x.shape[1]].copy_(x)
    return out


def _block_scales(scales: torch.Tensor, rows: int, k_groups: int) -> torch.Tensor:
    """128 x 128 block scales [row blocks, K blocks] as cuBLAS reads them: [K blocks padded to 4, row blocks], the
    transpose of a row-major tensor (padding rows to 16 never adds a row block)."""
    return _padded(scales.t(), ceil_div(k_groups, 4) * 4, ceil_div(rows, FP8_BLOCK), outer_major=True)


def _cublas_operand(op: Fp8Operand, rows: int, k_groups: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(E4M3 [rows, 128 k_groups] row-major, its scales as cuBLAS's recipe reads them, the recipe)."""
    # Row-major values (a transposed weight copy, the dgrad's operand, is materialized here), and scales in the
    # layouts torch's sm_90 recipes read. An operand already in them (the kernels' outputs at aligned shapes, a
    # weight copy's prepared scales) passes as it is: a GEMM's host time is mostly these few tensor ops.
    bits = op.bits
    if bits.is_cuda and not bits.is_contiguous() and bits.t().is_contiguous():  # the dgrad's transposed copy
        bits = fp8_block.transposed_bytes(bits.t())
    if bits.shape != (rows, k_groups * FP8_BLOCK) or not bits.is_contiguous():
        bits = _padded(bits, rows, k_groups * FP8_BLOCK).contiguous()
    bits = bits.view(torch.float8_e4m3fn)
    if op.blocks:
        scales = op.cublas_scales
        if scales is None:
            scales = _block_scales(op.scales, rows, k_groups)
        return bits, scales, F.ScalingType.BlockWise128x128
    scales = op.scales  # [rows, K groups], outer-dim-major: the kernels write them so
    if scales.shape != (rows, k_groups) or scales.stride() != (1, rows):
        scales = _padded(scales, rows, k_groups, outer_major=True)
    return bits, scales, F.ScalingType.BlockWise1x128


def cublas_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T in `out_dtype` by cuBLAS's block-scaled FP8 GEMM (sm_90), the operands padded as its recipes want
    them (module docstring)."""
    m, n = a.bits.shape[0], b.bits.shape[0]
    k_groups = ceil_div(_common_k(a, b), FP8_BLOCK)
    rows_a = ceil_div(m, _ROWS_ALIGN) * _ROWS_ALIGN
    rows_b = ceil_div(n, _ROWS_ALIGN) * _ROWS_ALIGN
    a_bits, a_scales, a_recipe = _cublas_operand(a, rows_a, k_groups)
    b_bits, b_scales, b_recipe = _cublas_operand(b, rows_b, k_groups)
    with outputs.unfilled():  # the GEMM writes its whole result
        out = F.scaled_mm(a_bits, b_bits.t(), a_scales, a_recipe, b_scales, b_recipe, output_dtype=out_dtype)
    return out if (rows_a, rows_b) == (m, n) else out[:m, :n]


def fp8_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T in `out_dtype`: cuBLAS on a CUDA device (checked once there, `check_device`), emulated on CPU."""
    device = a.bits.device
    m, n, k = a.bits.shape[0], b.bits.shape[0], _common_k(a, b)
    if not (m and n and k):  # an MoE expert that got no tokens: an empty product, or a sum of nothing
        return torch.zeros(m, n, dtype=out_dtype, device=device)
    if device.type == "cpu":
        return emulated_mm(a, b).to(out_dtype)
    refusal = device_report(device).refusal
    if refusal is not None:
        raise RuntimeError(refusal)
    return cublas_mm(a, b, out_dtype)


def fp8_gemm_missing(device_type: str, capability: Optional[tuple[int, int]], has_scaled_mm: bool) -> Optional[str]:
    """Why the FP8 compute mode cannot run its GEMMs on a device (None: it can, pending the check of its values):
    the CPU emulates them; a CUDA device needs sm_90 (Hopper: torch's 1 x 128 and 128 x 128 recipes run there only)
    and a torch with ``torch.nn.functional.scaled_mm``."""
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return (f"the FP8 compute mode runs on CUDA GPUs of compute capability 9.0 (Hopper) or on the CPU, not on "
                f"{device_type}")
    if capability != (9, 0):
        got = f"{capability[0]}.{capability[1]}" if capability else "unknown"
        return (f"the FP8 compute mode needs a GPU of compute capability 9.0 (Hopper: H100, H200, GH200), whose "
                f"block-scaled FP8 GEMMs (1 x 128 by 128 x 128 scales) torch reaches through cuBLAS; this GPU is "
                f"{got}")
    if not has_scaled_mm:
        return (f"the FP8 compute mode needs torch.nn.functional.scaled_mm (torch >= 2.10 built with CUDA >= 12.9) "
                f"for its block-scaled GEMMs; this torch is {torch.__version__}")
    return None


def require_fp8_gemm(device) -> None:
    """Raise RuntimeError, with a sentence saying what is missing, unless the FP8 GEMMs run on `device` and agree
    there with the emulation (`check_device`). Callers add which of their options to change."""
    refusal = check_device(device).refusal
    if refusal is not None:
        raise RuntimeError(refusal)


def check_device(device) -> DeviceReport:
    """`device`'s `DeviceReport`, checked once per device (a lookup after that): whether the FP8 GEMMs run there and
    agree with the emulation on small ragged products whose every scale differs from its neighbours' (a scale read
    from the wrong place gives wrong values, not a slightly different order of additions), and whether the CUDA
    kernels give the references' bits."""
    device = _device_key(device)
    report = DEVICES.get(device)
    if report is not None:
        return report
    if device.type == "cpu":
        DEVICES[device] = _CPU
        return _CPU
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    why = fp8_gemm_missing(device.type, capability, hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"))
    if why is not None or device.type != "cuda":
        report = DeviceReport(why)
    else:
        # The check's own operands are made with the references: the table has no entry for the device yet, so the
        # operands it makes must not ask it (`_REFERENCES_ONLY`).
        DEVICES[device] = _REFERENCES_ONLY
        try:
            with torch.autocast("cuda", enabled=False):
                why = _disagreement(device)
                report = DeviceReport(why, why is None and _rows_kernel_agrees(device),
                                      why is None and _block_kernel_agrees(device))  # fmt: skip
        finally:
            DEVICES.pop(device, None)
    DEVICES[device] = report
    return report


_REFERENCES_ONLY = DeviceReport(None)
"""A device's entry while its check runs: the GEMMs run (the check's products), the kernels are not yet trusted."""


def _disagreement(device: torch.device) -> Optional[str]:
    """None if cuBLAS's products of block-scaled operands (`check_cases`) equal the emulation's to rounding, else
    why not."""
    for name, (left, right, out_dtype) in check_cases(device).items():
        try:
            got = cublas_mm(left, right, out_dtype)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # torch's checks of a recipe it does not take
            return (f"the FP8 compute mode's block-scaled GEMM ({name}) does not run on this GPU with this torch "
                    f"({torch.__version__}): {str(e).splitlines()[0]}")
        worst = disagreement(got, left, right, out_dtype)
        if worst is not None:
            return (f"the FP8 compute mode's block-scaled GEMM ({name}) disagrees with its CPU emulation on this GPU "
                    f"with torch {torch.__version__} (largest difference {worst:.3g} of the products' magnitude, more "
                    f"than rounding): it would train on wrong values, so it is refused")
    return None


def _rows_kernel_agrees(device: torch.device) -> bool:
    """Whether the CUDA 1 x 128 quantization gives the reference's bits and scales on `device`, each of its kernels
    (`fp8_rows.path`, and both ways in one read): bf16, fp16 and fp32 rows of every magnitude, several groups and
    a ragged last one, zeros, subnormals, inf and NaN. Where it does not, the reference quantizes (the same bits,
    more launches) and a warning says so."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 300, generator=g) * torch.ldexp(torch.ones(37, 1), torch.randint(-140, 120, (37, 1),
                                                                                      generator=g))  # fmt: skip
    x[0, :128] = 0.0
    x[1, 5], x[2, 130], x[3, 299], x[4, 7] = float("nan"), float("inf"), -float("inf"), -0.0

    def launched(name, on_device):
        bits = torch.empty(on_device.shape, dtype=torch.uint8, device=device)
        scales = fp8_rows.scales_buffer(*on_device.shape, device)
        fp8_rows.LAUNCHERS[name](on_device, bits, scales)
        return bits, scales

    def cases():  # (the reference's input, what a kernel gives for it)
        for dtype in fp8_rows.DTYPES:
            rows = x[:, :272].to(dtype)
            yield rows, launched("rows", rows.contiguous().to(device))
        for dtype in (torch.float32, torch.bfloat16):
            yield x.to(dtype).t(), launched("transposed", x.to(dtype).to(device).t())
            yield x.to(dtype)[:, 1:], launched("strided", x.to(dtype).to(device)[:, 1:])
        whole_tiles = torch.cat([x] * 5)[:160, :272]  # whole 128 x 128 tiles (16-byte loads) and ragged ones
        for sample in (x.to(torch.bfloat16), x[:, :37].to(torch.float16), whole_tiles.to(torch.bfloat16)):
            along_rows, along_columns = fp8_rows.quantize_both(sample.contiguous().to(device))
            yield sample, along_rows
            yield sample.t(), along_columns

    try:
        for want_input, (bits, scales) in cases():
            if not _same_bits((bits, scales), quantize_rows_1x128(want_input)):
                warnings.warn(f"fp4_dist: the CUDA 1 x 128 FP8 quantization disagrees with its reference on "
                              f"{device}; the PyTorch reference quantizes instead (the same bits, slower)",
                              stacklevel=2)  # fmt: skip
                return False
    except Exception as e:  # noqa: BLE001 (any failure of the kernel path: the reference serves)
        warnings.warn(f"fp4_dist: the CUDA 1 x 128 FP8 quantization does not run on {device} ({e}); the "
                      "PyTorch reference quantizes instead (the same bits, slower)", stacklevel=2)  # fmt: skip
        return False
    return True


def _same_bits(got: tuple, want: tuple) -> bool:
    """Whether a kernel's (E4M3 bits, fp32 scales) on the device are its reference's, bit for bit (NaN scales too)."""
    return torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu().view(torch.int32),
                                                               want[1].view(torch.int32))  # fmt: skip


def _block_kernel_agrees(device: torch.device) -> bool:
    """Whether the CUDA weight copy gives the reference's bits and scales on `device`: ragged weights whose blocks
    span six orders of magnitude (normal and subnormal tile scales), with compact and row-expanded tile scales.
    Where it does not, the reference makes the copies (the same bits, far slower) and a warning says so."""
    g = torch.Generator().manual_seed(2)
    for m, k in ((200, 304), (131, 48)):
        rows, cols = torch.arange(m) // FP8_BLOCK, torch.arange(k) // 16
        w = torch.randn(m, k, generator=g) * pow2((cols[None, :] * 7 + rows[:, None] * 3) % 23 - 11)
        data, expanded, amax, compact = nvfp4_reference.quantize(w)
        for scales in (expanded, compact):
            try:
                got = fp8_block.fp8_block_copy(data.to(device), scales.to(device), amax.to(device))
            except Exception as e:  # noqa: BLE001 (any failure of the kernel path: the reference serves)
                warnings.warn(f"fp4_dist: the CUDA FP8 weight copy does not run on {device} ({e}); the PyTorch "
                              "reference makes the copies instead (the same bits, far slower)", stacklevel=2)
                return False
            want = fp8_block_copy(data, scales, amax)
            if not (_same_bits(got, want) and _fused_copy_agrees(data.to(device), scales.to(device), amax.to(device),
                                                                  want)):  # fmt: skip
                warnings.warn(f"fp4_dist: the CUDA FP8 weight copy disagrees with its reference on {device}; the "
                              "PyTorch reference makes the copies instead (the same bits, far slower)", stacklevel=2)
                return False
    return True


def _fused_copy_agrees(data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, want: tuple) -> bool:
    """Whether the one-launch copy (`fp8_block.fp8_block_operand`, what a weight update makes) gives the
    reference's bits and scales `want`, its transpose, and the scales as `_block_scales` lays them out for cuBLAS
    (padding included)."""
    got = fp8_block.fp8_block_operand(data, scales, amax)
    bits, block = want
    m, k = bits.shape
    kg, rg = ceil_div(k, FP8_BLOCK), ceil_div(m, FP8_BLOCK)
    laid_out = (_block_scales(block, m, kg), _block_scales(block.t(), k, rg))
    return (_same_bits((got.bits, got.scales), want) and torch.equal(got.bits_t.cpu(), bits.t())
            and all(g.stride() == w.stride() and torch.equal(g.cpu().view(torch.int32), w.view(torch.int32))
                    for g, w in zip((got.cublas_scales, got.cublas_scales_t), laid_out)))  # fmt: skip


def check_cases(device) -> dict:
    """{name: (left, right, output dtype)}: the products the device check compares, one per GEMM the linear makes
    (the forward, the dgrad on the transposed copy, the wgrad, fp32 out for fp32 weights). Magnitudes change along
    both dimensions of both operands, by block and by row, so every scale differs from its neighbours'."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 304, generator=g) * torch.logspace(-3, 3, 304) * torch.logspace(-2, 2, 70)[:, None]
    # 208 rows: a multiple of 16, so the dgrad's transposed copy is made by the byte-transpose kernel, as in training
    rows, cols = torch.arange(208) // FP8_BLOCK, torch.arange(304) // FP8_BLOCK
    w = torch.randn(208, 304, generator=g) * pow2(3 * rows[:, None] + 5 * cols[None, :] - 4)
    x, w = x.to(device), w.to(device)
    # the block operand is what the linear reads: the FP8 copy of the NVFP4 weight (the reference's bytes) of w
    data, scale_inv, amax, _ = nvfp4_reference.quantize(w)
    a, block = Fp8Operand.rows(x), Fp8Operand(*fp8_block_copy(data, scale_inv, amax), blocks=True)
    return {"1 x 128 by 128 x 128": (a, block, torch.bfloat16),
            "1 x 128 by a transposed 128 x 128": (Fp8Operand.rows(x[:, :208]), block.t(), torch.bfloat16),
            "1 x 128 by 1 x 128": (a, Fp8Operand.rows(w), torch.bfloat16),
            "1 x 128 by 1 x 128 into fp32": (a, Fp8Operand.rows(w), torch.float32)}  # fmt: skip


def disagreement(got: torch.Tensor, left: Fp8Operand, right: Fp8Operand, out_dtype: torch.dtype) -> Optional[float]:
    """None if `got` equals the emulated left @ right^T in `out_dtype` but for rounding, else the largest difference
    beyond it, as a fraction of the products' magnitude. Rounding: out_dtype's of the sum, and the tensor cores' of
    the additions (fewer bits than fp32's within a 128-group), which may cancel, so bounded by the sum of the
    products' magnitudes; a scale read from the wrong place is off by a factor of 2^3 or more."""
    want = emulated_mm(left, right).to(out_dtype).float()
    got = got.float().to(want.device)
    magnitude = emulated_mm(*(Fp8Operand(op.bits & 0x7F, op.scales, op.blocks) for op in (left, right)))
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10 if out_dtype == torch.float16 else 2.0**-23
    bad = (got - want).abs() > ulp * want.abs() + 2.0**-12 * magnitude
    if not bool(bad.any()):
        return None
    return ((got - want).abs() / (magnitude + 1e-30))[bad].max().item()

