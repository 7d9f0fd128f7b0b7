"""NVFP4Tensor: a container for one NVFP4 2D weight that PyTorch modules can use as a parameter.

It reports the logical shape [M, K] and the model dtype (bf16 by default) and holds the packed fields of
`format.py`. Ops fall in three groups, all routed through `_OPS`:

- storage-preserving (detach, alias, clone, _to_copy to another device, copy_): keep the packed form;
  `copy_` from a high-precision tensor re-quantizes in place, keeping every field's storage (the rowwise bytes
  may be a view into a data-parallel all-gather buffer);
- in-place ops that would reinterpret or mutate the packed bytes: NotImplementedError naming the op;
- everything else (linear, matmul, t, ...): runs on the dequantized value in the model dtype, so autograd hands
  a plain [M, K] gradient to the parameter.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_map

from .format import (
    check_numerics,
    check_weight_shape,
    columnwise_data_shape,
    columnwise_scale_shape,
    rowwise_data_shape,
    rowwise_scale_shape,
)

aten = torch.ops.aten

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax", "columnwise_data", "columnwise_scale_inv")


class NVFP4Tensor(torch.Tensor):
    """NVFP4 weight [M, K]: E2M1 codes, E4M3 16x16 tile scales and one fp32 amax.

    Fields:
        rowwise_data: uint8 [M, K/2], element (r, c) in byte r*K/2 + c//2, low nibble when c is even.
        rowwise_scale_inv: uint8 E4M3 bits [roundup(M,128), roundup(ceil(K/16),4)], padding zero.
        amax: fp32 [1], max|W| of the bf16 weight (not a scale).
        columnwise_data: uint8 [K, M/2] or None until `make_columnwise()`.
        columnwise_scale_inv: uint8 [roundup(K,128), roundup(ceil(M/16),4)] or None.
        numerics: "te" or "te-2.14" (block-scale formula used when this tensor is re-quantized).
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
        numerics: str = "te",
        requires_grad: bool = False,
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
        return self

    # ----------------------------------------------------------------------------------------------- build
    @classmethod
    def empty(cls, shape, *, device=None, dtype: torch.dtype = torch.bfloat16, numerics: str = "te"):
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
        return {f: getattr(self, f) for f in _FIELDS}

    def _with_fields(self, fn: Callable[[torch.Tensor], torch.Tensor], requires_grad: bool = False):
        new = {f: (None if t is None else fn(t)) for f, t in self._fields().items()}
        return NVFP4Tensor(self.shape, self.dtype, **new, numerics=self.numerics, requires_grad=requires_grad)

    # ------------------------------------------------------------------------------------------- numerics
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain [M, K] tensor: e2m1_value * ((float(s_t) * amax) * fp32(1/2688))."""
        from .kernels import reference

        return reference.dequantize(self.rowwise_data, self.rowwise_scale_inv, self.amax, dtype)

    def quantize_(self, src: torch.Tensor) -> "NVFP4Tensor":
        """Re-quantize `src` ([M, K], any float dtype) into this tensor's existing buffers.

        Values are rounded to this tensor's dtype first. The columnwise copy, if present, is rebuilt.
        """
        from .quantize import quantize_into

        quantize_into(src, self)
        return self

    def make_columnwise(self) -> "NVFP4Tensor":
        """Build columnwise_data / columnwise_scale_inv from the rowwise copy (spec section 3); needs M even."""
        from . import kernels

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
        if m % 2:
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
        and make `rowwise_data` alias it, so a byte all-gather into the buffer updates this weight."""
        m, k = self.shape
        want = m * k // 2
        dev = self.rowwise_data.device
        if view.dtype != torch.uint8 or view.numel() != want or view.device != dev or not view.is_contiguous():
            # A strided view would make rowwise_data strided: the cast and the gather need contiguous bytes.
            raise ValueError(
                f"set_rowwise_storage: need a contiguous uint8 view of {want} bytes on {dev}, got "
                f"{view.dtype} with {view.numel()} elements on {view.device} (contiguous={view.is_contiguous()}); "
                "pass a slice of a flat contiguous buffer"
            )
        view = view.view(rowwise_data_shape(m, k))
        view.copy_(self.rowwise_data)
        self.rowwise_data = view

    # -------------------------------------------------------------------------------------- torch plumbing
    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"NVFP4Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"amax={self.amax.item() if self.amax.device.type == 'cpu' else '<device>'}, "
            f"columnwise={'yes' if self.columnwise_data is not None else 'no'}, numerics={self.numerics!r})"
        )

    def __tensor_flatten__(self):
        names = [f for f in _FIELDS if getattr(self, f) is not None]
        return names, (tuple(self.shape), self.dtype, self.numerics)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        shape, dtype, numerics = ctx
        return NVFP4Tensor(shape, dtype, **inner, numerics=numerics)

    def __reduce_ex__(self, protocol):
        fields = {f: (None if t is None else t.detach().clone()) for f, t in self._fields().items()}
        return _rebuild, (tuple(self.shape), self.dtype, fields, self.numerics, self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func._schema.is_mutable or func.__name__.endswith("_"):
            raise NotImplementedError(
                f"{func} would mutate the packed bytes of an NVFP4Tensor in place; update the fp32 master and "
                "re-quantize with `weight.quantize_(master)` (or copy_ a high-precision tensor into it)"
            )
        return func(*_dequantize_args(args), **_dequantize_args(kwargs))

    __torch_function__ = torch._C._disabled_torch_function_impl


def _rebuild(shape, dtype, fields, numerics, requires_grad):
    return NVFP4Tensor(shape, dtype, **fields, numerics=numerics, requires_grad=requires_grad)


# torch.load's default weights_only unpickler calls only allow-listed functions; the rebuild takes plain tensors,
# a dtype, a shape tuple and a string, so it is as safe as loading those.
torch.serialization.add_safe_globals([_rebuild])


def _check_field(name: str, t: torch.Tensor, dtype: torch.dtype, shape) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"NVFP4Tensor.{name}: expected {dtype} of shape {list(shape)}, got {got}")


def is_nvfp4_tensor(t) -> bool:
    return isinstance(t, NVFP4Tensor)


def _dequantize_args(tree):
    return tree_map(lambda t: t.dequantize(t.dtype) if isinstance(t, NVFP4Tensor) else t, tree)


# ------------------------------------------------------------------------------------------------ op table
_OPS: dict = {}


def _implements(*ops):
    def register(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return register


@_implements(aten.detach.default, aten.alias.default)
def _alias(func, args, kwargs):
    return args[0]._with_fields(lambda t: t)


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._with_fields(lambda t: t.clone())


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    src, shape = args[0], list(args[1])
    if shape == list(src.shape):
        return src._with_fields(lambda t: t)
    return func(src.dequantize(src.dtype), *args[1:], **kwargs)


@_implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype", src.dtype)
    device = kwargs.get("device", src.device)
    if dtype != src.dtype:  # w.float(), w.to(torch.float32): the value, not the container
        return src.dequantize(dtype).to(device)
    return src._with_fields(lambda t: t.to(device=device, copy=True))


@_implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, NVFP4Tensor):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"copy_ into NVFP4Tensor {list(dst.shape)} from a tensor of shape {list(src.shape)}")
        if isinstance(src, NVFP4Tensor):
            for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
                getattr(dst, f).copy_(getattr(src, f))
            if dst.columnwise_data is not None:
                dst.make_columnwise()
            return dst
        return dst.quantize_(src)
    return dst.copy_(src.dequantize(dst.dtype))


@_implements(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
def _like(func, args, kwargs):
    # Optimizer state and grad buffers shaped like a weight are plain high-precision tensors.
    src = args[0]
    kwargs = dict(kwargs)
    kwargs.setdefault("dtype", src.dtype)
    kwargs.setdefault("device", src.device)
    # A 0-dim tensor expanded to [M, K] stands in for the weight without allocating; being stride-0, it makes
    # preserve_format fall back to contiguous strides.
    return func(torch.empty((), dtype=src.dtype, device=src.device).expand(src.shape), *args[1:], **kwargs)
