"""After the byte all-gather of NVFP4 weights: columnwise copies and compute copies (TransformerEngine's
`post_all_gather_processing`)."""

from __future__ import annotations

import torch

from .. import kernels
from ..tensor.copy import BoundRefresh
from ..format import has_columnwise
from ..tensor import is_nvfp4_tensor
from .core import BINDINGS


def post_all_gather_processing(model_weights, *, columnwise: bool = True) -> None:
    """After the byte all-gather: refresh the compute copies and build the columnwise copies of NVFP4 weights.

    Args:
        model_weights: a tensor or a list; entries that are not NVFP4Tensor are ignored (as in TE).
        columnwise: build the columnwise copies (nibble transpose + scale transpose), as TransformerEngine's
            function does; weights with an odd M stay rowwise-only (two rows share a columnwise byte). False:
            drop them instead (set to None, never left stale): nothing in a Hopper or CPU training step reads
            them, and `make_columnwise()` builds them on demand.
    One launch per stage for all weights (the two transposes, and dequantize); the launches are bound once per
    list of weights and reused while the list and its tensors stay the same.
    """
    if isinstance(model_weights, torch.Tensor):
        model_weights = [model_weights]
    if model_weights is None or not hasattr(model_weights, "__iter__"):
        raise TypeError(f"post_all_gather_processing: model_weights must be a tensor or a list of them, got "
                        f"{type(model_weights).__name__}")
    ours = [w for w in model_weights if is_nvfp4_tensor(w)]
    if not ours:
        return
    key = ("post_gather", tuple(map(id, ours)), columnwise)
    post = BINDINGS.get(key)
    if post is None:  # holds the weights, so the ids stay theirs while it is cached
        post = _PostGather(ours, columnwise)
        BINDINGS.put(key, post)
    post()


class _PostGather:
    """post_all_gather_processing of one list of weights, bound: transposes (or drop), then the refresh."""

    def __init__(self, weights, columnwise: bool):
        self.weights, self.columnwise = weights, columnwise
        self.refresh = BoundRefresh(weights)
        self._transposes, self._fields = [], None

    def __call__(self) -> None:
        if self.columnwise:
            if self._fields is None or any(a is not b for a, b in zip(_fields(self.weights), self._fields)):
                self._transposes = bind_columnwise(self.weights)  # first call, or a field was replaced
                self._fields = _fields(self.weights)
            for run in self._transposes:
                run()
        else:
            drop_columnwise(self.weights)
        self.refresh()


def _fields(weights) -> list:
    """What the bound transposes read and write, for an identity check."""
    return [t for w in weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.columnwise_data,
                                         w.columnwise_scale_inv)]  # fmt: skip


def bind_columnwise(weights) -> list:
    """Bound nibble + scale transposes building the columnwise copies of the weights with an even M (allocated
    here if absent); empty when there are none. Weights with an odd M stay rowwise-only."""
    todo = [w for w in weights if has_columnwise(w.shape[0])]
    if not todo:
        return []
    for w in todo:
        w.alloc_columnwise()
    return [kernels.bind_nibble_transpose([w.rowwise_data for w in todo], [w.columnwise_data for w in todo]),
            kernels.bind_scale_transpose([w.rowwise_scale_inv for w in todo], [w.columnwise_scale_inv for w in todo],
                                         [tuple(w.shape) for w in todo])]  # fmt: skip


def drop_columnwise(weights) -> None:
    """Set the columnwise copies to None (never left stale after the rowwise bytes change)."""
    for w in weights:
        if w.columnwise_data is not None or w.columnwise_scale_inv is not None:
            w.columnwise_data = w.columnwise_scale_inv = None
