"""examples/train_lm.py's command line: every rank of a launch parses it, and a mistake is printed once."""

from __future__ import annotations

import pytest

from examples import train_lm


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False), ("3", False)])
def test_a_mistyped_option_is_printed_by_the_first_rank_and_stops_every_rank(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stopped:
        train_lm.parse_args(["--stpes", "10"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert ("unrecognized arguments: --stpes 10" in err) is printed
    assert (err == "") is not printed


def test_a_single_process_prints_the_mistake(monkeypatch, capsys):
    for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--steps", "ten"])
    assert "argument --steps: invalid int value: 'ten'" in capsys.readouterr().err
