"""`fp4_dist.cast.collectives` without an initialised process group: one rank, local copies, no calls."""

import pytest
import torch

from fp4_dist.cast.collectives import (
    CommStats,
    all_gather_inplace,
    all_gather_into,
    all_reduce_max_,
    rank_and_size,
    reduce_scatter_ordered,
    reduce_scatter_sum,
)


def test_single_process_is_rank_0_of_1():
    assert rank_and_size() == (0, 1)


def test_passing_a_group_without_init_is_an_error():
    with pytest.raises(ValueError, match="not initialised"):
        rank_and_size(group=object())


def test_single_rank_collectives_are_local_and_record_nothing():
    stats = CommStats()
    x = torch.randn(8)
    before = x.clone()
    all_reduce_max_(x, stats=stats)
    all_gather_inplace(x, stats=stats)
    assert torch.equal(x, before)
    out = torch.empty(8)
    reduce_scatter_sum(out, x, stats=stats)
    assert torch.equal(out, x)
    reduce_scatter_ordered(out, x * 2, stats=stats)
    assert torch.equal(out, x * 2)
    all_gather_into(out, x, stats=stats)
    assert torch.equal(out, x)
    assert not stats.calls and not stats.bytes


def test_reduce_scatter_checks_sizes():
    with pytest.raises(ValueError, match="size x output"):
        reduce_scatter_sum(torch.empty(3), torch.empty(4))
