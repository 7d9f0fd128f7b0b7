"""Checkpoint rows: the distributed optimizer's own checkpoint loads with the torch.optim fallback (no apex/TE),
megatron-core's checkpoint code stopping a run with a failing exit status, and its tracker file written atomically."""

from __future__ import annotations

import io
import os
import sys

import torch

from ..tensor import is_nvfp4_tensor


class CheckpointingStopped(RuntimeError):
    """megatron.training.checkpointing stopped the run with a bare ``sys.exit()`` (exit status 0 upstream)."""


class _FailingExit:
    """Stands for `sys` inside megatron.training.checkpointing: everything is sys's, but a bare ``exit()`` raises
    `CheckpointingStopped` naming what was refused. Upstream ends a run whose checkpoint it refuses (a file torch
    refuses to unpickle, a corrupt one, one without an iteration or RNG state, an unknown checkpoint version, none at
    all with --exit-on-missing-checkpoint) with ``sys.exit()`` after a message on rank 0 only: status 0, which a job
    scheduler or a retry loop reads as success."""

    def __getattr__(self, name):
        return getattr(sys, name)

    @staticmethod
    def exit(status=None):
        if status is None or status == 0:
            raise CheckpointingStopped(f"megatron-core refused to load the checkpoint: {refused(sys._getframe(1))} "
                                       "(exit status 1; upstream's sys.exit() here gives 0)")
        sys.exit(status)


def refused(frame) -> str:
    """What megatron.training.checkpointing refused, read from the frame that calls ``sys.exit()`` (its locals and
    the exception it handles): every rank names it, where upstream prints it on rank 0 only, or not at all."""
    local, error = frame.f_locals, sys.exc_info()[1]
    name = local.get("checkpoint_name")
    if "metastring" in local:
        return (f"the tracker file {local.get('tracker_filename')} holds {local['metastring']!r}, neither an "
                "iteration number nor 'release'")
    if "checkpoint_version" in local:
        return f"checkpoint version {local['checkpoint_version']} is none that Megatron converts (0 or 1.0)"
    if isinstance(error, KeyError) and name is not None:
        if str(error) == "'total_iters'":
            return f"{name} holds no iteration number ('iteration' or 'total_iters')"
        return f"{name} holds no RNG state (--no-load-rng or --finetune load it without one)"
    if error is not None and name is not None:
        return f"{name} could not be read: {_reason(error)}"
    if "tracker_filename" in local:  # --exit-on-missing-checkpoint, and no tracker file
        return (f"--exit-on-missing-checkpoint, and {local['tracker_filename']} does not exist (no checkpoint "
                "under --load)")
    where = frame.f_code.co_filename.replace(os.sep, "/")
    return f"see its message above ({frame.f_code.co_name}, {where[where.rfind('megatron/'):]}:{frame.f_lineno})"


def _reason(error: BaseException) -> str:
    """torch.load's reason in one line: the weights-only unpickler's own sentence (the class outside the allow-list,
    the opcode it does not take) without the paragraph of advice around it; else the error's first line."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text[text.index(marker) + len(marker):].strip()
        reason = text.split(". ")[0].split("\n")[0].strip()
        if reason.startswith("Unsupported global"):
            reason += (" (outside megatron.core.safe_globals.SAFE_GLOBALS and "
                       "fp4_dist.checkpoint.safe_load.NVFP4_GLOBALS)")
        return f"{type(error).__name__}: {reason}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def failing_checkpoint_exits() -> None:
    """Make megatron-core's checkpoint code end a run it stops with exit status 1 instead of 0 (idempotent)."""
    from megatron.training import checkpointing

    if not isinstance(checkpointing.sys, _FailingExit):
        checkpointing.sys = _FailingExit()

class _AtomicTracker:
    """Stands for `maybe_msc` inside megatron.training.checkpointing: everything is its own, but opening the tracker
    file (latest_checkpointed_iteration.txt) for writing gives a buffer committed on close by
    `fp4_dist.checkpoint.atomic.write_file_atomically` (temporary file, fsync, rename, fsync of the folder). Upstream
    truncates and rewrites it in place, unflushed: a kill between the two leaves it empty, and the loss of the
    machine can leave it naming an iteration whose files never reached the disk."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open(self, path, mode="r", *args, **kwargs):
        from megatron.core.msc_utils import MultiStorageClientFeature

        if "w" in mode and os.path.basename(str(path)) == TRACKER and not MultiStorageClientFeature.is_enabled():
            return _CommittedOnClose(str(path))
        return self._inner.open(path, mode, *args, **kwargs)


TRACKER = "latest_checkpointed_iteration.txt"


class _CommittedOnClose(io.StringIO):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def close(self):
        if not self.closed:
            from ..checkpoint import atomic

            text = self.getvalue()
            super().close()
            atomic.write_file_atomically(self.path, text)


def atomic_tracker_file() -> None:
    """Make megatron-core's checkpoint code write its tracker file atomically and flushed (idempotent)."""
    from megatron.training import checkpointing

    if not isinstance(checkpointing.maybe_msc, _AtomicTracker):
        checkpointing.maybe_msc = _AtomicTracker(checkpointing.maybe_msc)


def make_set_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # With the torch.optim fallback (no TE / apex), Adam's state holds a "step" tensor that the dp_zero
        # checkpoint does not carry (load_state_dict restores it); upstream then raises KeyError('step').
        # Keys the checkpoint lacks keep their current value.
        current = self._get_main_param_and_optimizer_states(model_param)
        missing = {k: v for k, v in current.items() if k not in tensors}
        return original(self, model_param, {**tensors, **missing} if missing else tensors)

    return _set_main_param_and_optimizer_states


def make_load_state_dict(original):
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        # With the torch.optim fallback, upstream hands every param's state the *same* "step" tensor
        # (DO 1024-1031); torch's Adam increments steps in place, so one step would advance it once per
        # param and resumed runs diverge. Each state gets its own copy.
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()

    return load_state_dict



def make_reload_model_params(original):
    def reload_model_params(self, state_dict=None):
        original(self, state_dict=state_dict)
        # A load without the optimizer state (--finetune, --no-load-optim) rebuilds the fp32 masters from the loaded
        # weights. Their bytes are then cast again from those masters and gathered, as after any step: the values
        # stay, and a -0 code of the loaded bytes reads +0 (the spec's zero), so the weights are quantize(master)
        # again, which the after-setup check and every later cast assume.
        if any(is_nvfp4_tensor(p) for g in self.model_float16_groups for p in g):
            self._copy_main_params_to_model_params()
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

    return reload_model_params
