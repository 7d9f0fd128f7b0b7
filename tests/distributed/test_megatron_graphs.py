"""Megatron's own CUDA graphs with --fp4-param-gather, on one GPU: every compute mode trains under
``--cuda-graph-impl local`` (per layer) and ``--cuda-graph-impl full_iteration`` bit for bit as it trains eagerly.

Each run is Megatron's ``pretrain()`` (`examples/pretrain_gpt.py` through ``python -m fp4_dist.megatron.run``) with
several microbatches a step, so that a replayed layer reads its weight's copy after other layers' copies went
through the same pool buffer, and with iterations past the capture, so that a replay reads the copies of weights
that optimizer steps changed since the capture. What is compared, exactly: every iteration's loss and gradient norm,
and the master digest at the end. The parity check runs every iteration (`--check-every 1`) and compares what each
linear's GEMM reads with the gathered bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

from .test_launch import REPO, _env  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]

SCRIPT = REPO / "examples" / "pretrain_gpt.py"
ITERS = 8
# 4 microbatches a step; the graphs are captured after Megatron's warmup steps, and replayed for the rest.
MODEL = ("--num-layers 3 --hidden-size 256 --ffn-hidden-size 768 --num-attention-heads 4 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --lr 2e-3 --bf16 "
         "--use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 512 --split 90,5,5 "
         f"--log-interval 1 --seed 1234 --train-iters {ITERS} --eval-interval 1000 --eval-iters 0 "
         "--no-gradient-accumulation-fusion --hidden-dropout 0 --attention-dropout 0 --num-workers 0 "
         "--no-check-for-nan-in-loss-and-grad --cuda-graph-warmup-steps 2").split()
GRAPHS = {"eager": [], "local": ["--cuda-graph-impl", "local"], "full_iteration": ["--cuda-graph-impl", "full_iteration"]}
MODES = {
    "lean": [],
    "lean_depth2": ["--lean-depth", "2"],
    "kept": ["--compute-copy"],
    "fp8": ["--compute", "fp8"],
    "fp8_no_kept_transpose": ["--compute", "fp8", "--compute-option", "keep_transpose=false"],
}
# The overlapped param gather: under `local` graphs Megatron runs its pre-hooks (the gather's wait and processing)
# eagerly before each layer's replay; a full-iteration graph captures them, gather and processing included.
OVERLAP = ["--overlap-param-gather", "--overlap-grad-reduce"]
SCRIPT_ARGS = {f"{mode}_overlap": OVERLAP for mode in ("lean", "kept", "fp8")}
MODES.update({name: MODES[name.removesuffix("_overlap")] for name in SCRIPT_ARGS})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    from examples.megatron_preprocess import write_indexed

    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    assert write_indexed([str(REPO / "examples" / "data" / "tiny_corpus.txt")], prefix) > 10
    return prefix


def _run(tmp: Path, name: str, runner: list, args: list, check_every: int = 1) -> dict:
    log = tmp / f"{name}.json"
    port = 29500 + (abs(hash(name)) % 2000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master-port", str(port),
           "-m", "fp4_dist.megatron.run", "--check-every", str(check_every), "--log-json", str(log), *runner, str(SCRIPT),
           *MODEL, *args]  # fmt: skip
    env = dict(_env(), CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "distributed" / "without_transformers"),
                                         env["PYTHONPATH"]])
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    record = json.loads(log.read_text()) if log.exists() else {}
    record.update(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    return record


def _trace(record: dict) -> list:
    return [(it["iteration"], it["loss"], it["grad_norm"]) for it in record.get("iterations", [])]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_graph_kind_trains_bit_for_bit_as_eager(tmp_path, data, mode):
    args = ["--data-path", data, "--fp4-param-gather", *SCRIPT_ARGS.get(mode, [])]
    with ThreadPoolExecutor(len(GRAPHS)) as pool:
        runs = dict(zip(GRAPHS, pool.map(lambda g: _run(tmp_path, f"{mode}_{g}", MODES[mode], args + GRAPHS[g]),
                                         GRAPHS)))
    for graph, record in runs.items():
        assert record["returncode"] == 0, f"{mode} {graph}:\n{record['stdout'][-3000:]}\n{record['stderr'][-6000:]}"
        assert len(_trace(record)) == ITERS and all(it["check"].startswith("ok") for it in record["iterations"])
    eager = runs["eager"]
    for graph in ("local", "full_iteration"):
        assert _trace(runs[graph]) == _trace(eager), (mode, graph, _trace(runs[graph]), _trace(eager))
        assert runs[graph]["master_digest_final"] == eager["master_digest_final"], (mode, graph)
    print(f"{mode}: {len(GRAPHS)} graph kinds equal, losses {[round(t[1], 4) for t in _trace(eager)]}")


def test_the_nvfp4_mode_trains_on_a_gpu_with_every_check_passing_and_refuses_graphs(tmp_path, data):
    # 4-bit activations and gradients (emulated GEMMs, CuPy quantizers): eager only; graphs would replay the
    # stochastic rounding's seeds of the capture, so the start-up refuses them on every rank, naming both flags
    args = ["--data-path", data, "--fp4-param-gather"]
    runner = ["--compute", "nvfp4"]
    with ThreadPoolExecutor(2) as pool:
        eager, graphed = pool.map(lambda g: _run(tmp_path, f"nvfp4_{g}", runner, args + GRAPHS[g]),
                                  ("eager", "full_iteration"))
    assert eager["returncode"] == 0, f"{eager['stdout'][-3000:]}\n{eager['stderr'][-6000:]}"
    losses = [t[1] for t in _trace(eager)]
    assert len(losses) == ITERS and all(it["check"].startswith("ok") for it in eager["iterations"])
    assert losses[-1] < losses[0], losses
    assert graphed["returncode"] != 0
    said = graphed["stdout"] + graphed["stderr"]
    assert "--cuda-graph-impl full_iteration and --compute nvfp4" in said and "seeds drawn at capture" in said, \
        said[-3000:]
    print(f"nvfp4 on a GPU: losses {[round(x, 4) for x in losses]}")
