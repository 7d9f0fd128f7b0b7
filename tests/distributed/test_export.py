"""Train with NVFP4 weights on gloo ranks, export to compressed-tensors, load with transformers
(tests/distributed/export_cases.py): Zero1Optimizer at 2 ranks, and FSDP2 saved with DCP at 2 ranks and exported
at 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from .rank_results import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SCRIPT = Path(__file__).with_name("export_cases.py")
TIMEOUT_S = 240


def run_case(case: str, ranks: int, out: Path) -> None:
    for rank, outcome in run_ranks(SCRIPT, [case, out], ranks, TIMEOUT_S).items():
        assert outcome == "OK", f"{case} rank {rank}: {outcome}"


@pytest.mark.distributed
@pytest.mark.slow
def test_zero1_llama_trained_on_two_ranks_exports_what_transformers_loads_bitwise(tmp_path):
    run_case("zero1_llama", 2, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_saved_with_dcp_at_two_ranks_exports_at_one_the_trained_bytes(tmp_path):
    run_case("fsdp_train_save", 2, tmp_path)
    run_case("fsdp_load_export", 1, tmp_path)
