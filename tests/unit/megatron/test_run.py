"""fp4_dist.megatron.run's decisions that need no process: ranks from each launcher, platform flags, refusals."""

from __future__ import annotations

import argparse

import pytest
import torch

from fp4_dist.megatron import run
from fp4_dist.megatron.adapter import refuse_unsupported_args


def test_ranks_come_from_torchrun_srun_or_nothing():
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert run.export_rank_environment(env) == "torchrun" and env["LOCAL_RANK"] == "0"
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_ID": "77"}
    assert run.export_rank_environment(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("5", "8", "1", "127.0.0.1")
    other = {**{k: v for k, v in env.items() if k.startswith("SLURM")}, "SLURM_PROCID": "0"}
    run.export_rank_environment(other)
    assert other["MASTER_PORT"] == env["MASTER_PORT"], "every task of a step must derive the same port"
    env = {}
    assert run.export_rank_environment(env) == "single" and (env["RANK"], env["WORLD_SIZE"]) == ("0", "1")


def test_launches_it_cannot_serve_are_refused_with_the_remedy():
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        run.export_rank_environment({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "16",
                                     "SLURM_STEP_NUM_NODES": "2"})
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        run.export_rank_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(RuntimeError, match="--async-save is not supported"):
        run.refuse_launch("pretrain_gpt.py", ["--bf16", "--async-save"])


def test_a_launcher_option_after_the_script_is_named_once_with_where_it_goes(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        run.refuse_launch("pretrain_gpt.py", ["--bf16", "--check-every", "10", "--log-json=r.json"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--check-every --log-json are options of the launcher, not of pretrain_gpt.py: write them before the " \
           "script" in err and err.count("\n") == 2  # the sentence and the usage line, no parser dump
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        run.refuse_launch("pretrain_gpt.py", ["--no-compute-copy"])
    assert capsys.readouterr().err == ""  # once for the job: rank 0 says it


def test_megatron_has_none_of_the_launchers_option_names():
    pytest.importorskip("megatron.core")
    from fp4_dist.megatron.patching import python_311_shim

    python_311_shim()
    from megatron.training.arguments import parse_args

    from fp4_dist.megatron.options import AdapterOptions

    ours = AdapterOptions.all_flags()
    parser_flags = set()
    import argparse

    real_parse = argparse.ArgumentParser.parse_known_args
    try:  # the flags Megatron's parser defines, taken from the parser it builds
        def grab(self, *a, **k):
            parser_flags.update(s for action in self._actions for s in action.option_strings)
            raise SystemExit(0)

        argparse.ArgumentParser.parse_known_args = grab
        with pytest.raises(SystemExit):
            parse_args(ignore_unknown_args=True)
    finally:
        argparse.ArgumentParser.parse_known_args = real_parse
    assert parser_flags and not ours & parser_flags, ours & parser_flags


def test_a_bare_megatron_assertion_is_named_by_its_condition(tmp_path, monkeypatch):
    # A module of its own: pytest rewrites the asserts of test modules, not of the code they import.
    source = "def validate(args):\n    assert args.save_interval is not None\n"
    (tmp_path / "checks_like_megatron.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import types

    from checks_like_megatron import validate

    with pytest.raises(AssertionError) as raised:
        validate(types.SimpleNamespace(save_interval=None))
    assert run.describe(raised.value) == (f"assert args.save_interval is not None "
                                          f"({(tmp_path / 'checks_like_megatron.py').as_posix()}:2)")


def test_platform_flags_are_added_only_when_needed_and_never_over_the_users():
    from fp4_dist.megatron import defaults as D

    def added(argv, machine):
        return D.as_arguments(D.missing(argv, machine))

    bare = D.Machine(cuda=False)
    assert added([], bare) == ["--distributed-backend", "gloo", "--transformer-impl", "local",
                               "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                               "--no-masked-softmax-fusion", "--no-rope-fusion", "--eval-interval", "1000000000"]
    given = ["--distributed-backend=gloo", "--transformer-impl", "local", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
             "--eval-interval", "5"]  # fmt: skip
    assert added(given, bare) == []
    full = D.Machine(cuda=True, te=True, apex=True, fused_softmax=True, fused_wgrad=True)
    assert added([], full) == ["--eval-interval", "1000000000"]


def _args(**kw):
    base = dict(fp4_param_gather=True, use_distributed_optimizer=True, pipeline_model_parallel_size=1, bf16=True,
                num_experts=None, transformer_impl="local", fp16=False, async_save=False, use_torch_fsdp2=False,
                use_megatron_fsdp=False, data_parallel_random_init=False,
                overlap_param_gather_with_optimizer_step=False, load=None, ckpt_step=None, ckpt_format="torch")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("change, named", [
    (dict(num_experts=4, moe_grouped_gemm=True), "--moe-grouped-gemm"),
    (dict(transformer_impl="transformer_engine"), "--transformer-impl transformer_engine"),
    (dict(fp16=True), "--fp16"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(use_distributed_optimizer=False), "without --use-distributed-optimizer"),
    (dict(data_parallel_random_init=True), "--data-parallel-random-init"),
    (dict(bf16=False), "an fp32 model"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl transformer_engine (TransformerEngine's graphs"),
    (dict(external_cuda_graph=True), "--external-cuda-graph (TransformerEngine's graphs"),
    (dict(optimizer_cuda_graph=True), "--optimizer-cuda-graph (the shard cast's checks"),
    # Megatron's own graphs run on GPUs (tests/distributed/test_megatron_graphs.py); CPU ranks refuse them
    *[pytest.param(change, named, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks only"))
      for change, named in [(dict(cuda_graph_impl="local"), "--cuda-graph-impl local on CPU ranks"),
                            (dict(cuda_graph_impl="full_iteration"), "--cuda-graph-impl full_iteration on CPU ranks"),
                            (dict(enable_cuda_graph=True), "--enable-cuda-graph on CPU ranks")]],
])
def test_each_unsupported_fp4_run_is_refused_naming_the_flag(change, named):
    pytest.importorskip("megatron.core")
    refuse_unsupported_args(_args())  # the supported run passes
    with pytest.raises(ValueError, match=named.replace("-", r"\-").replace("(", r"\(")):
        refuse_unsupported_args(_args(**change))
    refuse_unsupported_args(_args(**change, fp4_param_gather=False))  # bf16 runs are not fp4_dist's to refuse


def test_pipeline_and_expert_parallel_runs_pass_the_start_up_checks():
    pytest.importorskip("megatron.core")
    refuse_unsupported_args(_args(pipeline_model_parallel_size=2, num_experts=4, moe_grouped_gemm=False))
    refuse_unsupported_args(_args(cuda_graph_impl="none", enable_cuda_graph=False))


def test_a_tracker_file_left_empty_by_a_killed_save_is_refused_naming_it(tmp_path):
    pytest.importorskip("megatron.core")
    for name in ("iter_0000004", "iter_0000006"):
        (tmp_path / name).mkdir()
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("")  # a save killed between opening the file and writing the number
    with pytest.raises(ValueError, match=r"holds '', not an iteration: a save was killed.*iter_0000006"):
        refuse_unsupported_args(_args(load=str(tmp_path)))
    tracker.write_text("4")
    refuse_unsupported_args(_args(load=str(tmp_path)))


def test_a_load_names_the_iterations_newer_than_the_tracker_it_skips(tmp_path, capsys, monkeypatch):
    from fp4_dist.megatron.startup import note_unfinished_saves

    monkeypatch.setenv("RANK", "0")
    for name in ("iter_0000002", "iter_0000004", "iter_0000006"):
        (tmp_path / name).mkdir()
    note_unfinished_saves(_args(load=str(tmp_path)))
    assert "resumes from the initial weights (no complete checkpoint); skipped iter_0000002, iter_0000004, " \
           "iter_0000006" in capsys.readouterr().out
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    note_unfinished_saves(_args(load=str(tmp_path)))
    assert "resumes from iteration 4; skipped iter_0000006: newer than" in capsys.readouterr().out
    (tmp_path / "iter_0000006").rmdir()
    note_unfinished_saves(_args(load=str(tmp_path)))
    assert capsys.readouterr().out == ""  # nothing skipped, nothing said


def test_a_checkpoint_of_the_other_parameter_layout_is_named_for_what_it_is():
    # Megatron's own words name element counts, not the flag that changed them.
    text = "Number of unpadded elements must be same in current run (22272) and checkpoint (120576)"
    assert "saved with --fp4-param-gather" in run.hint(text, lost=False)
    assert run.hint("something else", lost=False) == "" and "peer rank" in run.hint(text, lost=True)


def test_graphs_with_a_mode_whose_row_refuses_them_are_refused_naming_both():
    # the nvfp4 mode draws its stochastic rounding's seeds on the host: a replay would reuse the captured ones
    pytest.importorskip("megatron.core")
    from fp4_dist.compute.modes import MODES
    from fp4_dist.megatron.options import AdapterOptions, current_options, set_options

    refusing = [m for m in MODES.values() if m.cuda_graphs is not None]
    assert [m.name for m in refusing] == ["nvfp4"]
    before = current_options()
    try:
        set_options(AdapterOptions(compute="nvfp4"))
        with pytest.raises(ValueError, match=r"--cuda-graph-impl local and --compute nvfp4 .*seeds drawn at capture"):
            refuse_unsupported_args(_args(cuda_graph_impl="local"))
        refuse_unsupported_args(_args())  # eager: runs
    finally:
        set_options(before)
