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


@pytest.mark.parametrize("argv, said", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--warmup", "0"], "argument --warmup: must be at least 1, got 0"),
    (["--log-every", "-3"], "argument --log-every: must be at least 1, got -3"),
    (["--backend", "bogus"], "argument --backend: gloo or nccl, got 'bogus'"),
    (["--step", "5"], "unrecognized arguments: --step 5"),  # a prefix of --steps is no --steps
    (["--save-every", "5"], "--save-every needs --save DIR"),
    (["--data", "no/such/corpus.txt"], "--data no/such/corpus.txt: no such file"),
])
def test_values_that_stopped_every_rank_deep_in_the_run_are_usage_errors(monkeypatch, capsys, argv, said):
    # Each ended in a ZeroDivisionError or a torch assertion on every rank (and --steps -1 "trained -1 steps").
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stopped:
        train_lm.parse_args(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_the_learning_rate_schedule_reaches_the_optimizer(monkeypatch, capsys):
    # It was written into the inner optimizer, which each step overwrites from the outer one: every run trained
    # at the constant --lr, whatever --warmup said. (A model smaller than the default: the loss falls by 1.06 in
    # 4 steps with a 1-step warm-up, by 0.03 with a warm-up that keeps the learning rate near 0.)
    for k in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    finals = {}
    for warmup in ("1", "100000"):
        assert train_lm.main(["--steps", "4", "--warmup", warmup, "--no-progress", "--log-every", "4", "--dim", "64",
                              "--hidden", "128", "--seq", "32"]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("trained 4 steps"))
        first, last = (float(x) for x in line.split("train loss ")[1].split(";")[0].split(" -> "))
        finals[warmup] = first - last
    assert finals["1"] > 0.5 and abs(finals["100000"]) < 0.1, finals


def test_relative_paths_are_the_callers(monkeypatch, tmp_path):
    # scripts/train.sh runs from the repository root and names the folder it was started from
    (tmp_path / "text.txt").write_text("abc")
    monkeypatch.setenv("FP4_DIST_CALLER_DIR", str(tmp_path))
    args = train_lm.parse_args(["--data", "text.txt", "--save", "ckpt"])
    assert args.data == tmp_path / "text.txt" and args.save == tmp_path / "ckpt" and args.save_every == 50
