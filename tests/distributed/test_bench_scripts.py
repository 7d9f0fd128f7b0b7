"""The benchmark scripts still run: each bench that works on CPU ranks runs once with a tiny model and prints its
table (the numbers are not looked at: they are for GPUs), and each GPU-only bench stops on a machine without CUDA
with a sentence saying so. A bench that patches or imports something the package no longer has fails here instead
of on the GPU machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from . import forked_ranks
from .shared import once_per_session
from .test_launch import REPO, megatron_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 240


def _bench(*args: str, ranks: int = 0) -> subprocess.CompletedProcess:
    """`bench/SCRIPT args` on `ranks` gloo CPU ranks under torchrun, or as a plain process (0), CUDA hidden; either
    forked from a process that has imported torch already (tests/distributed/forked_ranks.py)."""
    env = dict(megatron_env(), PYTHONWARNINGS="ignore")
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args]
        return forked_ranks.run(cmd, env=env, timeout=TIMEOUT_S)
    return forked_ranks.run_python([sys.executable, *args], env=env, timeout=TIMEOUT_S)


def _ran(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for text in expected:
        assert text in proc.stdout, f"{text!r} is not in the output:\n{proc.stdout[-3000:]}"


def test_fsdp_bench_times_both_variants_with_its_phases():
    proc = _bench("bench/fsdp.py", "--hidden", "64", "--layers", "1", "--tokens", "64", "--steps", "1", "--rounds",
                  "1", "--phases", ranks=2)  # fmt: skip
    _ran(proc, "| nvfp4 |", "| cast (root pre-forward) |", "| FSDP2 param.init_unsharded_param |")
    memory = _bench("bench/fsdp.py", "--hidden", "64", "--layers", "1", "--tokens", "64", "--steps", "1",
                    "--memory-only", "nvfp4", ranks=2)  # fmt: skip
    _ran(memory, "memory nvfp4: peak allocated")


@pytest.mark.megatron
def test_megatron_benches_run_paired_and_profiled():
    pytest.importorskip("megatron.core")
    paired = _bench("bench/megatron_compare.py", "--tiny", "--paired-only", "fp4,kept,fp8", "--paired-steps", "6",
                    "--phases", "--lean-diagnostic", "timers", ranks=2)  # fmt: skip
    _ran(paired, "kept vs plain bf16, paired", "fp8 vs plain bf16, paired", "(diagnostic) phases, fp4",
         "host in lean forward uses")
    profiled = _bench("bench/megatron_profile.py", "--model", "tiny", "--steps", "8", "--phases", ranks=2)
    _ran(profiled, "| cast (host, launches, its non-finite check) |", "| post-all-gather refresh |")
    memory = _bench("bench/megatron_compare.py", "--tiny", "--memory-only", "fp4", "--steps", "3",
                    "--cast-diagnostic", "noread", ranks=2)  # fmt: skip
    _ran(memory, "memory fp4: peak allocated", "lean pool")
    # the 4-bit parameter gather is a uint8 all-gather that only the NVFP4 model makes
    counted = _bench("bench/megatron_compare.py", "--tiny", "--collectives", "bf16,fp4", "--steps", "4", ranks=2)
    _ran(counted, "| collective | op | dtype | group (ranks) | bf16 | fp4 |",
         "| all_gather_single |  | uint8 | 0,1 | 0, 0 | 1, ")


@pytest.mark.megatron
def test_convergence_runs_resumed_over_two_sittings_equal_one_whole_run(tmp_path):
    # a run longer than a device call's limit: --stop-at checkpoints and stops it, the same command resumes it; the
    # record of both sittings must equal one whole run's, bit for bit, and a third call finds it finished
    pytest.importorskip("megatron.core")
    base = ["bench/convergence.py", "run", "--model", "tiny", "--iters", "6", "--variants", "fp4", "--seeds", "1",
            "--gpus", "0", "--eval-interval", "3", "--log-interval", "1"]  # fmt: skip
    first = _bench(*base, "--out", str(tmp_path / "split"), "--stop-at", "3")
    _ran(first, "stopped at 3", "1 of 1 runs stopped before iteration 6")
    _ran(_bench(*base, "--out", str(tmp_path / "split")), "done in", "every run finished")
    _ran(_bench(*base, "--out", str(tmp_path / "split")), "finished already, not run again: fp4-lr0.0006-s1")
    _ran(_bench(*base, "--out", str(tmp_path / "whole")), "done in")
    split, whole = (json.loads((tmp_path / f / "fp4-lr0.0006-s1.json").read_text()) for f in ("split", "whole"))
    assert [r["iteration"] for r in split["records"]] == list(range(1, 7)) and split["complete"]
    for key in ("validation", "master_digest"):
        assert split[key] == whole[key]
    assert [r["loss"] for r in split["records"]] == [r["loss"] for r in whole["records"]]
    assert not (tmp_path / "split" / "fp4-lr0.0006-s1.earlier.json").exists()
    log = (tmp_path / "split" / "fp4-lr0.0006-s1.log").read_text()  # both sittings' output, the second resumed
    assert re.search(r"resumed from \S+ at iteration 3\n", log)


def test_cpu_benches_print_their_tables():
    _ran(_bench("bench/traffic.py", "--world-sizes", "2"), "| 2 | fsdp2 | all_gather_single |")
    _ran(_bench("bench/projection.py", "--ranks", "8", "64"), "7B-class")
    _ran(_bench("bench/fp8_copy_error.py", "--size", "256"), "| heavy-tailed | [256, 384] |")
    _ran(_bench("bench/fp8_copy_error.py", "--help"), "--safetensors")
    _ran(_bench("bench/host_per_use.py", "--device", "cpu", "--size", "64", "--calls", "20"),
         "| lean: forward + backward |", "a CPU core", "| Megatron path, lean backward's check (Use.refill) |")
    # zero1_stack.py on 2 CPU ranks with a tiny model: the one-node script's zero1 part runs this very command (its
    # CPU=1 arguments), so this reads that part's output instead of running the bench a second time
    _, out, err = one_node_zero1_and_an_unknown_part()
    header, _, zero1 = out.partition("== zero1: ")[2].partition("\n")
    zero1 = zero1.partition("\n== summary")[0]
    assert header.endswith(ZERO1_CPU), (header, ZERO1_CPU)
    assert "FAILED parts: nonsense\n" in out, out[-2000:] + err[-4000:]  # the zero1 part's exit status was 0
    for text in ("Zero1Optimizer (AdamW) on 2 CPU ranks", "\nlean "):
        assert text in zero1, f"{text!r} is not in zero1_stack.py's output:\n{zero1[-3000:]}"


# bench/one_node_gpu.sh's zero1 part under CPU=1: this command line (test_cpu_benches_print_their_tables reads it)
ZERO1_CPU = ("bench/zero1_stack.py --hidden 256 --layers 1 --seq 32 --micro-batch 1 --steps 2 --device cpu --nproc 2 "
             "--rounds 1")


@once_per_session
def one_node_zero1_and_an_unknown_part() -> list:
    """[exit status, stdout, stderr] of ``CPU=1 PARTS="zero1 nonsense" bash bench/one_node_gpu.sh``, run once for the
    two tests that read it."""
    env = dict(os.environ, CPU="1", PARTS="zero1 nonsense", OUT=tempfile.mkdtemp(prefix="fp4_dist_one_node_"))
    proc = subprocess.run(["bash", str(REPO / "bench" / "one_node_gpu.sh")], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=REPO)  # fmt: skip
    return [proc.returncode, proc.stdout, proc.stderr]


def test_the_one_node_table_script_runs_its_parts_and_names_an_unknown_one():
    proc = subprocess.CompletedProcess("one_node_gpu.sh", *one_node_zero1_and_an_unknown_part())
    assert proc.returncode == 1 and "unknown part nonsense" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Zero1Optimizer (AdamW) on 2 CPU ranks" in proc.stdout and "FAILED parts: nonsense" in proc.stdout


def test_docs_fsdp2_quotes_the_projection_it_prints():
    proc = _bench("bench/projection.py")
    _ran(proc, "NVFP4 / bf16 at 64 |")
    ratios = [float(line.split("|")[-2]) for line in proc.stdout.splitlines() if "| nvfp4 |" in line]
    doc = " ".join((REPO / "docs" / "fsdp2.md").read_text().split())
    claim = f"at 64 ranks the NVFP4 step takes {min(ratios):.2f}-{max(ratios):.2f}x bf16's"
    assert len(ratios) == 8 and claim in doc, f"docs/fsdp2.md should say {claim!r} (bench/projection.py: {ratios})"


@pytest.mark.parametrize("script", ["kernels.py", "linear.py", "host_per_use.py", "zero1_stack.py", "lean_l2.py",
                                    "lean_overlap.py", "fp8_linear.py", "fp8_kernels.py", "nvfp4_linear.py"])
def test_gpu_only_benches_say_they_need_a_gpu(script):
    proc = _bench(f"bench/{script}")
    assert proc.returncode != 0
    assert f"bench/{script}: measures" in proc.stderr and "has none" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
