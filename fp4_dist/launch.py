"""Start torch.distributed from whatever launched this process: torchrun, mpirun/mpiexec, or nothing.

* torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``):
  ``env://`` initialisation.
* mpirun / mpiexec (MPICH, Open MPI, Intel MPI, Slurm PMI): rank and world size come from
  ``MPI.COMM_WORLD`` (mpi4py), the local rank from a shared-memory split of it, and rank 0
  opens the rendezvous store on a port the system picks and broadcasts it with its address
  (``MASTER_ADDR``/``MASTER_PORT`` win when set).
* neither: a single process; nothing is initialised and fp4_dist's collectives are local copies.

Backend: NCCL when CUDA is available, else gloo (override with ``backend=``). `end_with_launcher` makes a torchrun
rank end with its agent (a kill of the launcher's process group does not reach ranks in sessions of their own).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose. Its functions take ``group=group.WORLD`` as a default
# argument, which Python evaluates once, at import. torch imports it lazily (the first torch.optim optimizer
# imports torch._dynamo, which imports FSDP, which imports it); imported after init_process_group, those ten
# defaults hold the default group, destroy_process_group cannot free it, and its gloo worker threads live into
# interpreter finalization, where a worker releasing a finished collective's tensors needs the GIL and the rank
# aborts ("terminate called without an active exception", 2 in 50 launches at 4 ranks under load).
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: E402,F401

# Variables an MPI launcher sets in every rank's environment (MPICH/Hydra, Open MPI, Intel MPI, Slurm PMI).
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID", "PMIX_RANK")


__all__ = ["init_distributed", "shutdown", "DistInfo", "launched_by", "launch_rank", "export_mpi_env",
           "hold_rendezvous_store", "end_with_launcher", "watch_launcher"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]
    """"gloo", "nccl", or None for a single process without torch.distributed."""
    device: torch.device
    """cuda:<local_rank> under NCCL, else cpu."""
    launcher: str
    """"torchrun", "mpi" or "single"."""


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(backend: Optional[str], local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launched_by() -> str:
    """Which launcher started this process: "torchrun", "mpi" or "single"."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if any(k in os.environ for k in _MPI_ENV):
        return "mpi"
    return "single"


def launch_rank() -> int:
    """This process's rank as its launcher gave it, before any process group exists (0 in a single process): for
    what one rank should say for all, such as a mistyped command line every rank parses alike."""
    for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        v = os.environ.get(k, "")
        if v.isdigit():
            return int(v)
    return 0


def init_distributed(backend: Optional[str] = None, *, timeout_s: float = 300.0) -> DistInfo:
    """Initialise the default process group from the launcher's environment (idempotent).

    Args:
        backend: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo.
        timeout_s: collective timeout.
    Returns:
        `DistInfo` of this process.
    """
    launcher = launched_by()
    if dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        be = dist.get_backend()
        return DistInfo(dist.get_rank(), dist.get_world_size(), local, be, _device_for(be, local), launcher)
    if launcher == "single":
        return DistInfo(0, 1, 0, None, _device_for("nccl" if torch.cuda.is_available() else None, 0), "single")
    backend = backend or _default_backend()
    timeout = timedelta(seconds=timeout_s)
    if launcher == "torchrun":
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = _device_for(backend, local)
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        return DistInfo(dist.get_rank(), dist.get_world_size(), local, backend, device, launcher)
    return _init_from_mpi(backend, timeout)


# ------------------------------------------------------------------------------------------ the launcher's end
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_followed: Optional[int] = None  # the launcher's pid this rank ends with, once end_with_launcher armed it


def end_with_launcher(poll_s: float = 1.0) -> bool:
    """Make this rank end (SIGKILL) when the torchrun agent that started it ends, however the agent ends; returns
    whether it did (False: not a torchrun rank). Idempotent; call it first thing in a rank.

    torchrun starts every rank in a session of its own, so a signal to the launcher's process group (what
    ``timeout -s KILL``, a job system or the OOM killer sends) never reaches the ranks: they trained on as orphans,
    saving into the folder a restarted job resumes from. On Linux the kernel sends the rank SIGKILL when its parent
    (the agent; it starts every rank from its main thread) ends (``PR_SET_PDEATHSIG``); elsewhere a daemon thread
    looks at the parent every `poll_s` seconds (`watch_launcher`). SIGKILL, not SIGTERM: with the launcher gone
    nobody collects the rank's work or stops its peers, and a handler's last save (Megatron's
    ``--exit-signal-handler``) would need peers that are being killed too; every save is committed whole, so a kill
    mid-save loses only that save. Ranks of other launchers are left alone: mpirun's and srun's own daemons end
    their ranks, and a process started from a shell should outlive that shell when the user says so (nohup).
    """
    global _followed
    if _followed is not None:
        return True
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # set by torchrun's agent for each rank
        return False
    parent = os.getppid()
    if not _parent_death_signal(signal.SIGKILL):
        watch_launcher(parent, poll_s)
    if os.getppid() != parent:  # the agent ended before the signal was armed: no signal will come
        _end_orphan(parent)
    _followed = parent
    return True


def watch_launcher(launcher: int, poll_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that kills this process once its parent is no longer `launcher` (the launcher ended
    and the process was handed to init or a subreaper): `end_with_launcher` where ``prctl`` is not available."""

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_s)
        _end_orphan(launcher)

    thread = threading.Thread(target=watch, name="fp4_dist-launcher-watch", daemon=True)
    thread.start()
    return thread


def _parent_death_signal(sig: signal.Signals) -> bool:
    """Ask Linux to send this process `sig` when its parent ends; whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_orphan(launcher: int) -> None:
    print(f"fp4_dist: rank {os.environ.get('RANK', '?')}: its launcher (pid {launcher}) is gone; this rank ends "
          "(SIGKILL) rather than train on unwatched", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to "True", ``env://`` rendezvous connects every rank to a store server that is already running, rank 0
included, as torchrun's workers connect to their agent's (torch.distributed.rendezvous reads it)."""

_held_stores: list = []  # the rendezvous servers this process keeps for its lifetime (see hold_rendezvous_store)


def _open_store_server(addr: str, timeout: timedelta) -> "dist.TCPStore":
    return dist.TCPStore(addr, 0, None, True, timeout=timeout, wait_for_workers=False)


def hold_rendezvous_store(addr: str, environ=os.environ, timeout_s: float = 1800.0) -> int:
    """Start the job's rendezvous store server in this process on a port the system picks, keep it until the process
    ends, set ``environ[AGENT_STORE] = "True"`` and return the port, for ``MASTER_PORT``.

    Code that initialises the process group later with ``env://`` (Megatron's, a user's) then connects to this server
    as a client on every rank. A port found free and bound later could be taken in between by another process of the
    host (two jobs started together, a test run beside a training run); this one is never released. Other ranks set
    the same variable (`export_mpi_env` does)."""
    store = _open_store_server(addr, timedelta(seconds=timeout_s))
    _held_stores.append(store)
    environ[AGENT_STORE] = "True"
    return store.port


def _this_host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def export_mpi_env() -> bool:
    """Under an MPI launcher, set what torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) from ``MPI.COMM_WORLD``, so code that reads them (Megatron's) sees one job of N ranks.

    Returns whether it did (False when not launched by MPI or the variables are set already). Raises RuntimeError
    with the remedy when MPI launched this process but mpi4py is missing (each process would otherwise run as a
    separate one-rank job). Unless ``MASTER_PORT`` is set, rank 0 starts the rendezvous store on a port the system
    picks and keeps it (`hold_rendezvous_store`), and every rank's ``env://`` rendezvous connects to it as a client
    (``TORCHELASTIC_USE_AGENT_STORE=True``), so nothing can take the port between here and ``init_process_group``.
    """
    if launched_by() != "mpi":
        return False
    if _mpi_rendezvous(hold_rendezvous_store):
        os.environ[AGENT_STORE] = "True"
    return True


def _mpi_rendezvous(open_port) -> bool:
    """Rank 0's address and `open_port(address)` (unless ``MASTER_PORT`` is set) broadcast over ``MPI.COMM_WORLD``,
    and torchrun's variables exported from it; returns, on every rank, whether rank 0 opened the port."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("this process was started by an MPI launcher but mpi4py is not installed, so the ranks "
                           "cannot form one job; `pip install mpi4py` (extra `fp4_dist[mpi]`) or launch with "
                           "torchrun") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    addr = port = opened = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or _this_host_address()
        opened = not os.environ.get("MASTER_PORT")
        port = open_port(addr) if opened else int(os.environ["MASTER_PORT"])
    addr, port, opened = comm.bcast((addr, port, opened), root=0)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(node.Get_rank()),
                      LOCAL_WORLD_SIZE=str(node.Get_size()), MASTER_ADDR=str(addr), MASTER_PORT=str(port))
    return opened


def _init_from_mpi(backend: str, timeout: timedelta) -> DistInfo:
    # Rank 0 opens the rendezvous store itself, on a port the system picks, and keeps it: a port found free and
    # bound later could be taken in between by another process of the host.
    stores = []

    def open_store(addr: str) -> int:
        stores.append(_open_store_server(addr, timeout))
        return stores[0].port

    opened = _mpi_rendezvous(open_store)
    rank, size, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = _device_for(backend, local)
    if opened:
        rendezvous = {"store": stores[0] if stores else dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout=timeout)}
    else:  # MASTER_PORT given by the user: env:// binds it, as torchrun's ranks would
        rendezvous = {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                            device_id=device if backend == "nccl" else None, **rendezvous)
    return DistInfo(rank, size, local, backend, device, "mpi")


def shutdown() -> None:
    """Destroy every process group now, while the interpreter is whole (call it last, on every rank).

    A group that outlives ``destroy_process_group`` (something still references it) is freed during interpreter
    finalization, and gloo can abort the process there (see the import of ``torch.distributed.nn.functional``
    above). So: a barrier (no rank tears down while a peer still talks to it); Megatron's group globals dropped
    when Megatron is loaded; reference cycles that hold a group (models, optimizers) collected; then destroy.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    gc.collect()
    dist.destroy_process_group()
