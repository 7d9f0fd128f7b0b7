"""Run a Megatron-LM training script with fp4_dist as the backend of its ``--fp4-param-gather``.

    torchrun --nproc-per-node 8 -m fp4_dist.megatron.run pretrain_gpt.py <Megatron arguments> --fp4-param-gather

The script runs unmodified (Megatron-LM's own ``pretrain_gpt.py``, or any script around
``megatron.training.pretrain``); before it starts, this launcher

- finds the job's ranks: torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``), ``mpirun``/``mpiexec``
  (mpi4py), ``srun`` (SLURM's step variables), or none (one rank); Megatron's initialization reads the torchrun
  variables, which it sets for the others;
- installs `fp4_dist.megatron.enable()`: ``--fp4-param-gather`` then means fp4_dist's NVFP4 weights (no
  TransformerEngine; Hopper GPUs and CPU ranks), the linear weights become NVFP4 parameters inside Megatron's own
  build path (after ``.cuda()`` and Float16Module, before DDP), and what fp4_dist does not serve is refused at
  start-up;
- adds the Megatron flags this machine needs that the command line does not give (`defaults.LAUNCHER_DEFAULTS`:
  ``--distributed-backend gloo`` on a machine without CUDA, which then runs Megatron on CPU ranks through fp4_dist's
  CPU layer; ``--transformer-impl local`` without TransformerEngine; the fusions that need apex or Megatron's
  fused kernels off when those are missing; an ``--eval-interval``); each addition is printed with its reason, and
  a value given on the command line wins.

Options before the script path are the launcher's (``--help``); everything after it goes to the script.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback
from typing import Optional, Sequence

from .. import launch
from . import defaults
from ..format import DEFAULT_NUMERICS, NUMERICS

ERROR_GRACE_S = 3.0
# What gloo raises on a rank whose peer's process ended during a collective (its connection closes or resets).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
PEER_LOST_HINT = (" -- a peer rank's process ended while this rank waited on it (killed, out of memory or crashed; the "
                  "launcher's summary names it). Restart with the same command: --load of the --save folder resumes "
                  "from the newest complete checkpoint")
USAGE = "python -m fp4_dist.megatron.run [launcher options] SCRIPT.py [script arguments]"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fp4_dist.megatron.run", usage=USAGE,
        description="Run a Megatron-LM training script (e.g. pretrain_gpt.py) with fp4_dist as the backend of "
                    "--fp4-param-gather: no TransformerEngine, Hopper GPUs and CPU ranks.")  # fmt: skip
    p.add_argument("--check-every", type=int, default=0, metavar="N",
                   help="every N iterations, check on every rank that the gathered NVFP4 weights equal "
                        "quantize(full fp32 master); stop with an error if not (0: off)")
    p.add_argument("--log-json", default=None, metavar="PATH",
                   help="rank 0 writes the run's record here: per-iteration loss and grad norm, checks, and the "
                        "digest of every fp32 master after setup and at the last iteration")
    p.add_argument("--numerics", default=DEFAULT_NUMERICS, choices=NUMERICS,
                   help="NVFP4 block-scale formula (TransformerEngine main, or its v2.14 variant)")
    p.add_argument("--columnwise", action="store_true",
                   help="also build the columnwise NVFP4 copies after every param all-gather, as TransformerEngine "
                        "does (nothing in the compute path reads them)")
    p.add_argument("--no-compute-copy", action="store_true",
                   help="lean: keep no bf16 copy of the NVFP4 weights between updates; each linear dequantizes its "
                        "weight around each use and again in backward (less memory than bf16 weights, same values)")
    p.add_argument("--allow-untested-megatron", action="store_true",
                   help="run with a megatron-core version outside the tested range")
    p.add_argument("script", help="the training script, e.g. Megatron-LM's pretrain_gpt.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (Megatron's)")
    return p


# ---------------------------------------------------------------------------------------------- ranks
def export_rank_environment(environ=os.environ) -> str:
    """Set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` from whatever launched this
    process, the way torchrun would; returns the launcher's name. Raises RuntimeError for a launch it cannot
    serve (every rank raises alike: each reads its own environment)."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
        if missing:
            raise RuntimeError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: set them, or launch "
                               "with torchrun")
        environ.setdefault("LOCAL_RANK", "0")
        return "torchrun"
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
        return _export_slurm(environ)
    if launch.launched_by() == "mpi":
        launch.export_mpi_env()  # raises with the remedy when mpi4py is missing
        return "mpi"
    environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", str(launch._free_port()))
    return "single"


def _export_slurm(environ) -> str:
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))
    nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    if "MASTER_ADDR" not in environ:
        if nodes > 1:
            raise RuntimeError(
                f"srun started {tasks} tasks on {nodes} nodes but MASTER_ADDR is not set: export it to the first "
                "node's address before srun (e.g. MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
                "head -n 1)), and MASTER_PORT to a free port")
        environ["MASTER_ADDR"] = "127.0.0.1"
    # Every task derives the same port from the job and step, so no task has to tell the others.
    environ.setdefault("MASTER_PORT", str(20000 + (int(environ.get("SLURM_JOB_ID", "0")) * 7
                                                   + int(environ["SLURM_STEP_ID"] or 0)) % 30000))  # fmt: skip
    environ.update(RANK=environ["SLURM_PROCID"], WORLD_SIZE=str(tasks),
                   LOCAL_RANK=environ.get("SLURM_LOCALID", "0"))  # fmt: skip
    return "srun"


# --------------------------------------------------------------------------------------- script arguments
def refuse_launch(script_args: Sequence[str]) -> None:
    """What this launcher refuses whatever the run: the checkpoint worker Megatron spawns for --async-save is a
    fresh interpreter that fp4_dist's set-up (the adapter, the Python 3.11 shim, the CPU layer) never reaches."""
    if "--async-save" in defaults.given(script_args):
        raise RuntimeError("fp4_dist.megatron.run: --async-save is not supported: Megatron's checkpoint worker "
                           "process starts without fp4_dist. Drop it (saves then block the step while they write)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except Exception as e:
        # One line per rank naming it: what stopped the job is read on every rank alike. A refusal or failed check
        # (raised by fp4_dist itself, or Megatron's own argument checks) is that line and nothing more; anything
        # else also prints its traceback, which a bug report needs. A short grace before exiting: a launcher stops
        # every rank once one exits, and a peer refusing the same run a moment later should still get its line in;
        # not when a peer's process is gone (nothing is coming from it, and the others lost it too).
        lost = peer_lost(e)
        print(f"fp4_dist.megatron.run: rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}"
              + (PEER_LOST_HINT if lost else ""), file=sys.stderr, flush=True)  # fmt: skip
        if not deliberate(e):
            traceback.print_exc()
        if not lost:
            time.sleep(ERROR_GRACE_S)
        return 1


def peer_lost(error: BaseException) -> bool:
    """Whether `error` is gloo's account of a peer rank whose process is gone."""
    return isinstance(error, RuntimeError) and any(m in str(error) for m in PEER_LOST)


def deliberate(error: BaseException) -> bool:
    """Whether `error` is a message meant for the user: raised by fp4_dist's own code (a refusal, a failed parity or
    non-finite check), or an assertion of Megatron's argument and config validation."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    where = frames[-1].filename.replace(os.sep, "/")
    if isinstance(error, AssertionError):  # megatron.training's argument checks and the configs' own
        return where.endswith(("megatron/training/arguments.py", "megatron/training/argument_utils.py",
                               "_config.py")) and "/megatron/" in where  # fmt: skip
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/")
    return where.startswith(package + "/")


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = _parser().parse_args(argv)
    script = opts.script
    if not os.path.isfile(script):
        raise SystemExit(f"fp4_dist.megatron.run: no such script: {script}\nusage: {USAGE}")
    launcher = export_rank_environment()
    rank0 = os.environ["RANK"] == "0"
    refuse_launch(opts.script_args)
    machine = defaults.probe()
    missing = defaults.missing(opts.script_args, machine)
    added = defaults.as_arguments(missing)
    if rank0:
        print(f"fp4_dist.megatron.run: {script} on {os.environ['WORLD_SIZE']} rank(s) ({launcher}, "
              f"{'CUDA' if machine.cuda else 'CPU'})", flush=True)
        for d in missing:
            print(f"fp4_dist.megatron.run: added {' '.join((d.flag, *d.values))} ({d.why})", flush=True)

    from . import adapter, enable

    adapter.python_311_shim()
    # The script's own folder first on the path, as `python script.py` would have it (pretrain_gpt.py imports
    # gpt_builders and model_provider from beside it).
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    enable(allow_untested_version=opts.allow_untested_megatron, columnwise=opts.columnwise,
           numerics=opts.numerics, compute_copy=not opts.no_compute_copy, check_every=opts.check_every,
           log_json=opts.log_json)  # fmt: skip
    sys.argv = [script, *opts.script_args, *added]
    runpy.run_path(script, run_name="__main__")
    launch.shutdown()  # not after an error: its barrier would wait for ranks that may never come
    return 0


if __name__ == "__main__":
    sys.exit(main())
