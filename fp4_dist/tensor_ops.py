"""The op table of `NVFP4Tensor`: what each aten op does when a weight is one of its arguments.

Three kinds of handler (the tensor module's docstring says why):

- storage-preserving ops (detach, alias, clone, view to the same shape, _to_copy to another device, copy_) keep
  the packed form and the Python attributes a parameter carries;
- in-place ops that would reinterpret or mutate the packed bytes raise NotImplementedError naming the op;
- everything else runs on the weight's compute value (`NVFP4Tensor.compute_value`).

`__torch_dispatch__` looks a handler up once per op and caches the default for unlisted ops.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.utils._pytree import tree_map

from .tensor import ALIAS_STATE, NVFP4Tensor

aten = torch.ops.aten


def compute(func, args, kwargs):
    """Any op not in the table that leaves its inputs alone: run it on the weights' compute values."""
    if kwargs:
        return func(*_values(args), **dict(zip(kwargs, _values(kwargs.values()))))
    return func(*_values(args))


def refuse(func, args, kwargs):
    raise NotImplementedError(
        f"{func} would mutate the packed bytes of an NVFP4Tensor in place. NVFP4 weights train through fp32 "
        "masters: use fp4_dist.optim.Zero1Optimizer (wraps any torch.optim optimizer), fp4_dist.fsdp."
        "fully_shard_nvfp4, or keep masters yourself and re-quantize with `weight.quantize_(master)` (or copy_ a "
        "high-precision tensor into it)"
    )


def _values(args) -> list:
    """Arguments of a compute op with every NVFP4Tensor replaced by its compute value. Ops run in every forward
    and backward, so the usual shapes (flat arguments, a list of tensors) avoid pytree's generic walk."""
    out = []
    for a in args:
        if isinstance(a, NVFP4Tensor):
            a = a.compute_value()
        elif isinstance(a, (list, tuple)):
            a = type(a)(_values(a)) if not hasattr(a, "_fields") else tree_map(_value, a)
        elif isinstance(a, dict):
            a = tree_map(_value, a)
        out.append(a)
    return out


def _value(t):
    return t.compute_value() if isinstance(t, NVFP4Tensor) else t


# ------------------------------------------------------------------------------------------------ op table
OPS: dict = {}
NO_KWARGS: dict = {}  # handlers read kwargs, never write them


def _implements(*ops):
    def register(fn):
        for op in ops:
            OPS[op] = fn
        return fn

    return register


@_implements(aten.t.default)
def _t(func, args, kwargs):
    # The one op on a weight in every forward (F.linear, Megatron's matmul(x, w.t())): straight to the value's
    # own method, without the generic argument walk and the OpOverload call (~4 us of host time per use).
    return args[0].compute_value().t()


@_implements(aten.mm.default)
def _mm(func, args, kwargs):
    # The op of every backward that reads the weight (x.grad = dy @ W, Megatron's grad_output.matmul(weight)).
    a, b = args
    return torch.mm(_value(a), _value(b))


@_implements(aten.detach.default, aten.alias.default)
def _alias(func, args, kwargs):
    return args[0]._alias()


_ALIAS_REQUEST = threading.local()


def clone_value(w: NVFP4Tensor) -> torch.Tensor:
    """``w.clone()`` as a plain tensor on `w`'s current compute copy, linked to `w` by clone's autograd node (see
    `fp4_dist.compute_view.compute_alias`, its caller). A thread-local request tells the clone handler."""
    return _clone_onto(w, True)


def alias_of(w: NVFP4Tensor, memory: torch.Tensor) -> torch.Tensor:
    """``w.clone()`` as a plain tensor on `memory` (a plain [M, K] tensor of `w`'s dtype, which the caller fills
    with `w`'s values before each use), linked to `w` by clone's autograd node (`fp4_dist.lean`'s pool buffers)."""
    return _clone_onto(w, memory)


def _clone_onto(w: NVFP4Tensor, request) -> torch.Tensor:
    _ALIAS_REQUEST.on = request
    try:
        return w.clone()
    finally:
        _ALIAS_REQUEST.on = False


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    request = getattr(_ALIAS_REQUEST, "on", False)
    if request is not False:
        _ALIAS_REQUEST.on = False  # this one call only
        value = args[0].compute_value() if request is True else request
        return value.view(value.shape)  # a new tensor on that memory (never the tensor itself: autograd gives the
        # returned tensor its grad_fn)
    return args[0]._with_fields(lambda t: t.clone())


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    src, shape = args[0], list(args[1])
    if shape == list(src.shape):
        return src._alias()
    _refuse_fsdp(func)
    return func(src.compute_value(), *args[1:], **kwargs)


@_implements(aten.split.Tensor, aten.split_with_sizes.default, aten.new_zeros.default)
def _shard_op(func, args, kwargs):
    # The ops torch's FSDP shards a parameter with: on an NVFP4Tensor they would shard (and all-gather) its bf16
    # value, silently dropping the NVFP4 form. Model code may still split a weight (a fused QKV, say).
    _refuse_fsdp(func)
    return compute(func, args, kwargs)


def _refuse_fsdp(func) -> None:
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return
        if "torch/distributed/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
            raise NotImplementedError(
                f"torch's FSDP is sharding an NVFP4Tensor weight ({func}); it would shard and all-gather its "
                "dequantized bf16 values and drop the NVFP4 form. Use fp4_dist.fsdp.fully_shard_nvfp4(model) "
                "instead of fully_shard: it keeps fp32 masters and all-gathers the weights as NVFP4 bytes")
        frame = frame.f_back


@_implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype", src.dtype)
    device = kwargs.get("device", src.device)
    if dtype != src.dtype:  # w.float(), w.to(torch.float32): the value, not the container
        return src.dequantize(dtype).to(device)
    return _carry_attributes(src, src._with_fields(lambda t: t.to(device=device, copy=True)))


def _carry_attributes(src: NVFP4Tensor, dst: NVFP4Tensor) -> NVFP4Tensor:
    """Give `dst` the Python attributes `src` carries beside its NVFP4 state (Megatron's tensor-parallel
    attributes, `get_high_precision_init_val`, a user's own).

    `nn.Module._apply` (`.cuda()`, `.to(device)`, `.bfloat16()`, Megatron's Float16Module) moves a tensor-subclass
    parameter by `swap_tensors(param, nn.Parameter(fn(param)))`, which swaps the objects' `__dict__`s: the
    parameter keeps exactly the attributes of `nn.Parameter(fn(param))`, a detach of `fn(param)`. So both the
    device move and the alias (detach, `.data`) carry them, as `param.data = ...` keeps them for a plain tensor.
    """
    extra = {k: v for k, v in src.__dict__.items() if k not in ALIAS_STATE and k != "_is_param"}
    if extra:
        dst.__dict__.update(extra)
    return dst


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
