"""bench/megatron_lm_table.py --summary: a layout whose run stopped early is a FAIL row naming the run, and the
table goes on to the other layouts (a crash of the table hid the rows of the runs that trained)."""

import json

from bench import megatron_lm_table


def _record(iterations: int) -> str:
    return json.dumps({"iterations": [{"iteration": i, "loss": 3.0 - i / 100} for i in range(1, iterations + 1)],
                       "master_digest_after_setup": "abc", "nvfp4_weights": 8})


def test_a_run_that_stopped_early_is_a_fail_row_and_the_table_goes_on(tmp_path, capsys):
    (tmp_path / "moe-bf16.json").write_text(_record(20))
    (tmp_path / "moe-fp4.json").write_text(_record(0))  # stopped at its first backward
    (tmp_path / "tp2-bf16.json").write_text(_record(20))
    (tmp_path / "tp2-fp4.json").write_text(_record(12))
    assert megatron_lm_table.summary(tmp_path, ["moe", "tp2", "pp2"], 10) == 1
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].startswith("| moe |") and "fp4 stopped after iteration 0, see moe-fp4.log" in rows[0]
    assert rows[1].startswith("| tp2 |") and "fp4 stopped after iteration 12" in rows[1]
    assert rows[2].startswith("| pp2 |") and "no run record" in rows[2]
