"""A layer's FP8 block copy of its NVFP4 weight (the FP8 compute mode): remade right after each all-gather of the
weight's bytes (`post_all_gather_processing` calls `Fp8Copy.remake` through the weight's `ComputeCopy.derived`),
and at a use that finds it out of date (bytes changed some other way: copy_, load_state_dict), then read by every
forward and backward until the bytes change again (once per optimizer step).

The copy is remade in place: its tensors keep their addresses for the layer's life. A CUDA graph that captured a
GEMM reading them (Megatron's ``--cuda-graph-impl local`` / ``full_iteration``) then reads each step's copy on
replay, with no Python deciding anything at the use: the decision is made once per gather, outside the graph.

1 byte per weight and one fp32 per 128 x 128 block, beside the packed 0.5 bytes, and on a GPU the copy's transpose
(1 byte per weight, the dgrad's operand; `Fp8Options.keep_transpose`), all written by one launch per remake
(`Fp8Operand.rewrite_block_copy`): 2.5 bytes per weight on a GPU (1.5 on the CPU, or without the kept transpose)
against bf16's 2. The copy proves itself current as the lean copies do (`pool.copy_token`: the weight's cast count
and the version counters of its bytes); between a cast and its all-gather's processing nothing proves a copy current,
and each use makes one of its own (not kept).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..tensor.copy import bound, rowwise_fields
from .fp8_gemm import Fp8Operand
from .pool import copy_token

__all__ = ["Fp8Options", "weight_operand", "kept_operand", "forget", "fp8_copy_bytes"]

_ATTR = "_fp4_fp8_copy"


@dataclass(frozen=True)
class Fp8Options:
    """What the fp8 mode's layers keep between weight updates (``convert_linear_weights(compute="fp8",
    options=Fp8Options(...))``; ``--compute-option keep_transpose=false`` in Megatron)."""

    keep_transpose: bool = True
    """Keep each GPU weight copy's transpose, made by the copy's launch (the dgrad's operand: 1 byte per weight);
    False: each dgrad transposes the copy into memory freed after its GEMM (a byte transpose per backward of the
    layer), and the copies hold 1.5 bytes per weight instead of 2.5. The GEMMs read the same bits either way."""

    def __post_init__(self):
        if not isinstance(self.keep_transpose, bool):
            raise ValueError(f"Fp8Options: keep_transpose is a bool, got {self.keep_transpose!r}")

    def kept_in_default(self, names: list[str]) -> dict[str, str]:
        """No linear keeps the default mode for these options."""
        return {}


DEFAULT_OPTIONS = Fp8Options()


class Fp8Copy:
    """The copy a layer keeps: the weight fields it was made from, what proved them current then, the operand, and
    the weight (weakly: the layer holds the weight already)."""

    __slots__ = ("fields", "token", "operand", "weight", "__weakref__")

    def __init__(self, w, token: tuple, operand: Fp8Operand):
        self.fields, self.token, self.operand = rowwise_fields(w), token, operand
        self.weight = weakref.ref(w)

    def current(self, w, token) -> bool:
        return token is not None and self.token == token and bound(self.fields, w)

    def remake(self) -> None:
        """Write the copy of the weight's current bytes into the operand's tensors (their addresses stay), unless it
        holds them already or nothing proves what the bytes are (between a cast and its gather's processing)."""
        w = self.weight()
        if w is None or not bound(self.fields, w):
            return
        token = copy_token(w.copy_state, self.fields, w)
        if token is not None and token != self.token:
            self._write(w, token)

    def _write(self, w, token) -> None:
        # A forward saved these tensors for its backward: the write bumps their version counters, so a backward
        # through a graph recorded before it raises, as for a parameter changed in place.
        tensors = [t for t in self.operand if isinstance(t, torch.Tensor)]
        with torch.no_grad():
            if self.operand.rewrite_block_copy(w.rowwise_data, w.rowwise_scale_inv, w.amax):  # one launch
                for t in tensors:
                    torch.autograd.graph.increment_version(t)
            else:
                fresh = Fp8Operand.weight(w)
                if fresh.bits_t is None:  # made by the reference: its transpose as a view
                    fresh = fresh._replace(bits_t=fresh.bits.t())
                for dst, src in zip(self.operand, fresh):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
        self.token = token

    def __deepcopy__(self, memo):  # a copied layer makes its own from its own weight
        return None

    def __reduce__(self):
        return type(None), ()


def weight_operand(module: torch.nn.Module, w) -> Fp8Operand:
    """The FP8 block copy of `module`'s NVFP4 weight `w`: the one the layer keeps, remade in place first if it is
    out of date, or a new one."""
    kept = module.__dict__.get(_ATTR)
    token = copy_token(w.copy_state, rowwise_fields(w), w)
    if kept is not None and bound(kept.fields, w) and token is not None:
        if kept.token != token:
            kept._write(w, token)
        return kept.operand
    options = getattr(module, "fp4_options", None) or DEFAULT_OPTIONS
    operand = Fp8Operand.weight(w, transposed=options.keep_transpose)
    # Not kept when nothing proves it current: the next use makes its own, and the old copy's memory goes now.
    kept = module.__dict__[_ATTR] = Fp8Copy(w, token, operand) if token is not None else None
    if kept is not None:
        w.copy_state.derived.add(kept)
    return operand


def kept_operand(module: torch.nn.Module, w) -> Optional[Fp8Operand]:
    """The copy `module` keeps of `w` if it proves itself current (what its next use reads as it is), else None."""
    kept = module.__dict__.get(_ATTR)
    if kept is None:
        return None
    return kept.operand if kept.current(w, copy_token(w.copy_state, rowwise_fields(w), w)) else None


def forget(module: torch.nn.Module) -> None:
    """Drop `module`'s copy (its weight moves: `nn.Module._apply`)."""
    module.__dict__.pop(_ATTR, None)


def fp8_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes the FP8 copies of `model`'s layers hold now (values, block scales, and those laid out for cuBLAS)."""
    storages = {}  # by storage: tensors that share one are counted once
    for m in model.modules():
        kept = m.__dict__.get(_ATTR)
        if kept is not None:
            op = kept.operand
            for t in (op.bits, op.scales, op.cublas_scales, op.cublas_scales_t, op.bits_t):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
