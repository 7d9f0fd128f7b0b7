"""Start-up errors of `python -m examples.megatron_pretrain_gpt`: clear, and before anything is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[3]
TINY = ("--num-layers 1 --hidden-size 48 --num-attention-heads 4 --group-query-attention --num-query-groups 1 "
        "--kv-channels 12 --ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --bf16").split()


def test_fp4_param_gather_without_the_distributed_optimizer_is_refused_with_the_remedy():
    with pytest.raises(ValueError, match="--fp4-param-gather needs --use-distributed-optimizer"):
        pretrain_gpt.parse_args(TINY + ["--fp4-param-gather"])


@pytest.mark.parametrize("extra, rule", [
    (["--fp4-format", "e2m1"], "fp4_dist replaces it"),
    (["--fp4-fake-quant"], "use one of them"),
    (["--fp8-param-gather"], "cannot be combined"),
], ids=["te-fp4-format", "fake-quant-too", "fp8-too"])
def test_conflicting_fp4_flags_are_refused(extra, rule):
    with pytest.raises(ValueError, match=rule):
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather", *extra])


def test_megatron_bare_asserts_become_errors_naming_the_condition():
    with pytest.raises(ValueError, match="save_interval"):
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--save", "/tmp/x"])


def test_a_weight_with_k_not_multiple_of_16_stops_the_run_at_start_up_naming_it(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a small corpus for the start-up check. " * 50)
    argv = [a if a != "48" else "40" for a in TINY]  # hidden 40: qkv, fc1 have K = 40
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_ADDR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "fp4_dist.megatron.pretrain_gpt", *argv, "--use-distributed-optimizer",
         "--fp4-param-gather", "--kv-channels", "16", "--fp4-corpus", str(corpus)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "K (in_features, the last dim) % 16 == 0" in proc.stderr
    assert "decoder.layers.0.self_attention.linear_qkv.weight [96 x 40]" in proc.stderr
    assert "decoder.layers.0.mlp.linear_fc1.weight [64 x 40]" in proc.stderr
    assert "iter" not in proc.stdout  # no training step ran


def test_an_untested_megatron_version_stops_the_entry_point_before_anything_is_built(monkeypatch):
    from fp4_dist.megatron import adapter

    monkeypatch.setattr(adapter, "installed_megatron_version", lambda: "0.21.0")
    with pytest.raises(RuntimeError, match="found 0.21.0.*--fp4-allow-untested-megatron"):
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather"])
    assert not adapter.is_installed()


@pytest.mark.parametrize("extra, named", [
    (["--num-experts", "2"], "--num-experts"),
    (["--num-experts", "2", "--expert-model-parallel-size", "2"], "--num-experts"),
    (["--wandb-project", "p"], "--wandb-project"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (["--eval-iters", "3", "--no-load-optim"], "--no-load-optim"),
], ids=["moe", "moe-ep", "wandb", "sequence-parallel", "one-of-several"])
def test_megatron_flags_this_entry_point_does_not_implement_are_refused_by_name(extra, named):
    with pytest.raises(ValueError, match=f"not implemented by fp4_dist.megatron.pretrain_gpt.*{named}"):
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather", *extra])


@pytest.mark.parametrize("extra, rule", [
    (["--transformer-impl", "transformer_engine"], "TransformerEngine is not used here"),
    (["--pipeline-model-parallel-size", "2"], "pipeline parallel is not implemented"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "use NullTokenizer"),
    (["--data-path", "0.5", "a", "0.5", "b"], "weighted blends"),
], ids=["te-impl", "pipeline", "tokenizer", "blend"])
def test_megatron_flag_values_this_entry_point_cannot_honour_are_refused(extra, rule):
    with pytest.raises(ValueError, match=rule):
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather", *extra])


def test_the_flags_it_implements_parse():
    args = pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather", "--eval-interval",
                                           "2", "--eval-iters", "1", "--split", "90,10,0", "--log-interval", "1"])
    assert args.fp4_param_gather and args.eval_interval == 2 and {"eval_interval", "split"} <= args.fp4_given


@pytest.mark.parametrize("extra, in_fp32", [([], True), (["--grad-reduce-in-bf16"], False)])
def test_the_gradient_reduce_dtype_reaches_megatron_ddp(extra, in_fp32):
    args = pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer", "--fp4-param-gather", *extra])
    training = pretrain_gpt._megatron_training()[3]  # after the Python 3.11 shim
    assert training.get_megatron_ddp_config(args).grad_reduce_in_fp32 is in_fp32


def test_a_run_is_validated_under_its_own_options_not_an_earlier_runs_still_installed():
    # a bench runs bf16 after the FP8 mode in one process, the FP8 run's adapter still installed: the bf16 run's
    # flags (no --fp4-param-gather) are valid for it, and the installed options stay as they were
    from fp4_dist.megatron import adapter
    from fp4_dist.megatron.options import AdapterOptions, current_options

    fp8 = AdapterOptions(compute="fp8")
    adapter.install(options=fp8)
    try:
        pretrain_gpt.parse_args(TINY + ["--use-distributed-optimizer"])
        assert current_options() == fp8
    finally:
        adapter.uninstall()
