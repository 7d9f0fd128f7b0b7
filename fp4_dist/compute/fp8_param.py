"""The FP8 compute mode's unsharded weight under FSDP2: a parameter that holds an NVFP4 weight's FP8 block copy.

With ``fully_shard_nvfp4(..., compute="fp8")`` the weight FSDP2 unshards for a linear's forward and backward is an
`Fp8Param` instead of a bf16 value: the FP8 block copy of the gathered NVFP4 bytes (E4M3 bits [M, K] and one fp32
scale per 128 x 128 block, 1 byte per weight against bf16's 2), written at every gather into tensors that FSDP2
frees when it reshards and allocates again before the next gather, as it does with its own unsharded parameters
(`own`, `write`). ``F.linear`` on it runs the FP8 block-scaled GEMMs (`fp8_autograd.fp8_linear`: cuBLAS on
Hopper, emulated on the CPU) and its weight gradient comes back as a plain [M, K] tensor in the model dtype, which
FSDP2 reduce-scatters as usual. Any other op that reads it computes on the copy's values (E4M3 times its block scale,
in the model dtype): what the GEMMs read. An op that writes it raises (the next gather would undo the write), as
does any use once FSDP2 has freed the copy's memory (a weight kept past its layer's reshard).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..kernels.fp8_block_reference import fp8_block_values
from .fp8_autograd import fp8_linear
from .fp8_gemm import Fp8Operand

__all__ = ["Fp8Param", "allocated", "own", "rewrite", "write"]

aten = torch.ops.aten

# Ops that give the parameter itself, as FSDP2 and nn.Parameter apply them (same shape): the result holds the same
# copy. A view of another shape would not be a weight any more: it computes on the values like any other op.
_SAME = frozenset([aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default,
                   aten._unsafe_view.default])  # fmt: skip


class Fp8Param(torch.Tensor):
    """An [M, K] weight in the model dtype whose values are the FP8 block copy `operand` (module docstring)."""

    operand: Fp8Operand
    _eager_under_compile = False

    @staticmethod
    def __new__(cls, operand: Fp8Operand, dtype: torch.dtype, requires_grad: bool = False):
        bits = operand.bits
        self = torch.Tensor._make_wrapper_subclass(cls, bits.shape, dtype=dtype, device=bits.device,
                                                   requires_grad=requires_grad)  # fmt: skip
        self.operand = operand
        if not cls._eager_under_compile:
            _run_eagerly_under_compile(cls)
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Fp8Param(shape={list(self.shape)}, dtype={self.dtype}, FP8 block copy)"

    def __deepcopy__(self, memo) -> "Fp8Param":
        """A copy with tensors of its own holding the same bits and scales (deepcopy of a layer inside its forward,
        where FSDP2 has unsharded it); torch's default would clone through the values into a plain tensor."""
        self.check_allocated()
        operand = memo.get(id(self.operand))
        if operand is None:  # weights that share one copy (a parameter and its detach) share it in the copy too
            operand = memo[id(self.operand)] = own(self.operand)
            memo.setdefault(id(memo), []).append(self.operand)  # deepcopy's keep-alive: the id stays this one's
        copied = type(self)(operand, self.dtype, self.requires_grad)
        if isinstance(self, torch.nn.Parameter):  # a module's weight stays a parameter of the copied module
            copied = torch.nn.Parameter(copied, self.requires_grad)
        memo[id(self)] = copied
        return copied

    def values(self) -> torch.Tensor:
        """The copy's values in this parameter's dtype: each E4M3 value times its 128 x 128 block's scale."""
        self.check_allocated()
        return fp8_block_values(self.operand.bits, self.operand.scales).to(self.dtype)

    def check_allocated(self) -> None:
        """Raise unless the copy's memory is there: FSDP2 frees it when it reshards the layer, and a kernel would
        read freed memory (the bytes are viewed as E4M3, which skips torch's own size check)."""
        for t in self.operand:
            if isinstance(t, torch.Tensor) and not allocated(t):
                raise RuntimeError(
                    f"fp4_dist: this FP8 weight copy {list(self.shape)} was freed when FSDP2 resharded its layer; "
                    "a weight is read inside the forward and backward that gathered it (keep the layer, not the "
                    "unsharded weight)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x = args[0] if args else kwargs.get("input")
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if type(w) is cls and not isinstance(x, cls) and not isinstance(bias, cls):
                return _linear(x, w, bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _SAME and type(first) is cls and _same_geometry(func, first, args, kwargs):
            first.check_allocated()
            return cls(first.operand, first.dtype)
        if func._schema.is_mutable and any(type(a) is cls for a in (*args, *kwargs.values())):
            raise RuntimeError(
                f"fp4_dist: {func} writes into an FP8 weight copy (FSDP2's unsharded weight in the FP8 compute "
                "mode), which the next gather would overwrite; change the fp32 master (the sharded parameter) "
                "instead")
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t.values(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)


def _run_eagerly_under_compile(cls) -> None:
    """Make each op on the copy run eagerly under torch.compile, as a graph break (about 0.5 us more per op in eager
    mode): traced, F.linear reached the GEMMs through the copy's values, and the weight's gradient was lost. Done at
    the first copy made, not at import: torch.compiler.disable imports dynamo, which a Megatron CPU rank must not
    import before Megatron does (`fp4_dist.megatron.cpu_compat`)."""
    cls.__torch_function__ = classmethod(torch.compiler.disable(cls.__torch_function__.__func__))
    cls._eager_under_compile = True


def _linear(x: torch.Tensor, w: Fp8Param, bias) -> torch.Tensor:
    """F.linear(x, w, bias) by the FP8 GEMMs, with F.linear's dtype rules: under autocast the input in autocast's
    dtype, as F.linear would take it; otherwise x and w of one dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    if x.dtype != w.dtype:
        raise RuntimeError(f"F.linear: the input is {x.dtype} and the FP8 weight copy computes in {w.dtype} "
                           "(FSDP2's mixed-precision param_dtype); they must be the same")
    w.check_allocated()
    return fp8_linear(x, w, bias, w.operand)


def _same_geometry(func, first: Fp8Param, args, kwargs) -> bool:
    """Whether `func` gives a tensor of `first`'s own shape and contiguous strides (what FSDP2's as_strided and
    nn.Parameter's detach do)."""
    if func in (aten.detach.default, aten.alias.default):
        return True
    size = list(args[1]) if len(args) > 1 else list(kwargs.get("size", ()))
    if size != list(first.shape):
        return False
    if func is aten.as_strided.default:
        stride = list(args[2]) if len(args) > 2 else list(kwargs.get("stride", ()))
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
        return stride == list(first.stride()) and not offset
    return True


def allocated(t: torch.Tensor) -> bool:
    """Whether `t`'s memory is there: FSDP2 frees an unsharded weight's tensors by resizing their storage to 0."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def own(fresh: Fp8Operand) -> Fp8Operand:
    """Tensors of the weight's own for the FP8 copy `fresh` (each with its own storage of its exact size: FSDP2
    frees and allocates them by storage), holding its values; normal tensors even when the first gather runs
    under inference mode, so that later gathers can write them."""
    with torch.inference_mode(False):
        return Fp8Operand(*(t.clone() if isinstance(t, torch.Tensor) else t for t in fresh))


def rewrite(dst: Fp8Operand, fields: tuple) -> bool:
    """Write the FP8 copy of the NVFP4 fields (rowwise data, scales, amax) into the weight's tensors `dst` in place
    by the copy's one launch (`Fp8Operand.rewrite_block_copy`), and say so; False where it does not apply (a CPU
    weight, the reference's copies). The same version-counter rule as `write`."""
    tensors = tuple(t for t in dst if isinstance(t, torch.Tensor))
    with torch.inference_mode(False), torch.autograd._unsafe_preserve_version_counter(tensors):
        return dst.rewrite_block_copy(*fields)


def write(dst: Fp8Operand, fresh: Fp8Operand) -> None:
    """Copy the FP8 copy `fresh` into the weight's tensors `dst` (`own`) in place. The forward saved them for the
    backward, whose gather writes the same values again: autograd must not take that for an in-place change
    (FSDP2 writes its own unsharded parameters so too)."""
    pairs = [(d, f) for d, f in zip(dst, fresh) if isinstance(d, torch.Tensor)]
    with torch.inference_mode(False), torch.autograd._unsafe_preserve_version_counter(tuple(d for d, _ in pairs)):
        for d, f in pairs:
            d.copy_(f)
