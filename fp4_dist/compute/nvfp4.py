"""The NVFP4 training recipe as a compute mode (``compute="nvfp4"``; its row in `modes.MODES`): every GEMM of a linear
reads NVFP4 operands, as TransformerEngine's NVFP4BlockScaling recipe on Blackwell does (docs/nvfp4_recipe.md).

Per linear, with W the NVFP4 weight [N, K] (16 x 16 tiles, as stored) and T the tokens:

    forward   y  = x @ W^T       x: 1 x 16 blocks along K, round to nearest even
    dgrad     dx = dy @ W        dy: 1 x 16 blocks along N, stochastic rounding; W's values, transposed
    wgrad     dW = dy^T @ x      RHT(dy^T) and RHT(x^T): the 16-point random Hadamard transform along the tokens,
                                 then 1 x 16 blocks along the tokens (dy: stochastic rounding; x: to nearest even)

Each operand has its own per-tensor amax (the transformed ones after the transform) and E4M3 block scales
(`kernels.nvfp4_1d_reference`, bit for bit TransformerEngine's reference quantizer). x^T is transformed and quantized
in the forward and kept for the backward in 4 bits. Tokens are zero-padded to a multiple of 16 for the transform (the
padding adds nothing to dW; TransformerEngine asks for 16 | T instead).

The GEMMs are emulated exactly up to the order of additions (`nvfp4_gemm`): each operand's values e2m1 * float(scale)
are exact in fp32 (and in bf16), the products of two such values too, the sums accumulate in fp32, and the epilogue
multiplies by alpha = (amax_a * amax_b) * fp32(1/2688^2), adds the bias in fp32 and rounds once to the output dtype,
as a block-scaled NVFP4 GEMM on Blackwell does. On the CPU the operands come from the PyTorch reference and one fp32
matmul multiplies them; on a CUDA GPU (sm_80 to sm_90) from the CuPy kernels (`kernels.nvfp4_1d`, the same bits) and
a bf16 matmul with an fp32 result. sm_100+ is refused until its native NVFP4 ``scaled_mm`` has been run there.

Stochastic rounding takes one seed per quantization, drawn on the host from torch's default CPU generator (dgrad's
operand first, then wgrad's): ``torch.manual_seed`` reproduces a run, on the CPU and on a GPU alike, with the same bits.

Which layers compute in it is the recipe's (`Nvfp4Recipe`): by default the first and the last linear keep the bf16
mode, as the recipe's paper keeps the first and last layers in higher precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..format import TILE, ceil_div, is_tile_grid, rowwise_scale_shape
from ..kernels import nvfp4_1d_reference as q1d
from ..kernels.cuda_plans import capturing
from ..kernels.reference import expand_rowwise_scales
from ..tensor import NVFP4Tensor
from ..tensor.copy import raise_changed
from . import nvfp4_gemm
from .fp8_autograd import _gather_sequence, _reduce_scatter_sequence, _stamp, output  # one TP communication
from .nvfp4_gemm import emulated_mm, operand_kernels, unscaled_values

__all__ = ["Nvfp4Recipe", "check_device", "linear", "parallel_linear", "FsdpUnsharded", "Nvfp4Linear",
           "nvfp4_linear", "emulated_mm", "weight_rows", "wgrad_operand"]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Nvfp4Recipe:
    """What the nvfp4 mode quantizes how, and which layers it leaves in the default mode
    (``convert_linear_weights(compute="nvfp4", options=Nvfp4Recipe(...))``)."""

    stochastic_rounding: bool = True
    """Round the output gradient's E2M1 values stochastically (dgrad and wgrad operands); False: to nearest even
    (the paper's ablation). 8 random bits per element, a hash of the element and a seed drawn per quantization from
    torch's default CPU generator, so ``torch.manual_seed`` reproduces a run, with the same bits on CPU and GPU."""
    rht: bool = True
    """Apply the 16-point random Hadamard transform to both wgrad operands; False: quantize them as they are."""
    bf16_first: int = 1
    """How many of the model's first linears (module order) keep the default mode."""
    bf16_last: int = 1
    """How many of the model's last linears keep the default mode."""

    LAYER_CHOICE: ClassVar[tuple] = ("bf16_first", "bf16_last")
    """Fields that choose layers, which only `convert_linear_weights` applies (the Megatron adapter and FSDP2 put
    every converted linear in the mode): ``--compute-option`` refuses them."""

    def __post_init__(self):
        for name in self.LAYER_CHOICE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Nvfp4Recipe: {name} is a number of linears (an int >= 0), got {value!r}")

    def kept_in_default(self, names: list[str]) -> dict[str, str]:
        """Of the linears `names` (module order) that would compute in the mode, those that keep the default mode,
        with the reason."""
        last = names[len(names) - self.bf16_last:] if self.bf16_last else []
        kept = {n: f"one of the first {self.bf16_first} (Nvfp4Recipe.bf16_first)" for n in names[: self.bf16_first]}
        kept.update({n: f"one of the last {self.bf16_last} (Nvfp4Recipe.bf16_last)" for n in last if n not in kept})
        return kept

    def gradient_rows(self, dy: torch.Tensor) -> q1d.Nvfp4Rows:
        """The dgrad operand: the output gradient dy [T, N] in 1 x 16 blocks along N, on dy's device."""
        quantizers = operand_kernels(dy.device)
        if self.stochastic_rounding:
            return quantizers.quantize_rows_1x16_sr(dy, q1d.draw_seed())
        return quantizers.quantize_rows_1x16(dy)


DEFAULT_RECIPE = Nvfp4Recipe()

CUDA_GRAPHS = ("its stochastic rounding draws each quantization's seed on the host, so a replayed graph would round "
               "every step's gradients with the seeds drawn at capture")
"""Why the mode does not run under CUDA graphs (its row's ``cuda_graphs``)."""


def check_device(device: torch.device) -> Optional[str]:
    """None on the CPU and on CUDA GPUs of sm_80 to sm_90 whose kernels give the reference's bits (checked once);
    elsewhere the sentence that refuses the device (`nvfp4_gemm.check_device`)."""
    return nvfp4_gemm.check_device(device)


def weight_rows(w: NVFP4Tensor) -> q1d.Nvfp4Rows:
    """The NVFP4 weight [N, K] as the GEMM reads it: its 16 x 16 tile scales are the 1 x 16 scales of each row."""
    n, k = w.shape
    scale_inv = w.rowwise_scale_inv
    if is_tile_grid(scale_inv.shape, n, k):
        scale_inv = expand_rowwise_scales(scale_inv, n, k)
    return q1d.Nvfp4Rows(w.rowwise_data, scale_inv[:n, : ceil_div(k, TILE)], w.amax.reshape(1), k)


def wgrad_operand(t: torch.Tensor, stochastic: bool, rht: bool) -> q1d.Nvfp4Rows:
    """t [T, C] (tokens first) as a wgrad operand: t^T [C, T16] (tokens zero-padded to 16 | T16), transformed along
    the tokens when `rht`, then quantized in 1 x 16 blocks along the tokens, stochastically when `stochastic` (a
    seed drawn now), on t's device."""
    quantizers = operand_kernels(t.device)
    if stochastic:
        return quantizers.quantize_cols_1x16_sr(t, rht, q1d.draw_seed())
    return quantizers.quantize_cols_1x16(t, rht)


def _saved(q: q1d.Nvfp4Rows) -> tuple:
    return q.data, q.scales, q.amax


class Nvfp4Linear(torch.autograd.Function):
    """y = x @ W^T + bias with NVFP4 GEMMs (module docstring); W an NVFP4 weight. The backward raises if the weight's
    bytes changed since the forward. `allreduce_dgrad`, `sequence_parallel`, `tp_group`: a Megatron parallel
    linear's communication, as `fp8_autograd.Fp8Linear` does it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor], recipe: Nvfp4Recipe,
                allreduce_dgrad: bool = False, sequence_parallel: bool = False, tp_group=None):  # fmt: skip
        total = _gather_sequence(x, tp_group) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        w = weight_rows(weight)
        xq = operand_kernels(x2.device).quantize_rows_1x16(x2)
        y = emulated_mm(unscaled_values(xq), xq.amax, unscaled_values(w), w.amax, x.dtype, bias)
        kept = (x2.new_empty(0),) * 3
        if ctx.needs_input_grad[1]:  # x^T transformed and quantized now: 4 bits per element kept, not x's 16
            kept = _saved(wgrad_operand(x2, False, recipe.rht))
        ctx.save_for_backward(*kept, *_saved(w))
        ctx.sizes = (x2.shape[0], weight.shape[0], weight.shape[1])
        ctx.has_bias, ctx.weight, ctx.stamp, ctx.recipe = bias is not None, weight, _stamp(weight), recipe
        ctx.comm = (allreduce_dgrad, sequence_parallel, tp_group)
        return output(y, total.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.recipe.stochastic_rounding and dy.is_cuda and capturing():
            raise RuntimeError(f"the nvfp4 compute mode cannot be captured in a CUDA graph: {CUDA_GRAPHS} (run "
                               "eagerly, or with Nvfp4Recipe(stochastic_rounding=False))")
        xt_data, xt_scales, xt_amax, w_data, w_scales, w_amax = ctx.saved_tensors
        if _stamp(ctx.weight) != ctx.stamp:
            raise_changed(ctx.weight)
        tokens, n, k = ctx.sizes
        allreduce_dgrad, sequence_parallel, tp_group = ctx.comm
        recipe = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = recipe.gradient_rows(dy2)
            wv = unscaled_values(q1d.Nvfp4Rows(w_data, w_scales, w_amax, k))
            dx = emulated_mm(unscaled_values(dyq), dyq.amax, wv.t(), w_amax, dy.dtype)
            dx = dx.view(*dy.shape[:-1], k)
            if sequence_parallel:
                dx = _reduce_scatter_sequence(dx, tp_group)
            elif allreduce_dgrad:
                dist.all_reduce(dx, group=tp_group)
        if ctx.needs_input_grad[1]:
            dyt = wgrad_operand(dy2, recipe.stochastic_rounding, recipe.rht)
            xt = q1d.Nvfp4Rows(xt_data, xt_scales, xt_amax, dyt.cols)
            dw = emulated_mm(unscaled_values(dyt), dyt.amax, unscaled_values(xt), xt_amax, ctx.weight.dtype)
        db = dy2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        assert dy2.shape[0] == tokens, "the output gradient's tokens differ from the forward's"
        return dx, dw, db, None, None, None, None


def nvfp4_linear(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor] = None,
                 recipe: Nvfp4Recipe = DEFAULT_RECIPE) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight, bias)` with the NVFP4 recipe's GEMMs, for an NVFP4 weight (emulated: the reference on the
    CPU, the CUDA kernels on a GPU)."""
    return Nvfp4Linear.apply(x, weight, bias, recipe)


def linear(module: torch.nn.Module, input: torch.Tensor, compiling: bool = False) -> torch.Tensor:
    """An NVFP4Linear's forward in this mode, with the layer's recipe (``fp4_options``, set by
    `convert_linear_weights`)."""
    w = module.weight
    if type(w) is not NVFP4Tensor:  # never bf16 in its place without a word
        raise RuntimeError(
            f"NVFP4Linear computes in the nvfp4 mode but its weight is now a {type(w).__name__}, not an NVFP4Tensor: "
            "the mode multiplies the weight's NVFP4 codes; convert with compute='bf16'")
    return Nvfp4Linear.apply(input, w, module.bias, getattr(module, "fp4_options", None) or DEFAULT_RECIPE)


def parallel_linear(layer, input: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor],
                    allreduce_dgrad: bool, sequence_parallel: bool, tp_group) -> torch.Tensor:  # fmt: skip
    """A Megatron parallel linear's GEMMs in this mode, with its tensor-parallel communication."""
    recipe = getattr(layer, "fp4_options", None) or DEFAULT_RECIPE
    return Nvfp4Linear.apply(input, weight, bias, recipe, allreduce_dgrad, sequence_parallel, tp_group)


class FsdpUnsharded:
    """FSDP2's unsharded weight in this mode (`fp4_dist.fsdp.master`): an `NVFP4Tensor` on the gathered
    ``(rowwise_data, scale_inv, amax)``, whose codes the GEMMs multiply as they do any NVFP4 weight's.

    Its ``rowwise_data`` is the gathered bytes themselves, no copy: FSDP2 gathers into the same tensors every
    time (freeing their memory at each reshard, allocating it again before the next gather), and so does the
    post-gather quantize of a weight gathered in bf16. Two fields are the weight's own, written in place at each
    gather so that every field keeps its tensor (what a layer's forward saved for its backward is what the
    backward's gather refills): the tile scales, which the gather carries as the [ceil(M/16), ceil(K/16)] grid, in
    the tensor's row-expanded layout; and the amax, which travels as the gather's metadata in the cast's own buffer
    (the next cast rewrites it, and a new cast makes a new one). FSDP2 frees and allocates those two with the
    gathered bytes."""

    @staticmethod
    def make(fields: tuple, dtype: torch.dtype, numerics: str) -> tuple:
        """(what the weight holds, the unsharded parameter, its tensors FSDP2 manages) at the first gather; `numerics`:
        the weight's block-scale formula, which the unsharded weight reports."""
        data, scale_inv, amax = fields
        m, k = data.shape[0], 2 * data.shape[1]
        with torch.inference_mode(False):  # normal tensors even under inference mode: later gathers write them
            own_amax = torch.empty(1, dtype=torch.float32, device=data.device)
            own_scales = (torch.empty(rowwise_scale_shape(m, k), dtype=torch.uint8, device=data.device)
                          if is_tile_grid(scale_inv.shape, m, k) else scale_inv)  # fmt: skip
        held = NVFP4Tensor((m, k), dtype, data, own_scales, own_amax, compute_copy=False, numerics=numerics)
        FsdpUnsharded.write(held, fields)
        tensors = (own_amax,) if own_scales is scale_inv else (own_scales, own_amax)
        return held, held, tensors

    @staticmethod
    def write(held: NVFP4Tensor, fields: tuple) -> None:
        """Write a gather's scales and amax into the tensors `make` gave; its bytes are `held`'s already."""
        data, scale_inv, amax = fields
        m, k = held.shape
        grid = is_tile_grid(scale_inv.shape, m, k)
        in_place = [data] if grid else [data, scale_inv]
        assert all(t.data_ptr() == getattr(held, f).data_ptr() for t, f in zip(in_place, _FIELDS)), (
            "FSDP2 gathered into other tensors than at its first gather; the nvfp4 mode's unsharded weight reads "
            "the gathered fields where the first gather put them")
        # The forward saved these fields for the backward, whose gather writes the same values again: autograd and
        # the layer's stamp (`tensor.copy.stamp`) must not take that for an in-place change (FSDP2 writes its own
        # unsharded parameters so too).
        own = (held.rowwise_scale_inv, held.amax)
        with torch.inference_mode(False), torch.autograd._unsafe_preserve_version_counter(own):
            held.amax.copy_(amax.reshape(1))
            if grid:
                kernels.expand_scales(scale_inv.reshape(-1), [(m, k)], [[(0, 0)]], [held.rowwise_scale_inv])


_FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")
