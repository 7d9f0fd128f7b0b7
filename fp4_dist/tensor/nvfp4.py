"""NVFP4Tensor: a container for one NVFP4 2D weight that PyTorch modules can use as a parameter.

It reports the logical shape [M, K] and the model dtype (bf16 by default) and holds the packed fields
`fp4_dist.format` lays out. Ops fall in three groups, all routed through the op table (`fp4_dist.tensor.ops`):

- storage-preserving (detach, alias, clone, _to_copy to another device, copy_): keep the packed form;
  `copy_` from a high-precision tensor re-quantizes in place, keeping every field's storage (the rowwise bytes
  may be a view into a data-parallel all-gather buffer);
- in-place ops that would reinterpret or mutate the packed bytes: NotImplementedError naming the op;
- everything else (linear, matmul, t, ...): runs on the weight's value in the model dtype, so autograd hands a
  plain [M, K] gradient to the parameter. That value is the weight's compute copy (`fp4_dist.tensor.copy`):
  dequantized once per change of the bytes, not once per use.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import kernels
from .copy import ComputeCopy, refresh_compute_copies
from ..format import (
    DEFAULT_NUMERICS,
    MODEL_DTYPES,
    check_numerics,
    check_weight_shape,
    columnwise_data_shape,
    columnwise_scale_shape,
    has_columnwise,
    packed_bytes,
    rowwise_data_shape,
    rowwise_scale_shape,
)
from ..shared_amax import group_amax, group_of
from .ops import NO_KWARGS, OPS, compute, refuse

aten = torch.ops.aten

FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv")
"""The tensors an NVFP4 weight holds (`format.py` gives their layouts)."""
_ROWWISE_FIELDS = frozenset(FIELDS[:3])  # what a compute copy is made from
ALIAS_STATE = FIELDS + ("numerics", "_compute_copy")  # what an alias (detach, .data) shares


class NVFP4Tensor(torch.Tensor):
    """NVFP4 weight [M, K]: E2M1 codes, E4M3 16x16 tile scales and one fp32 amax.

    Fields:
        rowwise_data: uint8 [M, K/2], element (r, c) in byte r*K/2 + c//2, low nibble when c is even.
        rowwise_scale_inv: uint8 E4M3 bits [roundup(M,128), roundup(ceil(K/16),4)], padding zero.
        amax: fp32 [1], max|W| of the bf16 weight (not a scale).
        columnwise_data: uint8 [K, M/2] or None until `make_columnwise()`.
        columnwise_scale_inv: uint8 [roundup(K,128), roundup(ceil(M/16),4)] or None.
        numerics: "te" or "te-2.14" (block-scale formula used when this tensor is re-quantized).
        compute_copy: keep a model-dtype copy of the values for ops (True, the default) or dequantize on every
            use (False: 2 bytes per element less memory, one dequantize launch per use). Settable.
    """

    rowwise_data: torch.Tensor
    rowwise_scale_inv: torch.Tensor
    amax: torch.Tensor
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]
    numerics: str

    @staticmethod
    def __new__(
        cls,
        shape,
        dtype: torch.dtype,
        rowwise_data: torch.Tensor,
        rowwise_scale_inv: torch.Tensor,
        amax: torch.Tensor,
        columnwise_data: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
        numerics: str = DEFAULT_NUMERICS,
        requires_grad: bool = False,
        compute_copy=True,
    ):
        m, k = check_weight_shape(shape)
        if dtype not in MODEL_DTYPES:
            raise TypeError(f"NVFP4Tensor: model dtype must be one of {MODEL_DTYPES} (the dtype it computes in and "
                            f"masters are rounded to), got {dtype}")
        _check_field("rowwise_data", rowwise_data, torch.uint8, rowwise_data_shape(m, k))
        _check_field("rowwise_scale_inv", rowwise_scale_inv, torch.uint8, rowwise_scale_shape(m, k))
        _check_field("amax", amax, torch.float32, (1,))
        if columnwise_data is not None:
            _check_field("columnwise_data", columnwise_data, torch.uint8, columnwise_data_shape(m, k))
            _check_field("columnwise_scale_inv", columnwise_scale_inv, torch.uint8, columnwise_scale_shape(m, k))
        self = torch.Tensor._make_wrapper_subclass(
            cls, (m, k), dtype=dtype, device=rowwise_data.device, requires_grad=requires_grad
        )
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.amax = amax
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.numerics = check_numerics(numerics)
        # Aliases (nn.Parameter, detach) pass the holder on, so they share one copy.
        self._compute_copy = compute_copy if isinstance(compute_copy, ComputeCopy) else ComputeCopy(compute_copy)
        return self

    # ----------------------------------------------------------------------------------------------- build
    @classmethod
    def empty(cls, shape, *, device=None, dtype: torch.dtype = torch.bfloat16, numerics: str = DEFAULT_NUMERICS):
        """An all-zero NVFP4 weight (every field written, so nothing uninitialised can leak into a gather)."""
        m, k = check_weight_shape(shape)
        z = lambda s, dt: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        return cls(
            (m, k),
            dtype,
            z(rowwise_data_shape(m, k), torch.uint8),
            z(rowwise_scale_shape(m, k), torch.uint8),
            z((1,), torch.float32),
            numerics=numerics,
        )

    def _fields(self) -> dict:
        return {f: getattr(self, f) for f in FIELDS}

    def _with_fields(self, fn: Callable[[torch.Tensor], torch.Tensor], requires_grad: bool = False):
        """A new weight of `fn` applied to every field, with a compute copy of its own."""
        new = {f: (None if t is None else fn(t)) for f, t in self._fields().items()}
        return NVFP4Tensor(self.shape, self.dtype, **new, numerics=self.numerics, requires_grad=requires_grad,
                           compute_copy=self._compute_copy.enabled)  # fmt: skip

    def _alias(self) -> "NVFP4Tensor":
        """A tensor sharing every field, the compute copy and the Python attributes (detach, `.data`, a view to the
        same shape).

        Megatron's distributed optimizer reads `param.data` for every weight every step: the fields were
        checked when this weight was made, so the alias skips the constructor and its checks (half the host time).
        """
        new = torch.Tensor._make_wrapper_subclass(NVFP4Tensor, self.shape, dtype=self.dtype, device=self.device)
        # The Python attributes beside the NVFP4 state come along (see `_carry_attributes`); being a Parameter
        # does not: nn.Parameter sets that flag on its own detach.
        new.__dict__.update(self.__dict__)
        new.__dict__.pop("_is_param", None)
        return new

    def _carry_attributes(self, dst: "NVFP4Tensor") -> "NVFP4Tensor":
        """Give `dst` the Python attributes this weight carries beside its NVFP4 state (Megatron's tensor-parallel
        attributes, `get_high_precision_init_val`, a user's own).

        `nn.Module._apply` (`.cuda()`, `.to(device)`, `.bfloat16()`, Megatron's Float16Module) moves a
        tensor-subclass parameter by `swap_tensors(param, nn.Parameter(fn(param)))`, which swaps the objects'
        `__dict__`s: the parameter keeps exactly the attributes of `nn.Parameter(fn(param))`, a detach of
        `fn(param)`. So both the device move and the alias (detach, `.data`) carry them, as `param.data = ...`
        keeps them for a plain tensor.
        """
        extra = {k: v for k, v in self.__dict__.items() if k not in ALIAS_STATE and k != "_is_param"}
        if extra:
            dst.__dict__.update(extra)
        return dst

    # ------------------------------------------------------------------------------------------- numerics
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new plain [M, K] tensor: e2m1_value * ((float(s_t) * amax) * fp32(1/2688)) rounded to `dtype`.

        One kernel launch on CUDA, the reference on other devices; the same bits either way.
        """
        if not dtype.is_floating_point:
            raise TypeError(f"dequantize: dtype must be a floating-point type, got {dtype}")
        direct = dtype in MODEL_DTYPES  # the kernel's outputs; others are the fp32 values converted
        out = torch.empty(tuple(self.shape), dtype=dtype if direct else torch.float32, device=self.rowwise_data.device)
        kernels.dequantize([self.rowwise_data], [self.rowwise_scale_inv], [self.amax], [out])
        return out if direct else out.to(dtype)

    @property
    def copy_state(self) -> ComputeCopy:
        """The state of this weight's compute copy, shared by its aliases (`fp4_dist.tensor.copy` keeps it)."""
        return self._compute_copy

    @property
    def compute_copy(self) -> bool:
        """Whether ops read a kept model-dtype copy (True) or dequantize on every use (False); settable."""
        return self._compute_copy.enabled

    @compute_copy.setter
    def compute_copy(self, enabled: bool) -> None:
        cc = self._compute_copy
        cc.enabled = bool(enabled)
        cc.epoch += 1
        if not cc.enabled:
            cc.drop()  # the memory is what turning it off is for

    def __setattr__(self, name, value) -> None:
        if name in _ROWWISE_FIELDS:  # a replaced field: bound refreshes of the compute copy must look again
            cc = self.__dict__.get("_compute_copy")
            if cc is not None:
                cc.epoch += 1
        _SETATTR(self, name, value)  # not super(): Megatron's grad hook sets `param.grad = None` every microbatch

    def compute_value(self) -> torch.Tensor:
        """The [M, K] model-dtype value that ops on this weight use (its compute copy when current).

        Do not modify the result in place: it is the weight's own copy (an in-place change is noticed and
        undone at the next use, at the cost of a dequantize).
        """
        cc = self._compute_copy
        if cc.fresh_for(self):
            return cc.value
        if not cc.enabled:
            return self.dequantize(self.dtype)
        if cc.pending and not cc.auto_refresh:
            cc.note_pending_use(self)
            return self.dequantize(self.dtype)
        refresh_compute_copies([self])
        return cc.value

    def quantize_(self, src: torch.Tensor) -> "NVFP4Tensor":
        """Re-quantize `src` ([M, K], any float dtype) into this tensor's existing buffers.

        Values are rounded to this tensor's dtype first. The columnwise copy, if present, is rebuilt. A weight that
        shares its amax with others (`fp4_dist.shared_amax`) keeps the group's amax when its own max|src| is not
        larger, and raises ValueError otherwise: its scales would then differ from what its group holds.
        """
        flat, shape = kernels.checks.quantize_source(src, "source")
        group = group_of(self)
        if shape != tuple(self.shape):
            raise ValueError(f"cannot quantize a {list(shape)} tensor into an NVFP4Tensor of shape {list(self.shape)}")
        if src.device != self.rowwise_data.device:
            raise ValueError(f"source is on {src.device} but the NVFP4Tensor is on {self.rowwise_data.device}")
        shared = None
        if group is not None:
            shared = self.amax.clone()
            own = group_amax([flat], self.dtype)[0]
            if bool(own > shared[0]):
                raise ValueError(f"quantize_: this weight shares one amax with {group}, and the new values' max "
                                 f"|x| = {float(own)} exceeds it ({float(shared[0])}): re-quantizing it alone would "
                                 "leave the group; quantize the whole group (convert_linear_weights on the "
                                 "high-precision model) or let the optimizer's cast do it")
        kernels.quantize_rowwise(flat, shape, round_to=self.dtype, numerics=self.numerics,
                                 rowwise_data=self.rowwise_data, scale_inv=self.rowwise_scale_inv, amax=self.amax,
                                 name="source", shared_amax=shared)  # fmt: skip
        if self.columnwise_data is not None:
            self.make_columnwise()
        return self

    def make_columnwise(self) -> "NVFP4Tensor":
        """Build columnwise_data / columnwise_scale_inv from the rowwise copy (spec section 3); needs M even."""
        self.alloc_columnwise()
        kernels.nibble_transpose([self.rowwise_data], [self.columnwise_data])
        kernels.scale_transpose([self.rowwise_scale_inv], [self.columnwise_scale_inv], [tuple(self.shape)])
        return self

    def alloc_columnwise(self) -> None:
        """Allocate zeroed columnwise_data / columnwise_scale_inv if absent; needs M even.

        Separate from `make_columnwise` so that batched callers (post_all_gather_processing, ShardedCast) can
        allocate per weight and transpose every weight in one launch per stage.
        """
        m, k = self.shape
        if not has_columnwise(m):
            raise ValueError(
                f"make_columnwise: M = {m} is odd; the columnwise copy packs pairs of rows into a byte, so it needs "
                "an even M (keep this weight rowwise-only)"
            )
        if self.columnwise_data is None:
            dev = self.rowwise_data.device
            self.columnwise_data = torch.zeros(columnwise_data_shape(m, k), dtype=torch.uint8, device=dev)
            self.columnwise_scale_inv = torch.zeros(columnwise_scale_shape(m, k), dtype=torch.uint8, device=dev)

    def set_rowwise_storage(self, view: torch.Tensor) -> None:
        """Copy the rowwise bytes into `view` (uint8, M*K/2 elements, e.g. a slice of an all-gather buffer)
        and make `rowwise_data` alias its memory, so a byte all-gather into the buffer updates this weight.

        `rowwise_data` shares the memory but not the version counter of `view` (a view of a buffer shares the
        buffer's counter): writes to other weights of the buffer then do not look like changes of this one to
        the compute copy. Call `fp4_dist.post_all_gather_processing` after a gather into the buffer.
        """
        m, k = self.shape
        want = packed_bytes(m * k)
        dev = self.rowwise_data.device
        if view.dtype != torch.uint8 or view.numel() != want or view.device != dev or not view.is_contiguous():
            # A strided view would make rowwise_data strided: the cast and the gather need contiguous bytes.
            raise ValueError(
                f"set_rowwise_storage: need a contiguous uint8 view of {want} bytes on {dev}, got "
                f"{view.dtype} with {view.numel()} elements on {view.device} (contiguous={view.is_contiguous()}); "
                "pass a slice of a flat contiguous buffer"
            )
        view.view(-1).copy_(self.rowwise_data.view(-1))
        alias = torch.empty(0, dtype=torch.uint8, device=dev)
        alias.set_(view.untyped_storage(), view.storage_offset(), rowwise_data_shape(m, k))
        self.rowwise_data = alias

    # -------------------------------------------------------------------------------------- torch plumbing
    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"NVFP4Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"amax={self.amax.item() if self.amax.device.type == 'cpu' else '<device>'}, "
            f"columnwise={'yes' if self.columnwise_data is not None else 'no'}, numerics={self.numerics!r})"
        )

    def __tensor_flatten__(self):
        names = [f for f in FIELDS if getattr(self, f) is not None]
        return names, (tuple(self.shape), self.dtype, self.numerics, self.compute_copy)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        shape, dtype, numerics, compute_copy = ctx
        return NVFP4Tensor(shape, dtype, **inner, numerics=numerics, compute_copy=compute_copy)

    def __reduce_ex__(self, protocol):
        fields = {f: (None if t is None else t.detach().clone()) for f, t in self._fields().items()}
        return _rebuild, (tuple(self.shape), self.dtype, fields, self.numerics, self.requires_grad, self.compute_copy)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Runs for every op on the weight, twice per linear per microbatch: one dict lookup decides.
        handler = OPS.get(func)
        if handler is None:
            handler = OPS[func] = refuse if func._schema.is_mutable or func.__name__.endswith("_") else compute
        return handler(cls, func, args, kwargs or NO_KWARGS)

    __torch_function__ = torch._C._disabled_torch_function_impl


_SETATTR = torch.Tensor.__setattr__


def _rebuild(shape, dtype, fields, numerics, requires_grad, compute_copy=True):
    return NVFP4Tensor(shape, dtype, **fields, numerics=numerics, requires_grad=requires_grad,
                       compute_copy=compute_copy)  # fmt: skip


# Pickles name the rebuild by module path: `fp4_dist.tensor._rebuild`, the package that re-exports it, so files
# saved by any version of the package load alike. torch.load's default weights_only unpickler calls only
# allow-listed functions; the rebuild takes plain tensors, a dtype, a shape tuple and a string, so it is as safe as
# loading those.
_rebuild.__module__ = "fp4_dist.tensor"
torch.serialization.add_safe_globals([_rebuild])


def _check_field(name: str, t: torch.Tensor, dtype: torch.dtype, shape) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"NVFP4Tensor.{name}: expected {dtype} of shape {list(shape)}, got {got}")


def is_nvfp4_tensor(t) -> bool:
    return isinstance(t, NVFP4Tensor)

