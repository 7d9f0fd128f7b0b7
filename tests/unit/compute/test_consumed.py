"""What the GEMMs will read (`fp4_dist.compute.consumed`): a kept copy that claims to be current but holds other
values (a copy a replayed graph never rewrote, a buffer another layer wrote) fails the comparison with the copies of
the reference bytes, though the gathered bytes themselves are right."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4_dist
from fp4_dist.compare import bytes_mismatch
from fp4_dist.compute.consumed import consumed_pairs, holders_of


def _mismatches(model):
    holders = holders_of(model)
    out = []
    for name, p in model.named_parameters():
        if fp4_dist.is_nvfp4_tensor(p):
            # the reference bytes are the weight's own here: what parity checks of the gathered bytes separately
            for label, got, want in consumed_pairs(name, p, holders[id(p)], p):
                msg = bytes_mismatch(got, want, label)
                if msg:
                    out.append(msg)
    return out


def _model(device="cpu", **convert):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(272, 128), nn.GELU(), nn.Linear(128, 48)).to(device, torch.bfloat16)
    fp4_dist.convert_linear_weights(model, **convert)
    model(torch.randn(4, 272, dtype=torch.bfloat16, device=device)).sum().backward()  # the copies exist after a use
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("convert, field", [(dict(compute_copy=True), "kept bf16 copy"),
                                            (dict(compute="fp8"), "FP8 copy (bits)")])
def test_a_copy_that_claims_to_be_current_but_is_not_fails_the_check(convert, field, device):
    model = _model(device, **convert)
    labels = [label for name, p in model.named_parameters() if fp4_dist.is_nvfp4_tensor(p)
              for label, _, _ in consumed_pairs(name, p, holders_of(model)[id(p)], p)]
    assert any(field in label for label in labels), labels  # the copies the next use reads are compared
    assert _mismatches(model) == []
    # Write one value of the copy through .data, which keeps its version counter: as a write no one recorded (a
    # replayed graph's), the copy still claims to be current.
    if "kept" in field:
        model[2].weight.copy_state.value.data[0, 0] += 1.0
    else:
        model[2].__dict__["_fp4_fp8_copy"].operand.bits.data[0, 0] ^= 1
    wrong = _mismatches(model)
    assert len(wrong) == 1 and wrong[0].startswith(f"2.weight {field}"), wrong


def test_a_lean_weight_keeps_no_copy_to_compare_and_a_stale_copy_is_remade_not_read():
    lean = _model()
    assert [pairs for name, p in lean.named_parameters() if fp4_dist.is_nvfp4_tensor(p)
            for pairs in consumed_pairs(name, p, holders_of(lean)[id(p)], p)] == []
    kept = _model(compute_copy=True)
    kept[0].weight.copy_state.value.add_(1.0)  # a recorded write: the copy no longer proves itself current
    assert _mismatches(kept) == []  # its next use remakes it, so nothing stale is read


def test_a_lean_copy_changed_behind_its_version_counter_fails_the_audit_of_its_next_use():
    from fp4_dist.compute.lean import lean_view
    from fp4_dist.compute.pool import audit_uses, audit_verdicts

    model = _model()
    x = torch.randn(4, model[0].weight.shape[1], dtype=torch.bfloat16)
    audit_uses()
    model(x)
    assert audit_verdicts() == (2, [])  # both linears' uses read their weights' values
    buf = lean_view(model[-1]).buffer
    assert buf.token is not None, "the last layer's copy stays in its buffer, proven current"
    with torch.autograd._unsafe_preserve_version_counter(buf.tensor):
        buf.tensor.view(-1)[0] += 1  # a copy that still claims to be current, as a replay that never rewrote it
    audit_uses()
    model[-1](torch.randn(4, model[-1].weight.shape[1], dtype=torch.bfloat16))
    uses, stale = audit_verdicts()
    assert uses == 1 and stale == [model[-1].weight]
