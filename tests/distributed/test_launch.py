"""Launch the distributed suites with torchrun (gloo, CPU) for world sizes 1, 2, 3, 4, 6, and once with mpirun.

One launch per world size runs every suite (run_suite.py); the tests below read its JSON report. The claims:
partial cast + byte all-gather == quantize(full bf16 master) on every rank; the same bytes for every world
size and launcher; bad input raises on every rank with no weight touched; ZeRO-1 training with the NVFP4
param gather has the single-process loss bit for bit, with a measured collective count per step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import forked_ranks
from .shared import once_per_session

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "run_suite.py"
WORLD_SIZES = [1, 2, 3, 4, 6]
TIMEOUT_S = 300

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def megatron_env() -> dict:
    """`_env()` for Megatron's CPU ranks (also on a GPU machine), with transformers left off their path. Megatron
    imports it for a HuggingFace tokenizer and goes on without it; the test runs use NullTokenizer, and the import
    costs every rank about a CPU-second (its package scan), a sixth of a small run's start-up on the 2-core test
    machine."""
    env = _env()
    hidden = REPO / "tests" / "distributed" / "without_transformers"
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(cmd: list, out: Path) -> dict:
    proc = forked_ranks.run(cmd, env=_env(), timeout=TIMEOUT_S)
    report = json.loads(out.read_text()) if out.exists() else {}
    report["returncode"] = proc.returncode
    report["log"] = (proc.stdout + proc.stderr)[-6000:]
    return report


@once_per_session
def torchrun_report(world_size: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"fp4_dist_ws{world_size}_")) / "report.json"
    # Training parity is asked for world sizes 1-4; at 6 ranks on 2 cores it would only cost CI time.
    suites = "cast,bad_input" if world_size > 4 else "cast,bad_input,train"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           str(SCRIPT), "--backend", "gloo", "--suites", suites, "--out", str(out)]
    return _run(cmd, out)


def _mpirun():
    # Prefer the mpirun installed next to this Python (the MPI that mpi4py was built against).
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


@once_per_session
def mpirun_report() -> dict:
    out = Path(tempfile.mkdtemp(prefix="fp4_dist_mpi_")) / "report.json"
    cmd = [_mpirun(), "-n", "2", sys.executable, str(SCRIPT), "--backend", "gloo", "--suites", "cast,bad_input",
           "--out", str(out)]
    return _run(cmd, out)


def suite_failures(report: dict, suite: str) -> list:
    assert report.get("suites"), f"launch produced no report (exit {report['returncode']}):\n{report['log']}"
    return [f for f in report["failures"] if f.startswith(f"[{suite}]")]


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"ws{n}")
def test_gathered_nvfp4_bytes_equal_quantize_of_full_bf16_master(world_size):
    report = torchrun_report(world_size)
    assert not suite_failures(report, "cast"), "\n".join(suite_failures(report, "cast")[:20])
    assert report["suites"]["cast"]["cases"] >= 17


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"ws{n}")
def test_bad_input_raises_on_every_rank_and_leaves_weights_untouched(world_size):
    report = torchrun_report(world_size)
    assert not suite_failures(report, "bad_input"), "\n".join(suite_failures(report, "bad_input"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda n: f"ws{n}")
def test_zero1_training_loss_is_bitwise_equal_to_single_process_quantize_each_step(world_size):
    report = torchrun_report(world_size)
    assert not suite_failures(report, "train"), "\n".join(suite_failures(report, "train")[:20])
    train = report["suites"]["train"]["ordered"]
    assert train["steps"] >= 50
    calls = train["collectives_per_step"]
    if world_size > 1:
        assert calls["all_reduce"] == 2, calls  # the gradient check and the cast's amaxes
        # one all-gather per bucket, plus one of the compact NVFP4 tile scales
        assert calls["all_to_all_single"] + 1 == calls["all_gather_single"] >= 3, calls


def test_every_world_size_gathers_the_same_bytes():
    digests = {ws: torchrun_report(ws)["suites"]["cast"]["digests"] for ws in WORLD_SIZES}
    first = digests[WORLD_SIZES[0]]
    for ws, d in digests.items():
        assert d == first, f"world size {ws} gathered other bytes than world size {WORLD_SIZES[0]}"


def test_all_launches_exit_cleanly():
    for ws in WORLD_SIZES:
        report = torchrun_report(ws)
        assert report["returncode"] == 0 and not report["failures"], (
            f"world size {ws}: exit {report['returncode']}, failures {report.get('failures')}\n{report['log']}")


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not installed")
def test_mpirun_bootstrap_runs_the_cast_suites_with_the_same_bytes():
    pytest.importorskip("mpi4py")
    report = mpirun_report()
    assert report.get("launcher") == "mpi", report["log"]
    assert report["returncode"] == 0 and not report["failures"], report["log"]
    assert report["suites"]["cast"]["digests"] == torchrun_report(2)["suites"]["cast"]["digests"]


_RENDEZVOUS = """
import os, torch, torch.distributed as dist
from fp4_dist.launch import init_distributed, shutdown
info = init_distributed("gloo")
total = torch.tensor([info.rank + 1.0])
dist.all_reduce(total)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # under its PrefixStores
    store = store.underlying_store
print(f"rank {info.rank}: {info.launcher} {total.item()} port {os.environ['MASTER_PORT']} store {store.port}", flush=True)
shutdown()
"""


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not installed")
@pytest.mark.parametrize("port", [None, "29617"], ids=["port-of-the-systems-choice", "master-port-given"])
def test_under_mpirun_rank_0_opens_the_store_it_names_or_the_given_port(port):
    # With no MASTER_PORT, rank 0 opens the rendezvous store on a port the system picks and keeps it (a port found
    # free and bound later can be taken in between); a given MASTER_PORT is used as torchrun's ranks would.
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if port:
        env["MASTER_PORT"] = port
    proc = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-c", _RENDEZVOUS], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (found in the text, not by line: the ranks share the pipe and one's line may run into the other's)
    ranks = re.findall(r"rank (\d): (\w+) ([\d.]+) port (\d+) store (\d+)", proc.stdout)
    assert sorted(r[0] for r in ranks) == ["0", "1"] and all(r[1:3] == ("mpi", "3.0") for r in ranks), proc.stdout
    ports = {r[3] for r in ranks} | {r[4] for r in ranks}
    assert len(ports) == 1 and (port is None or ports == {port}), ranks


_HELD_PORT = """
import os, socket, torch, torch.distributed as dist
from fp4_dist import launch
from fp4_dist.megatron.run import export_rank_environment
launcher = export_rank_environment()
with socket.socket() as s:  # another process of the host asking for MASTER_PORT before the job binds it
    try:
        s.bind(("", int(os.environ["MASTER_PORT"])))
        port = "free"
    except OSError:
        port = "held"
dist.init_process_group("gloo")  # env://, as Megatron's initialize_megatron starts it
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(f"rank {dist.get_rank()}: {launcher} {total.item()} {port}", flush=True)
launch.shutdown()
"""


@pytest.mark.parametrize("launcher", ["single", "mpi"])
def test_the_megatron_launcher_holds_the_port_it_names_until_the_job_binds_it(launcher):
    # A port found free and released would be open to any process of the host until Megatron's env:// rendezvous
    # binds it; the launcher keeps the store on it instead, and every rank's env:// connects to that store.
    if launcher == "mpi" and (_mpirun() is None or importlib.util.find_spec("mpi4py") is None):
        pytest.skip("mpirun or mpi4py not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-c", _HELD_PORT]
    if launcher == "mpi":
        cmd = [_mpirun(), "-n", "2", *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = re.findall(r"rank (\d): (\w+) ([\d.]+) (free|held)", proc.stdout)
    expect = [("0", launcher, "1.0", "held")] if launcher == "single" else [
        ("0", "mpi", "3.0", "held"), ("1", "mpi", "3.0", "held")]  # fmt: skip
    assert sorted(ranks) == expect, proc.stdout


# The FP8 and nvfp4 compute modes change what the GEMMs read, never the NVFP4 bytes: their runs (Zero1Optimizer)
# pass the same parity check.
@pytest.mark.parametrize("compute", ["bf16", "fp8", "nvfp4"])
def test_train_lm_example_runs_on_two_ranks_and_passes_its_parity_check(tmp_path, compute):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "examples.train_lm", "--steps", "6", "--dim", "32", "--hidden", "64", "--seq", "32",
           "--backend", "gloo", "--no-progress", "--fp4-compute", compute]  # fmt: skip
    proc = forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "PASS (bit-identical)" in proc.stdout and "bf16 gather" in proc.stdout, log[-4000:]
    assert f"GEMMs in {compute}" in proc.stdout, log[-4000:]
    assert ("FP8 copies of the NVFP4 weights" in proc.stdout) == (compute == "fp8"), log[-4000:]
    if compute == "nvfp4":  # the recipe's first and last linears keep bf16
        assert "NVFP4 compute: 7 linears, 2 with NVFP4 weights in bf16" in proc.stdout, log[-4000:]


def test_the_main_job_resumes_from_its_newest_complete_checkpoint_bit_for_bit(tmp_path):
    # Its run lost everything when a rank died: it had no checkpoints. A run stopped after step 3 (its step-6 save
    # removed, as if killed before it) and started again equals the run that never stopped.
    def train(name: str, *extra: str) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "examples.train_lm", "--steps", "6", "--dim", "32", "--hidden", "64", "--seq", "32", "--backend",
               "gloo", "--no-progress", *extra]  # fmt: skip
        proc = forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)
        assert proc.returncode == 0 and "PASS (bit-identical)" in proc.stdout, (name, proc.stdout + proc.stderr[-3000:])
        return proc.stdout

    def ending(out: str) -> list[str]:  # the last loss, the validation loss and the sample
        line = next(ln for ln in out.splitlines() if ln.startswith("trained "))
        return [line.split(" -> ")[1], next(ln for ln in out.splitlines() if ln.startswith("sample:"))]

    whole = train("whole")
    ckpt = tmp_path / "ckpt"
    train("first", "--save", str(ckpt), "--save-every", "3")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000006"]
    shutil.rmtree(ckpt / "step_00000006")
    resumed = train("resumed", "--save", str(ckpt), "--save-every", "3")
    assert "resumed from" in resumed and "step 3 of 6" in resumed and "trained 3 steps" in resumed, resumed[-2000:]
    assert ending(resumed) == ending(whole), (ending(resumed), ending(whole))
    # a folder copied under a later step's name would resume at that step with the state of step 3
    shutil.copytree(ckpt / "step_00000003", tmp_path / "copied" / "step_00000005")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "examples.train_lm", "--steps", "6", "--dim", "32", "--hidden", "64", "--seq", "32", "--backend", "gloo",
           "--no-progress", "--save", str(tmp_path / "copied")]  # fmt: skip
    proc = forked_ranks.run(cmd, env=_env(), cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode != 0 and "holds the optimizer state of step 3, not 5" in proc.stdout + proc.stderr


def _train_sh(*options: str) -> subprocess.CompletedProcess:
    if not (REPO / ".venv" / "bin" / "python").exists():
        pytest.skip("scripts/train.sh runs in the .venv that scripts/bootstrap.sh makes "
                    "(bash scripts/test.sh makes it)")
    return subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), *options], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip


def test_a_mistyped_train_sh_option_gives_one_usage_error_and_no_traceback():
    proc = _train_sh("--steps", "6", "--stpes", "5")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-4000:]
    assert log.count("usage: train.sh") == 1, log[-4000:]
    assert log.count("train.sh: error: unrecognized arguments: --stpes 5") == 1, log[-4000:]
    assert "Traceback" not in log and "torch.distributed" not in log, log[-4000:]  # no rank was started


def test_train_sh_help_lists_the_options_once():
    proc = _train_sh("--help")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("usage: train.sh") == 1 and "--bucket-numel" in proc.stdout, proc.stdout[-4000:]


# A process that builds its first torch optimizer after the group exists (as every training script does), then
# calls fp4_dist.launch.shutdown(): the group must be freed there, not during interpreter finalization, where
# gloo aborted 2 launches in 50 at 4 ranks under load ("terminate called without an active exception").
_FREED = """
import sys
import torch
import torch.distributed as dist
import fp4_dist
from fp4_dist.launch import init_distributed, shutdown

init_distributed("gloo")
pg = dist.group.WORLD
torch.optim.Adam([torch.nn.Parameter(torch.ones(4))])
dist.all_reduce(torch.ones(4))
shutdown()
sys.stdout.write(f"REFS {sys.getrefcount(pg) - 2}\\n")  # one write: the two ranks share torchrun's stdout
sys.stdout.flush()
"""


def test_shutdown_frees_the_process_group_after_torch_optim_imported_its_lazy_modules(tmp_path):
    script = tmp_path / "freed.py"
    script.write_text(_FREED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(cmd, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    refs = [line for line in proc.stdout.splitlines() if line.startswith("REFS")]
    assert refs == ["REFS 0", "REFS 0"], f"references to the destroyed default group left: {refs}\n{log[-3000:]}"
