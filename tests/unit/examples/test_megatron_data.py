"""examples/megatron_data.py: the example trainer's batches (no megatron-core needed for these)."""

from __future__ import annotations

import pytest
import torch

from examples.megatron_data import BatchPlan, microbatches, window_offsets


@pytest.mark.parametrize("dp_rank", [0, 1, 2])
def test_microbatches_are_this_ranks_windows_in_order_with_labels_one_token_ahead(dp_rank):
    tokens = (torch.arange(5000) * 7919) % 50257  # no two windows alike
    plan = BatchPlan(seq_length=16, micro_batch_size=2, global_batch_size=12, dp_rank=dp_rank, dp_size=3, seed=3)
    offsets = window_offsets(tokens.numel(), plan, iteration=5)
    mine = offsets[4 * dp_rank:4 * (dp_rank + 1)].tolist()
    batches = list(microbatches(tokens, plan, 5, "cpu"))
    assert len(batches) == plan.num_microbatches == 2
    for m, batch in enumerate(batches):
        for j in range(plan.micro_batch_size):
            o = mine[m * plan.micro_batch_size + j]
            assert torch.equal(batch["tokens"][j], tokens[o:o + 16]), (m, j)
            assert torch.equal(batch["labels"][j], tokens[o + 1:o + 17]), (m, j)
        assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, -1))
        assert batch["tokens"].is_contiguous() and batch["labels"].is_contiguous()


def test_every_rank_draws_from_the_same_step_offsets_and_steps_differ():
    plan = BatchPlan(seq_length=8, micro_batch_size=1, global_batch_size=4, dp_rank=0, dp_size=2, seed=1)
    assert torch.equal(window_offsets(1000, plan, 3), window_offsets(1000, plan, 3))
    assert not torch.equal(window_offsets(1000, plan, 3), window_offsets(1000, plan, 4))
