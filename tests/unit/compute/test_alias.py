"""fp4_dist/compute/alias.py: a plain alias of memory holding a weight's values, linked to the weight by clone's
node, and the op table's clone kept for everyone else (CPU; the CUDA path is the same code, covered by test_view's
CUDA cases)."""

import copy

import torch
from torch import nn

from fp4_dist.compute.alias import alias_onto
from fp4_dist.tensor import FIELDS, NVFP4Tensor
from fp4_dist.testing import assert_bytes_equal, random_weight


def _weight(requires_grad=True) -> NVFP4Tensor:
    w = NVFP4Tensor.empty((40, 48))
    w.quantize_(random_weight(40, 48, generator=torch.Generator().manual_seed(3)))
    return w.requires_grad_(requires_grad)


def test_alias_shares_the_memory_and_passes_the_gradient_to_the_weight_through_one_node():
    w = _weight()
    memory = w.dequantize(w.dtype)
    a = alias_onto(w, memory)
    assert type(a) is torch.Tensor and a.shape == w.shape and a.dtype == w.dtype and a.stride() == memory.stride()
    assert a.data_ptr() == memory.data_ptr() and torch.equal(a, memory)
    assert type(a.grad_fn).__name__ == "CloneBackward0" and a.grad_fn.next_functions[0][0].variable is w
    (a.float() * 3).sum().backward()
    assert torch.equal(w.grad, torch.full(w.shape, 3.0, dtype=w.dtype))
    memory.fill_(7)  # the caller refills the memory: the alias reads it
    assert torch.equal(a.detach(), memory)


def test_alias_has_a_version_counter_of_its_own():
    w = _weight()
    a = alias_onto(w, w.dequantize(w.dtype))
    before = a._version
    torch.autograd.graph.increment_version(w)
    assert a._version == before and not a._is_view()


def test_alias_without_grad_is_a_plain_tensor_on_the_memory():
    w = _weight(requires_grad=False)
    memory = w.dequantize(w.dtype)
    with torch.no_grad():
        a = alias_onto(w, memory)
    assert a.grad_fn is None and a.data_ptr() == memory.data_ptr()


def test_clone_and_deepcopy_still_copy_every_field():
    w = _weight()
    for c in (w.clone(), w.clone(memory_format=torch.preserve_format), w.clone(memory_format=torch.contiguous_format),
              copy.deepcopy(nn.Parameter(w)).data):
        assert type(c) is NVFP4Tensor
        for f in FIELDS[:3]:
            assert_bytes_equal(getattr(c, f), getattr(w, f), f)
            assert getattr(c, f).data_ptr() != getattr(w, f).data_ptr(), f"{f} shares memory with the original"


def test_the_alias_format_alone_gives_nan_not_stale_memory():
    from fp4_dist.tensor.ops import ALIAS_FORMAT

    placeholder = _weight().clone(memory_format=ALIAS_FORMAT)
    assert type(placeholder) is torch.Tensor and bool(placeholder.detach().isnan().all())
