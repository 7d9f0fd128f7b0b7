"""bench/megatron_lm_table.py --summary: a layout whose run stopped early is a FAIL row naming the run, and the
table goes on to the other layouts (a crash of the table hid the rows of the runs that trained)."""

import json

from bench import megatron_lm_table


def _record(iterations: int, last: int = 20) -> str:
    """A run record as fp4_dist.megatron.run writes it, of a run of `last` iterations stopped after `iterations`."""
    record = {"iterations": [{"iteration": i, "loss": 3.0 - i / 100} for i in range(1, iterations + 1)],
              "master_digest_after_setup": "abc", "nvfp4_weights": 8, "check_after_setup": "ok"}
    if iterations == last:  # written at the last iteration
        record.update(master_digest_final="def", peak_allocated_mib=None)
    return json.dumps(record)


def test_a_run_that_stopped_early_is_a_fail_row_and_the_table_goes_on(tmp_path, capsys):
    cases = {"moe": (20, 0),  # the fp4 run stopped at its first backward
             "tp2": (20, 12),
             "bf16-short": (12, 20),  # the bf16 run stopped: the fp4 run is no PASS for it
             "both-short": (12, 12),  # both stopped at the same iteration
             "ok-short": (8, 8)}  # both complete, fewer iterations than the warm-up: no step times, no crash
    for name, (bf16, fp4) in cases.items():
        last = 8 if name == "ok-short" else 20
        (tmp_path / f"{name}-bf16.json").write_text(_record(bf16, last))
        (tmp_path / f"{name}-fp4.json").write_text(_record(fp4, last))
        for mode in ("bf16", "fp4"):
            (tmp_path / f"{name}-{mode}.log").write_text("")
    assert megatron_lm_table.summary(tmp_path, [*cases, "pp2"], 10) == 1
    rows = dict(zip([*cases, "pp2"], capsys.readouterr().out.splitlines()[2:]))
    assert "fp4 stopped after iteration 0, see moe-fp4.log" in rows["moe"]
    assert "fp4 stopped after iteration 12" in rows["tp2"] and "bf16 stopped" not in rows["tp2"]
    assert "bf16 stopped after iteration 12" in rows["bf16-short"] and "fp4 stopped" not in rows["bf16-short"]
    assert "bf16 stopped after iteration 12" in rows["both-short"] and "fp4 stopped after iteration 12" in \
        rows["both-short"]  # fmt: skip
    assert rows["ok-short"].endswith("| PASS |") and "| nan |" in rows["ok-short"]
    assert "no run record" in rows["pp2"]
