"""`python -m fp4_dist.export`'s help and usage errors, as a user reads them."""

import pytest

from fp4_dist.export.__main__ import main


def _output(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr()
    return out.out + out.err


def test_help_describes_every_argument_in_plain_text(capsys):
    top = _output(capsys, ["--help"])
    sub = _output(capsys, ["megatron", "--help"])
    assert "``" not in top + sub  # no reStructuredText markup
    assert "usage: python -m fp4_dist.export SOURCE" in top and "megatron" in top
    for name in ("SAVE_DIR", "OUT_DIR", "--iteration N", "--max-shard-bytes B"):
        assert name in sub
    assert "the run's --save folder" in sub and "the compressed-tensors folder to write" in sub


def test_no_arguments_names_what_the_usage_line_shows(capsys):
    text = _output(capsys, [])
    assert "usage: python -m fp4_dist.export SOURCE ..." in text and "required: SOURCE" in text


def test_a_missing_iteration_is_one_line_not_a_traceback(capsys, tmp_path):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(SystemExit) as stop:
        main(["megatron", str(tmp_path), str(tmp_path / "out"), "--iteration", "5"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith("python -m fp4_dist.export: ") and err.count("\n") == 1, err
    assert "iter_0000005" in err
