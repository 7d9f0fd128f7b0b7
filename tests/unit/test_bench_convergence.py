"""bench/convergence.py's reading side: finished runs from their records, runs stopped by a time limit from their
logs, the tables, and smoothing that does not depend on how often a run was sampled."""

import argparse
import json
import sys

import pytest

from bench import convergence


def _folder(tmp_path):
    names = ["fp4-lr0.0006-s1234", "fake-lr0.0006-s1234", "bf16-lr0.0006-s1234", "fp4-fl-lr0.0006-s1234"]
    (tmp_path / "runs.json").write_text(json.dumps({"lr": 6e-4, "tokens_per_iteration": 100,
                                                    "commands": {n: [] for n in names}}))  # fmt: skip
    records = [dict(iteration=i, loss=3.0 - i / 100, grad_norm=1.0) for i in range(1, 101)]
    (tmp_path / f"{names[0]}.json").write_text(json.dumps(
        {"records": records, "validation": [[50, 2.5], [100, 2.0]], "master_digest": "abc"}))
    (tmp_path / f"{names[1]}.log").write_text(
        "[###   ] iter    50/100 | loss 2.5000 | grad norm 0.750 | lr 6.00e-04 |   99.0 ms/step\n"
        "validation loss at iteration 50: lm loss 2.4000 | lm loss PPL 11.0\n"
        "[####  ] iter    60/100 | loss 2.4000 | grad norm 0.500 | lr 6.00e-04 |   99.0 ms/step\n"
        "W1127 torch/distributed: Received 15 death signal, shutting down workers\n")
    (tmp_path / f"{names[3]}.json").write_text(json.dumps(  # the record as of its last evaluation
        {"records": records[:50], "validation": [[50, 2.6]], "master_digest": None, "complete": False}))
    return tmp_path  # the bf16 run has neither record nor log: not read


def test_finished_and_stopped_runs(tmp_path):
    runs = {r["variant"]: r for r in convergence.load_runs([_folder(tmp_path)])}
    assert set(runs) == {"fp4", "fake", "fp4-fl"}
    assert runs.pop("fp4-fl")["stopped"] == 50
    assert runs["fp4"]["stopped"] is None and runs["fp4"]["digest"] == "abc" and len(runs["fp4"]["loss"]) == 100
    fake = runs["fake"]
    assert fake["stopped"] == 60 and fake["iterations"] == [50, 60] and fake["loss"] == [2.5, 2.4]
    assert fake["grad_norm"] == [0.75, 0.5] and fake["validation"] == [(5000, 2.4)] and fake["digest"] is None
    table = convergence.table(list(runs.values()))
    assert "| 0.0006 | fp4 | 2.0000 (seed 1234)" in table and "| fake |" not in table
    assert "fake-lr0.0006-s1234 at iteration 60" in table
    rows = convergence.trajectory(list(runs.values()), [50, 100]).splitlines()
    assert rows[2:] == ["| 0.0006 | fp4 | 1234 | 2.5000 | 2.0000 |", "| 0.0006 | fake | 1234 | 2.4000 | - |"]


def test_smoothing_follows_iterations_not_samples():
    every = convergence.smooth([1.0] * 10 + [2.0] * 90, list(range(1, 101)))
    sparse = convergence.smooth([1.0, 2.0], [10, 100])
    assert every[0] == pytest.approx(1.0) and sparse[0] == pytest.approx(1.0)
    # 90 iterations at weight 0.98 after a constant start: the same average however they were sampled
    assert sparse[1] == pytest.approx(every[-1], rel=1e-12)


def _plot_args(folder, out):
    return argparse.Namespace(folders=[str(folder)], out=str(out), at=[50, 100])


def test_plot_draws_one_figure_per_learning_rate(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="requirements/cpu.txt and the bench extra install it")
    assert convergence.plot(_plot_args(_folder(tmp_path), tmp_path / "figures")) == 0
    figure = tmp_path / "figures" / "convergence_lr0.0006.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {figure}" in capsys.readouterr().out


def test_plot_without_matplotlib_prints_the_tables_and_fails_naming_the_remedy(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an environment where it is not installed
    assert convergence.plot(_plot_args(_folder(tmp_path), tmp_path / "figures")) == 1
    out, err = capsys.readouterr()
    assert "| 0.0006 | fp4 |" in out and "pip install '.[bench]'" in err
    assert not (tmp_path / "figures").exists()


def test_a_resumed_run_stopped_inside_a_sitting_is_read_with_its_earlier_sittings(tmp_path):
    # --stop-at: a resumed sitting's record holds its own iterations only until it ends; the earlier sittings'
    # record waits beside it (<run>.earlier.json), and a run killed inside the sitting is read as both
    name = "fp8-lr0.0003-s1234"
    (tmp_path / "runs.json").write_text(json.dumps({"lr": 3e-4, "tokens_per_iteration": 10, "commands": {name: []}}))
    step = lambda i: dict(iteration=i, loss=5.0 - i / 10, grad_norm=1.0)  # noqa: E731
    (tmp_path / f"{name}.earlier.json").write_text(json.dumps(
        {"records": [step(i) for i in range(1, 5)], "validation": [[2, 4.0], [4, 3.5]], "complete": True}))
    (tmp_path / f"{name}.json").write_text(json.dumps(
        {"records": [step(i) for i in range(5, 7)], "validation": [[6, 3.0]], "complete": False}))
    (run,) = convergence.load_runs([tmp_path])
    assert run["iterations"] == list(range(1, 7)) and run["stopped"] == 6
    assert run["validation"] == [(20, 4.0), (40, 3.5), (60, 3.0)]


def _sitting_args(out, **kw):
    return argparse.Namespace(**dict(dict(out=str(out), variants=["fp4"], seeds=[1], lr=3e-4, model="tiny", iters=6,
                                          warmup=None, eval_interval=3, log_interval=1, gpus=0, per_gpu=1,
                                          corpus=None, stop_at=None, extra=[]), **kw))  # fmt: skip


def test_sittings_settle_into_one_record_and_a_run_missing_checkpointed_iterations_is_not_resumed(tmp_path, capsys):
    name = "fp4-lr0.0003-s1"
    step = lambda i: dict(iteration=i, loss=5.0 - i / 10, grad_norm=1.0)  # noqa: E731
    # a sitting stopped after its record but before the merge: both records, one complete run
    (tmp_path / f"{name}.earlier.json").write_text(json.dumps(
        {"records": [step(i) for i in range(1, 4)], "validation": [[3, 4.0]], "complete": True}))
    (tmp_path / f"{name}.json").write_text(json.dumps(
        {"records": [step(i) for i in range(4, 7)], "validation": [[6, 3.0]], "complete": True}))
    convergence._settle(tmp_path, name, 6)
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert [r["iteration"] for r in record["records"]] == list(range(1, 7)) and record["complete"]
    assert record["validation"] == [[3, 4.0], [6, 3.0]] and not (tmp_path / f"{name}.earlier.json").exists()
    # a sitting stopped between its checkpoint (iteration 6) and its record (up to 3): refused, naming the remedy
    (tmp_path / f"{name}.json").write_text(json.dumps({"records": [step(i) for i in range(1, 4)], "validation": []}))
    ckpt = convergence.checkpoints(tmp_path, name)
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("6")
    assert "record lacks iterations 4-6" in convergence._gap(tmp_path, name)
    assert convergence.run(_sitting_args(tmp_path, iters=9)) == 1
    assert "cannot resume" in capsys.readouterr().out


def test_a_folder_of_another_experiment_and_a_stop_between_evaluations_are_refused(tmp_path):
    convergence.run(_sitting_args(tmp_path, variants=[]))  # writes runs.json of this experiment, runs nothing
    (tmp_path / "fp4-lr0.0003-s1.json").write_text(json.dumps({"records": [], "validation": []}))
    meta = json.loads((tmp_path / "runs.json").read_text())
    (tmp_path / "runs.json").write_text(json.dumps(dict(meta, commands={"fp4-lr0.0003-s1": []})))
    with pytest.raises(SystemExit, match="another experiment .*differs in iters, model, model_args"):
        convergence.run(_sitting_args(tmp_path, model="gpt4x256", iters=9))
    with pytest.raises(SystemExit, match="multiple of the evaluation interval"):
        convergence.run(_sitting_args(tmp_path / "other", stop_at=2))


def test_the_corpus_is_part_of_the_experiment_by_its_bytes(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("def f():\n    return 1\n")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("x = 1\n")
    digest = convergence.corpus_digest
    assert digest(None) is None and len(digest(str(text))) == 64 and digest(str(folder)) != digest(str(text))
    before = digest(str(folder))
    digest.cache_clear()
    (folder / "notes.md").write_text("not read by the trainer")  # only what the trainer reads is the corpus
    (folder / "sub").mkdir()
    (folder / "sub" / "b.txt").write_text("nor this")
    assert digest(str(folder)) == before
    with pytest.raises(SystemExit, match="no text corpus at .*nothing-here"):
        digest(str(tmp_path / "nothing-here"))
    out = tmp_path / "out"
    convergence.run(_sitting_args(out, variants=[], corpus=str(text)))
    assert json.loads((out / "runs.json").read_text())["corpus_sha256"] == digest(str(text))
    (out / "fp4-lr0.0003-s1.json").write_text(json.dumps({"records": [], "validation": []}))
    meta = json.loads((out / "runs.json").read_text())
    # a folder made before the digest was recorded resumes (the digest is unknown there, not different)
    older = {k: v for k, v in meta.items() if k != "corpus_sha256"}
    (out / "runs.json").write_text(json.dumps(dict(older, commands={"fp4-lr0.0003-s1": []})))
    convergence.run(_sitting_args(out, variants=[], corpus=str(text)))
    assert json.loads((out / "runs.json").read_text())["corpus_sha256"] == digest(str(text))
    (out / "runs.json").write_text(json.dumps(dict(meta, commands={"fp4-lr0.0003-s1": []})))
    text.write_text("def f():\n    return 2\n")  # the same path, other text: another experiment
    digest.cache_clear()
    with pytest.raises(SystemExit, match="another experiment .*differs in corpus_sha256"):
        convergence.run(_sitting_args(out, corpus=str(text)))
