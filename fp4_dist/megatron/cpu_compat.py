"""Run Megatron-Core's real DDP / DistributedOptimizer / GPTModel code on CPU ranks (gloo).

Megatron-Core 0.19.2 assumes CUDA in a handful of places on the path we use (facts checked by running,
file:line of megatron-core 0.19.2, as the project's megatron-core reference notes list them in their section 4):

- buffers and flags are allocated with ``device=torch.cuda.current_device()`` or ``device='cuda'``
  (param_and_grad_buffer.py:1180-1186, optimizer.py:690-702, clip_grads.py:96-231, utils.py:1332);
- grad sync reads ``torch.cuda.current_stream()`` (param_and_grad_buffer.py:632);
- the optimizers classify params by ``param.type() == 'torch.cuda.BFloat16Tensor'``
  (distrib_optimizer.py:401,466,758; optimizer.py:1009,1028);
- the tensor-parallel RNG tracker seeds, saves and restores CUDA RNG states (tensor_parallel/random.py
  :303-306, 490).
- ``megatron.core.jit.jit_fuser`` is ``torch.compile``: on a CPU rank the first call of each fused function
  compiles C++ (about 30 s per process on 2 cores), which dwarfs a small run.
- On gloo, ``all_gather_into_tensor`` calls of different dtypes coalesced under
  ``torch.distributed._coalescing_manager`` return wrong bytes (torch 2.13), and Megatron coalesces the
  uint8 NVFP4 bucket with the bf16 bucket in one bucket group.

This module answers each of those with the smallest CPU stand-in: ``cuda`` devices map to ``cpu`` inside a
``TorchFunctionMode``; CPU tensors report ``torch.cuda.*`` type strings; streams are no-ops; the CUDA RNG
API is backed by a private CPU generator (seeded, saved and restored like the CUDA one; CPU ops keep
drawing from the CPU default generator); TorchDynamo is disabled so fused functions run eagerly; and
:class:`GlooCoalescing` replaces the coalescing manager with one
that issues each collective on its own (still asynchronous when Megatron asks for it) and waits for all.

Only :mod:`fp4_dist.megatron.adapter` installs it, and only when the run has no CUDA device. Nothing here
imports megatron: the adapter owns every Megatron patch, this module owns the torch-level ones.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable", "disable", "is_enabled", "GlooCoalescing"]


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is done when the call that queued it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is ordered by program order already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NullEvent:
        return _NullEvent()  # the MoE all-to-all dispatcher synchronizes on it

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Maps ``device='cuda'`` (or a CUDA index) to CPU and makes CPU tensors report CUDA type strings.

    The type string is what Megatron's optimizers branch on; only the no-argument ``Tensor.type()`` is
    rewritten, so ``t.type(torch.float32)`` conversions are untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return func(*args, **kwargs)


def _cuda_api_stand_ins() -> dict[tuple[Any, str], Any]:
    """Replacements keyed by (module, name): streams no-op, the CUDA RNG API backed by a private CPU
    generator (Megatron's RNG tracker only saves, seeds and restores it; CPU ops draw from the CPU
    default generator, which this leaves alone)."""
    fake_cuda_generator = torch.Generator()

    def seed(s: int) -> None:
        fake_cuda_generator.manual_seed(int(s))

    get_state = lambda *a, **k: fake_cuda_generator.get_state()  # noqa: E731
    set_state = lambda state, *a, **k: fake_cuda_generator.set_state(state)  # noqa: E731
    cuda, cuda_random = torch.cuda, torch.cuda.random
    return {
        (cuda, "current_device"): lambda: torch.device("cpu"),
        # megatron.training's initialize sets up its model-parallel groups and seeds its RNG tracker only when it
        # counts a device; the one "device" is the CPU, which set_device has nothing to select on.
        (cuda, "device_count"): lambda: 1,
        (cuda, "set_device"): lambda *a, **k: None,
        (cuda, "current_stream"): lambda *a, **k: _NullStream(),
        (cuda, "default_stream"): lambda *a, **k: _NullStream(),
        (cuda, "Stream"): _NullStream,
        (cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
        (cuda, "synchronize"): lambda *a, **k: None,
        (cuda, "empty_cache"): lambda *a, **k: None,
        (cuda, "manual_seed"): seed,
        (cuda, "manual_seed_all"): seed,
        (cuda, "get_rng_state"): get_state,
        (cuda, "set_rng_state"): set_state,
        (cuda_random, "get_rng_state"): get_state,
        (cuda_random, "set_rng_state"): set_state,
    }


_lock = threading.Lock()
_saved: dict[tuple[Any, str], Any] | None = None
_mode: _CudaToCpuMode | None = None
_dynamo_disable: bool | None = None
_compile: Any = None  # torch.compile while `_compile_eagerly` stands in for it


def _compile_eagerly(model=None, **kwargs):
    """torch.compile on CPU ranks: the function or module itself, run eagerly.

    Megatron's fused kernels are torch.compile'd at import (``megatron.core.jit.jit_fuser``); on CPU ranks they run
    eagerly, as they do under ``torch._dynamo.config.disable``, without importing dynamo and inductor first (about
    two seconds of CPU time per rank at start-up)."""
    return model if model is not None else (lambda fn: fn)

_RNG_LOGGER = "megatron.core.tensor_parallel.random"


class _ExpectedOnCpu(logging.Filter):
    """Megatron warns when dropout inside its "GPU" RNG fork consumed CPU randomness; on CPU it always does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_rng_filter = _ExpectedOnCpu()


def is_enabled() -> bool:
    return _saved is not None


def enable() -> None:
    """Install the CPU stand-ins (idempotent). Raises if CUDA is available: there they would hide GPUs."""
    global _saved, _mode
    with _lock:
        if _saved is not None:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "fp4_dist.megatron.cpu_compat is for CPU-only runs, but CUDA is available; "
                "run on the GPUs (NCCL) instead."
            )
        stand_ins = _cuda_api_stand_ins()
        _saved = {key: getattr(*key) for key in stand_ins}
        for (module, name), fn in stand_ins.items():
            setattr(module, name, fn)
        _mode = _CudaToCpuMode()
        _mode.__enter__()
        global _dynamo_disable, _compile
        if "torch._dynamo" in sys.modules:  # compiled functions may exist already: they run eagerly from now on
            from torch import _dynamo

            _dynamo_disable = _dynamo.config.disable
            _dynamo.config.disable = True
        else:
            _compile, torch.compile = torch.compile, _compile_eagerly
        logging.getLogger(_RNG_LOGGER).addFilter(_rng_filter)


def disable() -> None:
    """Undo :func:`enable` (idempotent)."""
    global _saved, _mode
    with _lock:
        if _saved is None:
            return
        assert _mode is not None, "cpu_compat: mode missing while enabled"
        _mode.__exit__(None, None, None)
        for (module, name), fn in _saved.items():
            setattr(module, name, fn)
        global _dynamo_disable, _compile
        if _compile is not None:
            torch.compile, _compile = _compile, None
        if _dynamo_disable is not None:
            from torch import _dynamo

            _dynamo.config.disable, _dynamo_disable = _dynamo_disable, None
        logging.getLogger(_RNG_LOGGER).removeFilter(_rng_filter)
        _saved, _mode = None, None


class GlooCoalescing:
    """Replacement for ``torch.distributed._coalescing_manager`` plus the collectives issued under it.

    Gloo mis-handles coalesced all-gathers of mixed dtypes, so each collective runs on its own; when
    Megatron asked for ``async_ops`` the returned object's ``wait()`` waits for all of them, which keeps
    the overlap code paths (handles waited on in the forward pre-hook / finish_grad_sync) exercised.

    ``manager`` replaces ``param_and_grad_buffer._coalescing_manager``; ``wrap(fn)`` replaces
    ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` so their work handles reach the manager.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def manager(self, group=None, device=None, async_ops: bool = False):
        handle = _WorkList(async_ops)
        outer = getattr(self._local, "active", None)
        self._local.active = handle
        try:
            yield handle
        finally:
            self._local.active = outer

    def wrap(self, fn: Callable) -> Callable:
        def collective(*args: Any, **kwargs: Any):
            work = fn(*args, **kwargs)
            active = getattr(self._local, "active", None)
            if active is not None and work is not None:
                active.works.append(work)
            return work

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        return collective


class _WorkList:
    def __init__(self, async_ops: bool) -> None:
        self.async_ops = async_ops
        self.works: list[Any] = []

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


def make_host_copy(original):
    """Megatron's MoE all-to-all dispatcher copies its split sizes to the host as numpy arrays
    (``maybe_move_tensor_to_cpu(..., as_numpy=True)``), which ``all_to_all_single`` takes as sequences of ints; the
    helper copies only CUDA tensors, so on a CPU rank the sizes stay tensors, which it refuses. Host tensors become
    numpy arrays the same way."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu
