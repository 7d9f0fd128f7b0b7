"""The Megatron entry point as a user runs it (gloo, CPU ranks): real data, evaluation, TensorBoard, tensor
parallel, resuming at another data-parallel size, errors from any rank, mpirun, and a user's own script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from . import forked_ranks  # noqa: E402
from .test_launch import REPO, megatron_env  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.megatron, pytest.mark.slow]

TIMEOUT_S = 300
TINY = ("--num-layers 1 --hidden-size 48 --num-attention-heads 4 --group-query-attention --num-query-groups 1 "
        "--kv-channels 12 --ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
        "--lr 2e-3 --bf16 --use-distributed-optimizer --seed 7 --fp4-param-gather").split()
SUITE = REPO / "tests" / "distributed" / "megatron_suite.py"


def run(nproc: int, *args: str, module: bool = True, timeout: int = TIMEOUT_S,
        fork: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """`fork=False`: real torchrun (a test of what the launcher does), else ranks from `forked_ranks`."""
    target = ["-m", "examples.megatron_pretrain_gpt"] if module else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args]
    env = megatron_env()
    return forked_ranks.run(cmd, env=env, timeout=timeout, fork=fork)


def test_data_path_evaluation_and_tensorboard_work_as_in_megatron(tmp_path):
    from examples.megatron_preprocess import write_indexed

    docs = write_indexed([str(REPO / "examples" / "data" / "tiny_corpus.txt")], str(tmp_path / "data" / "corpus"))
    assert docs > 10
    proc = run(2, *TINY, "--global-batch-size", "8", "--train-iters", "4", "--data-path", str(tmp_path / "data" /
               "corpus"), "--split", "90,10,0", "--eval-interval", "2", "--eval-iters", "2", "--tensorboard-dir",
               str(tmp_path / "tb"), "--log-interval", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("validation loss at iteration") == 2  # iterations 2 and 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"lm loss", "learning-rate", "lm loss validation"} <= set(scalars)
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]


def test_a_missing_data_path_stops_every_rank_with_the_cause(tmp_path):
    proc = run(2, *TINY, "--global-batch-size", "8", "--train-iters", "2", "--data-path", str(tmp_path / "nope"))
    assert proc.returncode != 0
    assert "[rank 0] pretrain_gpt: error: --data-path" in proc.stderr and "[rank 1]" in proc.stderr
    assert "missing" in proc.stderr and "iter " not in proc.stdout


def test_tensor_parallel_2_x_data_parallel_2_slices_equal_the_slices_of_quantizing_the_whole_weight():
    # Per-rank output rows stay multiples of 16: qkv (4 + 2 x 1 heads) x 16 / 2 = 48, fc1 128 / 2 = 64.
    wider = {"48": "64", "64": "128", "12": "16"}
    proc = run(4, *[wider.get(a, a) for a in TINY], "--global-batch-size", "8", "--train-iters", "3",
               "--log-interval", "1", "--fp4-check-every", "1", "--tensor-model-parallel-size", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if "NVFP4 gather == quantize(master)" in line]
    assert len(checks) == 3 and all(": ok (" in c for c in checks), proc.stdout[-2000:]
    assert "4 ranks" in proc.stdout


def test_under_tensor_parallelism_the_run_equals_its_fake_quantization_reference_bit_for_bit(tmp_path):
    # The reference quantizes each tensor-parallel slice with the whole weight's amax, as the NVFP4 weights' cast does
    # (with the slice's own amax, every loss differed).
    wider = {"48": "64", "64": "128", "12": "16"}
    args = [wider.get(a, a) for a in TINY if a != "--fp4-param-gather"]
    records = {}
    for mode in ("--fp4-param-gather", "--fp4-fake-quant"):
        log = tmp_path / f"{mode.strip('-')}.json"
        proc = run(2, *args, "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "4",
                   "--tensor-model-parallel-size", "2", "--fp4-master-digest", "--fp4-log-json", str(log), mode)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[mode] = json.loads(log.read_text())
    fp4, fake = records["--fp4-param-gather"], records["--fp4-fake-quant"]
    assert [r["loss"] for r in fp4["records"]] == [r["loss"] for r in fake["records"]], "losses differ"
    assert fp4["master_digest"] == fake["master_digest"], "fp32 masters differ"


def test_a_tensor_parallel_checkpoint_holds_each_ranks_slices_and_resumes_bit_for_bit(tmp_path):
    # TP 2 x DP 2: each tensor-parallel rank's data-parallel rank 0 writes its own slices (mp_rank_<tp>/); with one
    # shared file name, the second rank's optimizer state replaced the first's and the resume failed its re-cast check.
    wider = {"48": "64", "64": "128", "12": "16"}
    base = [*[wider.get(a, a) for a in TINY], "--global-batch-size", "8", "--train-iters", "4", "--log-interval", "4",
            "--fp4-master-digest"]  # fmt: skip
    args = [*base, "--tensor-model-parallel-size", "2"]
    ckpt, logs = tmp_path / "ckpt", {}
    half = ("--exit-interval", "2", "--save", str(ckpt), "--save-interval", "1000")
    for name, extra in (("whole", ()), ("half", half), ("resumed", ("--load", str(ckpt)))):
        logs[name] = tmp_path / f"{name}.json"
        proc = run(4, *args, *extra, "--fp4-log-json", str(logs[name]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    whole, resumed = (json.loads(logs[n].read_text()) for n in ("whole", "resumed"))
    assert sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")) == [
        "iter_0000002", "iter_0000002/common.pt", "iter_0000002/fp4_dist_manifest.json", "iter_0000002/mp_rank_00", "iter_0000002/mp_rank_00/distrib_optim.pt",
        "iter_0000002/mp_rank_00/model.pt", "iter_0000002/mp_rank_01", "iter_0000002/mp_rank_01/distrib_optim.pt",
        "iter_0000002/mp_rank_01/model.pt", "iter_0000002/rng.pt", "latest_checkpointed_iteration.txt"]
    assert resumed["start_iteration"] == 2
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in whole["records"]][2:]
    assert resumed["master_digest"] == whole["master_digest"], "the resumed run's fp32 masters differ"
    # another tensor-parallel size cannot take these slices: refused by name, on every rank
    proc = run(2, *base, "--load", str(ckpt))
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] pretrain_gpt: error: --load" in proc.stderr, proc.stderr[-3000:]
    assert "'tensor_model_parallel_size': (2, 1)" in proc.stderr
    # a save replaces the iteration folder whole, so one holding a file of something else is refused on every rank
    (ckpt / "iter_0000002" / "NOTES.txt").write_text("mine")
    proc = run(2, *base, *half)
    assert proc.returncode != 0 and "NOTES.txt" in proc.stderr, proc.stderr[-3000:]
    assert (ckpt / "iter_0000002" / "NOTES.txt").is_file() and (ckpt / "iter_0000002" / "mp_rank_01").is_dir()
    from fp4_dist.export import export_megatron_checkpoint  # the export says it does not join slices

    for folder in (ckpt, ckpt / "iter_0000002" / "mp_rank_01"):
        with pytest.raises(ValueError, match="holds slices of"):
            export_megatron_checkpoint(folder, tmp_path / "export")


def _suite(nproc: int, suites: str, ckpt: Path, out: Path) -> dict:
    proc = run(nproc, str(SUITE), "--out", str(out), "--suites", suites, "--ckpt", str(ckpt), module=False,
               timeout=400)  # fmt: skip
    assert out.exists(), proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["failures"] == [], "\n".join(rep["failures"][:5])
    return rep["suites"][suites]


@pytest.mark.parametrize("save_dp,load_dps", [(2, (3, 4)), (3, (2,))], ids=["dp2-to-3-and-4", "dp3-to-2"])
def test_resume_at_another_data_parallel_size_restores_masters_and_weights_bit_for_bit(save_dp, load_dps, tmp_path):
    saved = _suite(save_dp, "reshard_save", tmp_path / "ckpt", tmp_path / "save.json")
    for dp in load_dps:
        loaded = _suite(dp, "reshard_load", tmp_path / "ckpt", tmp_path / f"load{dp}.json")
        assert loaded["start"] == 3
        assert loaded["digest"] == saved["digest"], f"masters after loading at dp {dp} differ from those saved"


def test_an_error_on_one_rank_is_shown_with_its_cause_and_the_job_exits_promptly():
    start = time.monotonic()
    proc = run(3, str(REPO / "tests" / "distributed" / "megatron_fail_rank.py"), "2", *TINY, "--global-batch-size",
               "6", "--train-iters", "3", module=False, timeout=120, fork=False)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "[rank 2] pretrain_gpt: error: injected failure on rank 2: no such file data/shard_2.bin" in proc.stderr
    assert elapsed < 30, f"the job took {elapsed:.0f} s to stop"


def _mpirun():
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not installed")
def test_mpirun_launches_form_one_job():
    env = megatron_env()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-m", "examples.megatron_pretrain_gpt", *TINY,
                           "--global-batch-size", "8", "--train-iters", "2"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: nvfp4 weights") == 1 and "2 ranks" in proc.stdout, proc.stdout[-2000:]


def test_a_users_own_megatron_script_runs_with_enable(tmp_path):
    args = ("--num-layers 1 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --bf16 "
            "--use-distributed-optimizer --fp4-param-gather --transformer-impl local --tokenizer-type NullTokenizer "
            "--vocab-size 256 --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm "
            "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion "
            "--use-cpu-initialization --distributed-backend gloo --seed 3").split()
    out = tmp_path / "report.json"
    proc = run(2, str(REPO / "tests" / "distributed" / "megatron_user_script.py"), "--out", str(out), *args,
               module=False)  # fmt: skip
    assert out.exists(), proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["failures"] == [] and len(rep["losses"]) == 3, rep


@pytest.mark.parametrize("overlap", [False, True], ids=["param-sync-in-step", "overlap-param-gather"])
def test_a_nan_master_stops_every_rank_before_its_weights_are_read(overlap):
    # The adapter's cast reads its non-finite verdict at the post-all-gather processing, not in the middle of
    # the optimizer step: the error must still reach every rank, name the weight, and come before any forward
    # computes with the weights cast from the NaN (the step's own log line is missing with the in-step param
    # sync; with the overlapped one the step completes and the next forward's pre-hook stops).
    extra = ["--overlap-param-gather", "--overlap-grad-reduce"] if overlap else []
    start = time.monotonic()
    proc = run(2, str(REPO / "tests" / "distributed" / "megatron_nan_master.py"), "1", "3", *TINY,
               "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "1", *extra, module=False,
               timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "injected a NaN into an fp32 master at step 3" in proc.stdout
    for rank in (0, 1):
        # (`in`, not startswith: the ranks share the pipe, and another's warning may precede a line unfinished)
        line = next((x for x in proc.stderr.splitlines() if f"[rank {rank}] pretrain_gpt: error:" in x), "")
        named = ".weight master:" in line and ".weight.weight" not in line  # the parameter's name
        assert "values are not finite" in line and named and "resume from a checkpoint" in line, proc.stderr[-3000:]
    last = 3 if overlap else 2  # the last iteration whose forward ran on finite weights and logged
    assert f"iter {last:>5}/" in proc.stdout and f"iter {last + 1:>5}/" not in proc.stdout, proc.stdout[-2000:]
    assert time.monotonic() - start < 120
