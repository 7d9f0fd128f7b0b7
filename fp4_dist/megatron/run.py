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
- makes a torchrun rank end when its agent does (`fp4_dist.launch.end_with_launcher`: torchrun starts each rank in
  a session of its own, which a kill of the launcher's process group does not reach);
- makes megatron-core's checkpoint code end a run it stops (a checkpoint it refuses) with exit status 1 and one line
  per rank naming what it refused, not upstream's status 0;
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
import re
import runpy
import sys
import time
import traceback
import warnings
from typing import Optional, Sequence

from .. import launch
from . import defaults
from .options import AdapterOptions

# Seconds a failed rank waits before it exits (main's grace); FP4_DIST_ERROR_GRACE_S sets another, e.g. 0 under a
# launcher that waits for every rank's own exit anyway (torchrun --monitor-interval longer than a refusal takes).
ERROR_GRACE_S = 3.0
# What gloo raises on a rank whose peer's process ended during a collective (its connection closes or resets).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
PEER_LOST_HINT = (" -- a peer rank's process ended while this rank waited on it (killed, out of memory or crashed; the "
                  "launcher's summary names it). Restart with the same command: --load of the --save folder resumes "
                  "from the newest complete checkpoint")
# Megatron's distributed optimizer, loading a checkpoint whose parameter buffers are laid out otherwise.
LAYOUT_CHANGED = "Number of unpadded elements must be same in current run"
LAYOUT_HINT = (" -- the checkpoint's parameter buffers differ from this run's: a checkpoint saved with "
               "--fp4-param-gather (its NVFP4 weights in a uint8 buffer of their own) loads only into a run with it, "
               "and one saved without it only into a run without it; the model's sizes and "
               "--first-last-layers-bf16 must match too")
USAGE = "python -m fp4_dist.megatron.run [launcher options] SCRIPT.py [script arguments]"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fp4_dist.megatron.run", usage=USAGE,
        description="Run a Megatron-LM training script (e.g. pretrain_gpt.py) with fp4_dist as the backend of "
                    "--fp4-param-gather: no TransformerEngine, Hopper GPUs and CPU ranks.")  # fmt: skip
    AdapterOptions.add_arguments(p)
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
    if "MASTER_PORT" not in environ:
        environ["MASTER_PORT"] = str(launch.hold_rendezvous_store(environ["MASTER_ADDR"], environ))
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
FALLBACK_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                     "Only transformer-engine>=")  # fmt: skip
"""What megatron-core warns on import, once per module and rank, when TransformerEngine or Apex is missing."""


def quiet_fallback_warnings(machine: defaults.Machine, rank0: bool) -> None:
    """Say once for the job what a machine without TransformerEngine or Apex means for the run, in place of
    Megatron's import-time warnings of it (a dozen per rank). A user who asks to see warnings (``-W`` or
    ``PYTHONWARNINGS`` with an action other than ``ignore``) sees them all."""
    missing = [name for name, have in (("TransformerEngine", machine.te), ("Apex", machine.apex)) if not have]
    asked = [*sys.warnoptions, *filter(None, os.environ.get("PYTHONWARNINGS", "").split(","))]
    if not missing or any(not option.strip().startswith("ignore") for option in asked):
        return
    for text in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=UserWarning)
    if rank0:
        print(f"fp4_dist.megatron.run: no {' and no '.join(missing)} here: Megatron runs its torch fallbacks (norms, "
              "multi-tensor ops, optimizer; the numerics of its fallbacks, some ops slower). Its import-time warnings "
              "about it are not repeated (PYTHONWARNINGS=default shows them)", flush=True)


def usage_error(message: str) -> None:
    """Stop with exit status 2, the message printed once for the job (rank 0: every rank finds the same)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def refuse_launch(script: str, script_args: Sequence[str]) -> None:
    """What this launcher refuses whatever the run: its own options written after the script (Megatron's parser would
    print its whole usage without a word about them); --async-save, whose checkpoint worker Megatron spawns as a
    fresh interpreter that fp4_dist's set-up (the adapter, the Python 3.11 shim, the CPU layer) never reaches."""
    ours = AdapterOptions.all_flags() & defaults.given(script_args)
    if ours:
        flags = " ".join(sorted(ours))
        usage_error(f"fp4_dist.megatron.run: {flags} {'is an option' if len(ours) == 1 else 'are options'} of the "
                    f"launcher, not of {os.path.basename(script)}: write {'it' if len(ours) == 1 else 'them'} before "
                    f"the script, e.g. python -m fp4_dist.megatron.run {flags} ... {script} ...\nusage: {USAGE}")
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
        text = describe(e)
        print(f"fp4_dist.megatron.run: rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {text}"
              f"{hint(text, lost)}", file=sys.stderr, flush=True)  # fmt: skip
        if not deliberate(e):
            traceback.print_exc()
        if not lost:
            time.sleep(float(os.environ.get("FP4_DIST_ERROR_GRACE_S", ERROR_GRACE_S)))
        return 1


def hint(text: str, lost: bool) -> str:
    """What the error line adds to an upstream message whose cause it does not name."""
    return PEER_LOST_HINT if lost else LAYOUT_HINT if LAYOUT_CHANGED in text else ""


def describe(error: BaseException) -> str:
    """The error's message; for an assertion without one (most of Megatron's argument checks), the failing line and
    where it is, so that the user sees which condition the run broke."""
    text = str(error)
    if text or not isinstance(error, AssertionError):
        return text
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "(an assertion without a message)"
    where = frames[-1]
    path = where.filename.replace(os.sep, "/")
    return f"{where.line} ({path[path.find('megatron/'):] if 'megatron/' in path else path}:{where.lineno})"


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
    launch.end_with_launcher()  # a rank whose torchrun is killed (with its process group) ends instead of training on
    opts = _parser().parse_args(argv)
    script = opts.script
    if not os.path.isfile(script):
        raise SystemExit(f"fp4_dist.megatron.run: no such script: {script}\nusage: {USAGE}")
    launcher = export_rank_environment()
    rank0 = os.environ["RANK"] == "0"
    refuse_launch(script, opts.script_args)
    machine = defaults.probe()
    missing = defaults.missing(opts.script_args, machine)
    added = defaults.as_arguments(missing)
    if rank0:
        print(f"fp4_dist.megatron.run: {script} on {os.environ['WORLD_SIZE']} rank(s) ({launcher}, "
              f"{'CUDA' if machine.cuda else 'CPU'})", flush=True)
        for d in missing:
            print(f"fp4_dist.megatron.run: added {' '.join((d.flag, *d.values))} ({d.why})", flush=True)

    quiet_fallback_warnings(machine, rank0)
    from . import adapter, checkpoint, enable

    adapter.python_311_shim()
    spawned_processes_get_the_shim(script)
    # The script's own folder first on the path, as `python script.py` would have it (pretrain_gpt.py imports
    # gpt_builders and model_provider from beside it).
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    enable(options=AdapterOptions.from_args(opts))
    checkpoint.failing_checkpoint_exits()
    checkpoint.atomic_tracker_file()
    sys.argv = [script, *opts.script_args, *added]
    runpy.run_path(script, run_name="__main__")
    launch.shutdown()  # not after an error: its barrier would wait for ranks that may never come
    return 0


def spawned_processes_get_the_shim(script: str) -> None:
    """On Python 3.11, make a process that multiprocessing spawns from this rank run `fp4_dist.megatron.spawned` as
    its main, which provides ``typing.override`` before running `script` as upstream's child would (the child would
    otherwise import megatron.training through the script and fail: Megatron's default checkpoint format spawns one
    at the first save)."""
    if sys.version_info >= (3, 12):
        return
    import multiprocessing.spawn as spawn

    from . import spawned

    path = os.path.normpath(os.path.abspath(script))
    os.environ[spawned.SCRIPT] = path
    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if data.get("init_main_from_path") == path:
            del data["init_main_from_path"]
            data["init_main_from_name"] = "fp4_dist.megatron.spawned"
        return data

    spawn.get_preparation_data = get_preparation_data


if __name__ == "__main__":
    sys.exit(main())
