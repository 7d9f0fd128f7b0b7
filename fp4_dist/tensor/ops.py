"""The op table of `NVFP4Tensor`: what each aten op does when a weight is one of its arguments.

Three kinds of handler (the tensor module's docstring says why):

- storage-preserving ops (detach, alias, clone, view or as_strided to the same shape, _to_copy to another device,
  copy_) keep the packed form and the Python attributes a parameter carries;
- in-place ops that would reinterpret or mutate the packed bytes raise NotImplementedError naming the op;
- everything else runs on the weight's compute value (`NVFP4Tensor.compute_value`).

`__torch_dispatch__` looks a handler up once per op and caches the default for unlisted ops.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def compute(cls, func, args, kwargs):
    """Any op not in the table that leaves its inputs alone: run it on the weights' compute values."""
    if kwargs:
        return func(*_values(cls, args), **dict(zip(kwargs, _values(cls, kwargs.values()))))
    return func(*_values(cls, args))


def refuse(cls, func, args, kwargs):
    raise NotImplementedError(
        f"{func} would mutate the packed bytes of an NVFP4Tensor in place. NVFP4 weights train through fp32 "
        "masters: use fp4_dist.optim.Zero1Optimizer (wraps any torch.optim optimizer), fp4_dist.fsdp."
        "fully_shard_nvfp4, or keep masters yourself and re-quantize with `weight.quantize_(master)` (or copy_ a "
        "high-precision tensor into it)"
    )


def _values(cls, args) -> list:
    """Arguments of a compute op with every weight (an instance of `cls`) replaced by its compute value. Ops run
    in every forward and backward, so the usual shapes (flat arguments, a list of tensors) avoid pytree's generic
    walk."""
    out = []
    for a in args:
        if isinstance(a, cls):
            a = a.compute_value()
        elif isinstance(a, (list, tuple)):
            a = type(a)(_values(cls, a)) if not hasattr(a, "_fields") else tree_map(lambda t: _value(cls, t), a)
        elif isinstance(a, dict):
            a = tree_map(lambda t: _value(cls, t), a)
        out.append(a)
    return out


def _value(cls, t):
    return t.compute_value() if isinstance(t, cls) else t


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
def _t(cls, func, args, kwargs):
    # The one op on a weight in every forward (F.linear, Megatron's matmul(x, w.t())): straight to the value's
    # own method, without the generic argument walk and the OpOverload call (~4 us of host time per use).
    return args[0].compute_value().t()


@_implements(aten.mm.default)
def _mm(cls, func, args, kwargs):
    # The op of every backward that reads the weight (x.grad = dy @ W, Megatron's grad_output.matmul(weight)).
    a, b = args
    return torch.mm(_value(cls, a), _value(cls, b))


@_implements(aten.detach.default, aten.alias.default)
def _alias(cls, func, args, kwargs):
    return args[0]._alias()


ALIAS_FORMAT = torch.channels_last_3d
"""The memory format that asks ``clone`` of an NVFP4 weight for a placeholder instead of a copy: a 5-D layout no
2-D tensor can have (torch refuses it for plain ones), passed only by `fp4_dist.compute.alias.alias_onto`, which
binds the placeholder to memory holding the weight's values. What it needs of clone is the autograd node alone."""


@_implements(aten.clone.default)
def _clone(cls, func, args, kwargs):
    w = args[0]
    if kwargs.get("memory_format") is ALIAS_FORMAT:
        # Zero strides: one element of storage, which alias_onto replaces at once; NaN, so that any other caller
        # passing this format sees that it got no values, not whatever the allocator held.
        return torch.empty_strided(tuple(w.shape), (0, 0), dtype=w.dtype, device=w.device).fill_(float("nan"))
    return w._with_fields(lambda t: t.clone())


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(cls, func, args, kwargs):
    src, shape = args[0], list(args[1])
    if shape == list(src.shape):
        return src._alias()
    _refuse_fsdp(func)
    return func(src.compute_value(), *args[1:], **kwargs)


@_implements(aten.as_strided.default)
def _as_strided(cls, func, args, kwargs):
    # FSDP2 makes its unsharded parameter as as_strided(output, its shape, contiguous strides, 0): a weight that
    # is FSDP2's unsharded parameter itself (the nvfp4 compute mode's) must come through it whole, with its codes.
    src, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if size == list(src.shape) and stride == list(src.stride()) and not offset:
        return src._alias()
    return compute(cls, func, args, kwargs)


@_implements(aten.split.Tensor, aten.split_with_sizes.default, aten.new_zeros.default)
def _shard_op(cls, func, args, kwargs):
    # The ops torch's FSDP shards a parameter with: on an NVFP4Tensor they would shard (and all-gather) its bf16
    # value, silently dropping the NVFP4 form. Model code may still split a weight (a fused QKV, say).
    _refuse_fsdp(func)
    return compute(cls, func, args, kwargs)


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
def _to_copy(cls, func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype", src.dtype)
    device = kwargs.get("device", src.device)
    if dtype != src.dtype:  # w.float(), w.to(torch.float32): the value, not the container
        return src.dequantize(dtype).to(device)
    return src._carry_attributes(src._with_fields(lambda t: t.to(device=device, copy=True)))


@_implements(aten.copy_.default)
def _copy(cls, func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, cls):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"copy_ into NVFP4Tensor {list(dst.shape)} from a tensor of shape {list(src.shape)}")
        if isinstance(src, cls):
            for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
                getattr(dst, f).copy_(getattr(src, f))
            if dst.columnwise_data is not None:
                dst.make_columnwise()
            return dst
        return dst.quantize_(src)
    return dst.copy_(src.dequantize(dst.dtype))


@_implements(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
def _like(cls, func, args, kwargs):
    # Optimizer state and grad buffers shaped like a weight are plain high-precision tensors.
    src = args[0]
    kwargs = dict(kwargs)
    kwargs.setdefault("dtype", src.dtype)
    kwargs.setdefault("device", src.device)
    # A 0-dim tensor expanded to [M, K] stands in for the weight without allocating; being stride-0, it makes
    # preserve_format fall back to contiguous strides.
    return func(torch.empty((), dtype=src.dtype, device=src.device).expand(src.shape), *args[1:], **kwargs)
