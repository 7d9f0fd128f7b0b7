"""What a PyTorch user meets on several ranks: ranks that disagree get fp4_dist's error on every rank within
seconds (not gloo's abort, not a hang); Zero1Optimizer's gradient semantics and the standard DCP load hold across
ranks. 2 gloo ranks, every case in one job, one after the other (tests/distributed/torch_user_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .rank_results import run_cases
from .shared import once_per_session

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("torch_user_cases.py")
TIMEOUT_S = 120
CASES = ["fewer_weights", "overlapping_shards", "other_shape_same_numel", "other_numerics", "groups_of_one",
         "zero1_other_parameters", "group_without_this_rank", "zero1_nan_on_one_rank", "zero1_skip_continues",
         "zero1_gradient_on_one_rank_only", "zero1_dcp_fresh_load"]  # fmt: skip


@once_per_session
def every_case() -> dict:
    return run_cases(SCRIPT, CASES, 2, TIMEOUT_S)


def run_case(case: str) -> dict:
    """{rank: outcome} of `case`, from the one job that runs every case."""
    return {int(rank): outcome for rank, outcome in every_case()[case].items()}


@pytest.mark.parametrize("case, says", [
    ("fewer_weights", "different numbers of weights"),
    ("overlapping_shards", "do not cover each weight exactly once"),
    ("other_shape_same_numel", "different weights"),
    ("other_numerics", "different weights"),
    ("groups_of_one", "do not cover each weight exactly once"),
    ("zero1_other_parameters", "rank 1 differs from rank 0 in number of parameters: 4 on rank 0, 6 on rank 1"),
])  # fmt: skip
def test_a_structural_mismatch_raises_our_error_on_every_rank(case, says):
    results = run_case(case)
    for rank, outcome in results.items():
        assert outcome.startswith("RankMismatchError") and says in outcome, f"rank {rank}: {outcome}"


def test_a_group_without_this_rank_is_named_as_such():
    results = run_case("group_without_this_rank")
    assert results[1].startswith("ValueError") and "not a member of the process group" in results[1], results[1]
    assert results[0].startswith("RankMismatchError") and "do not cover each weight exactly once" in results[0]


def test_a_nan_gradient_on_one_rank_raises_on_every_rank_and_leaves_the_state_intact():
    for rank, outcome in run_case("zero1_nan_on_one_rank").items():
        assert outcome.startswith("ValueError") and "gradients of 1.weight hold inf or NaN" in outcome, outcome
        assert outcome.endswith("[state intact: True]"), f"rank {rank}: {outcome}"


@pytest.mark.parametrize("case", ["zero1_skip_continues", "zero1_gradient_on_one_rank_only", "zero1_dcp_fresh_load"])
def test_zero1_gradient_semantics_across_ranks(case):
    for rank, outcome in run_case(case).items():
        assert outcome == "OK", f"rank {rank}: {outcome}"
