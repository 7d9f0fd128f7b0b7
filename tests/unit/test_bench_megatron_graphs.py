"""bench/megatron_graphs.py (a GPU bench) refuses, before it starts any run, what would waste a device call: a mode
whose graphs Megatron's start-up refuses, and a check interval whose only checks fall on the last iteration."""

from __future__ import annotations

import pytest

from bench import megatron_graphs


@pytest.mark.parametrize("argv, said", [
    (["--modes", "bf16,nvfp4"], "--modes nvfp4 runs eagerly only"),
    (["--iters", "10", "--check-every", "10"], "--check-every 10 needs --iters above it"),
    (["--modes", "bf16,fp9"], "--modes: unknown ['fp9']"),
])
def test_a_run_that_cannot_measure_what_it_asks_is_refused_at_once(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        megatron_graphs.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err

