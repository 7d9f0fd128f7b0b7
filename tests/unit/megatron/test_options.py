"""`fp4_dist.megatron.options.AdapterOptions` is the one definition of the Megatron options: the launcher, the example
trainer and `enable()` read its fields, and no parser spells one of them on its own."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from fp4_dist.megatron import AdapterOptions, enable
from fp4_dist.megatron.run import _parser

REPO = Path(__file__).parents[3]
# Every field away from its default, in three sets: kept bf16 copies, the FP8 compute mode and the lean pool's depth
# exclude one another.
CHOSEN = dict(numerics="te-2.14", compute_copy=True, lean_depth=1, compute="bf16", compute_options=(),
              columnwise=True, check_every=7, log_json="run.json", allow_untested_version=True)  # fmt: skip
CHOSEN_FP8 = dict(CHOSEN, compute_copy=False, compute="fp8", compute_options=("keep_transpose=false",))
CHOSEN_LEAN = dict(CHOSEN, compute_copy=False, lean_depth=3)
MODES = {"kept": CHOSEN, "fp8": CHOSEN_FP8, "lean": CHOSEN_LEAN}


def _argv(prefix: str, mode: str = "kept") -> list[str]:
    flags = AdapterOptions.flags(prefix)
    middle = {"kept": [flags["compute_copy"]], "lean": [flags["lean_depth"], "3"],
              "fp8": [flags["compute"], "fp8", flags["compute_options"], "keep_transpose=false"]}
    return [flags["numerics"], "te-2.14", *middle[mode], flags["columnwise"], flags["check_every"], "7",
            flags["log_json"], "run.json", flags["allow_untested_version"]]  # fmt: skip


def test_every_field_is_chosen_away_from_its_default_here():
    assert set(CHOSEN) == set(CHOSEN_FP8) == set(CHOSEN_LEAN) == {f.name for f in fields(AdapterOptions)}
    default = AdapterOptions()
    assert all(any(getattr(default, k) != chosen[k] for chosen in MODES.values()) for k in CHOSEN)
    with pytest.raises(ValueError, match="never a bf16 compute copy"):
        AdapterOptions(compute="fp8", compute_copy=True)
    with pytest.raises(ValueError, match="compute must be one of"):
        AdapterOptions(compute="fp4")
    for other in (dict(compute_copy=True), dict(compute="fp8")):
        with pytest.raises(ValueError, match="--lean-depth"):
            AdapterOptions(lean_depth=2, **other)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="lean_depth must be an int >= 1"):
            AdapterOptions(lean_depth=bad)


def test_a_compute_option_sets_a_field_of_the_modes_options_or_is_refused_naming_the_flag():
    from fp4_dist.compute.fp8 import Fp8Options
    from fp4_dist.compute.nvfp4 import Nvfp4Recipe

    assert AdapterOptions(compute="fp8", compute_options=["keep_transpose=False"]).mode_options() == \
        Fp8Options(keep_transpose=False)
    assert AdapterOptions(compute="fp8").mode_options() is None  # the mode's defaults
    recipe = AdapterOptions(compute="nvfp4", compute_options=("rht=0", "stochastic_rounding=false")).mode_options()
    assert recipe == Nvfp4Recipe(rht=False, stochastic_rounding=False)
    refusals = {
        ("bf16", "keep_transpose=false"): "the bf16 compute mode has no options",
        ("fp8", "keep_transpose"): "expected NAME=VALUE with NAME one of ['keep_transpose']",
        ("fp8", "rht=false"): "expected NAME=VALUE",
        ("fp8", "keep_transpose=maybe"): "keep_transpose: expected true or false, got 'maybe'",
        ("nvfp4", "bf16_first=2"): "bf16_first chooses layers, which only convert_linear_weights",
    }
    for (compute, pair), said in refusals.items():
        with pytest.raises(ValueError, match=re.escape(said)) as e:
            AdapterOptions(compute=compute, compute_options=(pair,))
        assert "--compute-option" in str(e.value)


def test_the_launcher_reads_every_option_from_its_flags():
    for mode, chosen in MODES.items():
        opts = _parser().parse_args(_argv("", mode) + ["pretrain_gpt.py", "--bf16"])
        assert AdapterOptions.from_args(opts) == AdapterOptions(**chosen)
        assert opts.script_args == ["--bf16"]


def test_the_example_trainer_reads_the_same_options_behind_its_prefix():
    from examples.megatron_pretrain_gpt import FLAG_PREFIX, add_fp4_dist_args

    parser = add_fp4_dist_args(argparse.ArgumentParser())
    for mode, chosen in MODES.items():
        assert AdapterOptions.from_args(parser.parse_args(_argv(FLAG_PREFIX, mode)), prefix=FLAG_PREFIX) == \
            AdapterOptions(**chosen)
    assert AdapterOptions.from_args(parser.parse_args([]), prefix=FLAG_PREFIX) == AdapterOptions()


def test_no_parser_spells_an_option_flag_of_its_own():
    names = {f.lstrip("-") for p in ("", "fp4-") for f in AdapterOptions.all_flags(p)}
    spelled = []
    # examples/train_lm.py is no Megatron program (ZeRO-1 on a plain model): its --fp4-compute is its own option,
    # named as Megatron's is for the same choice.
    not_megatron = {REPO / "examples" / "train_lm.py"}
    for path in [*(REPO / "fp4_dist").rglob("*.py"), *(REPO / "examples").rglob("*.py")]:
        if path in not_megatron:
            continue
        for flag in re.findall(r"add_argument\(\s*\"--([\w-]+)\"", path.read_text()):
            if flag in names:
                spelled.append(f"{path.relative_to(REPO)}: --{flag}")
    assert not spelled, f"options defined outside AdapterOptions: {spelled}"


def test_enable_takes_the_fields_as_keywords_and_refuses_an_unknown_one():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['check_evry'\].*'check_every'"):
        enable(check_evry=10)
    with pytest.raises(TypeError, match="not both"):
        enable(options=AdapterOptions(), check_every=1)
    with pytest.raises(ValueError, match="check_every must be an int >= 0"):
        AdapterOptions(check_every=-1)


def test_lean_is_the_default_and_no_compute_copy_spells_it_out():
    from examples.megatron_pretrain_gpt import FLAG_PREFIX, add_fp4_dist_args

    assert AdapterOptions().compute_copy is False
    trainer = add_fp4_dist_args(argparse.ArgumentParser())
    for parse, prefix in ((lambda a: _parser().parse_args(a + ["pretrain_gpt.py"]), ""),
                          (trainer.parse_args, FLAG_PREFIX)):  # fmt: skip
        assert not AdapterOptions.from_args(parse([f"--{prefix}no-compute-copy"]), prefix=prefix).compute_copy
        assert AdapterOptions.from_args(parse([f"--{prefix}compute-copy"]), prefix=prefix).compute_copy
    assert {"--compute-copy", "--no-compute-copy"} <= AdapterOptions.all_flags()
