"""What fp4_dist watches inside ``megatron.training``'s own loop: the parity check and the run record.

Two adapter rows hand Megatron's ``setup_model_and_optimizer`` and ``train_step`` to `Monitor`, which checks the
weights after setup in every ``--fp4-param-gather`` run and does the rest when the run asks
(`AdapterOptions.check_every`, `AdapterOptions.log_json`; the launcher's ``--check-every`` and ``--log-json``):

- after setup (always, in a run with ``--fp4-param-gather``: a start-up cost) and every N iterations, on every rank,
  the gathered NVFP4 weights are compared with ``quantize(full fp32 master)`` (`parity.check_nvfp4_weights`, after
  a forced param sync so that an overlapped all-gather has landed); a mismatch on any rank stops the run with an
  error on every rank, naming the weights, before a step trains on them;
- rank 0 writes a JSON record after setup and after every iteration: the NVFP4 weights of each rank, the digest of
  every full fp32 master after setup (a fresh run's equals a bf16 run's init; a resumed run's equals the saved masters), each iteration's
  loss, grad norm and check (with the check's wall time, `check_ms`), and the masters' digest at the last
  iteration.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint import atomic
from ..compute.pool import audit_uses, audit_verdicts
from ..tensor import is_nvfp4_tensor
from ..tensor.copy import weight_name
from . import parity
from .buffers import resolve_cast_checks_before_a_step
from .options import current_options
from .parallel import collective_device


class Monitor:
    """State of one run: the model and optimizer Megatron built, and the record so far."""

    def __init__(self) -> None:
        self.model: Optional[list] = None
        self.optimizer: Any = None
        self.record: dict[str, Any] = {"iterations": []}
        self.audited: tuple = (0, [])  # the lean uses of the last step, audited when a check follows it

    def reset(self) -> None:
        self.__init__()

    # -------------------------------------------------------------------------------------- the two rows
    def wrap_setup(self, original):
        def setup_model_and_optimizer(*args, **kwargs):
            out = original(*args, **kwargs)
            model, optimizer = out[0], out[1]
            self.model, self.optimizer = (model if isinstance(model, list) else [model]), optimizer
            options = current_options()
            if optimizer is None:
                return out
            from megatron.training.global_vars import get_args

            if getattr(get_args(), "fp4_param_gather", False):  # the weights set up (converted, or loaded)
                self.record["check_after_setup"] = self.check(0)
            if options.log_json:
                mine = sum(is_nvfp4_tensor(p) for m in self.model for p in m.parameters())
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                self.record["nvfp4_weights"], self.record["nvfp4_weights_per_rank"] = mine, every
                self.record["master_digest_after_setup"] = self.master_digest()
                self._write(options.log_json)
            return out

        return setup_model_and_optimizer

    def wrap_train_step(self, original):
        def train_step(*args, **kwargs):
            resolve_cast_checks_before_a_step()  # before a full-iteration graph replays a step's processing
            options = current_options()
            if not (options.check_every or options.log_json) or self.optimizer is None:
                return original(*args, **kwargs)
            from megatron.training.global_vars import get_args

            iteration = kwargs.get("iteration")
            iteration = (get_args().curr_iteration if iteration is None else iteration) + 1  # the one this step does
            # A step that a check follows: its lean uses compare what each GEMM reads with the weight's bytes.
            audit_uses(bool(options.check_every and iteration % options.check_every == 0))
            try:
                out = original(*args, **kwargs)
            finally:
                self.audited = audit_verdicts()
            entry: dict[str, Any] = {"iteration": iteration, "loss": _last_stage_loss(out[0]),
                                     "skipped": bool(out[1]), "grad_norm": _float(out[5])}  # fmt: skip
            if options.check_every and iteration % options.check_every == 0:
                start = _synced_clock()
                entry["check"] = self.check(iteration)
                entry["check_ms"] = round(1e3 * (_synced_clock() - start), 3)
            args = get_args()
            exit_interval = getattr(args, "exit_interval", None)  # Megatron stops after such an iteration too
            last = iteration == args.train_iters or bool(exit_interval and iteration % exit_interval == 0)
            if options.log_json:
                self.record["iterations"].append(entry)
                if last:
                    self.record["master_digest_final"] = self.master_digest()
                    self.record["peak_allocated_mib"] = peak_allocated_mib()
                    self.record["peak_reserved_mib"] = peak_allocated_mib(reserved=True)
                self._write(options.log_json)
            return out

        return train_step

    # -------------------------------------------------------------------------------------------- checks
    def check(self, iteration: int) -> str:
        """Parity of every NVFP4 weight on every rank; raises on a mismatch anywhere, else returns a summary."""
        from megatron.training.training import force_param_sync

        force_param_sync(self.model, self.optimizer)  # an overlapped all-gather must have landed
        report = parity.ParityReport()
        uses, stale = self.audited if iteration else (0, [])
        self.audited = (0, [])
        report.mismatches += [f"the lean copy {weight_name(w)} read at a use in iteration {iteration} differs from "
                              "its bytes' dequantization" for w in stale]
        for chunk in self.model:
            part = parity.check_nvfp4_weights(chunk, self.optimizer)
            report.weights += part.weights
            report.bytes_checked += part.bytes_checked
            report.mismatches += part.mismatches
        when = f"iteration {iteration}" if iteration else "after setup"
        if not parity.all_ranks_ok(report):  # over the whole job
            mine = "; ".join(report.mismatches[:3]) or "this rank matched; see the other ranks"
            raise RuntimeError(f"fp4_dist: {when}: the gathered NVFP4 weights differ from quantize(full fp32 master) "
                               f"on some rank (rank {dist.get_rank()}: {mine})")
        summary = f"ok ({report.weights} weights, {report.bytes_checked} bytes on rank {dist.get_rank()}"
        summary += f", {uses} lean uses)" if uses else ")"
        if dist.get_rank() == 0:
            print(f"fp4_dist: {when}: gathered NVFP4 weights == quantize(master) on every rank: {summary}", flush=True)
        return summary

    def master_digest(self) -> str:
        """sha256 over the full fp32 masters of every model-parallel slice (a collective over the whole job): the
        same for the same masters at any data-parallel size."""
        from megatron.core import parallel_state

        # Dense weights are whole on each data-parallel group's rank 0 (one per tensor and pipeline rank), MoE experts
        # on each expert-data-parallel group's rank 0 (one per expert-parallel rank too).
        dense = "".join(parity.master_digest(chunk, self.optimizer, experts=False) for chunk in self.model)
        experts = "".join(parity.master_digest(chunk, self.optimizer, experts=True) for chunk in self.model)
        mine = (parallel_state.get_data_parallel_rank(), parallel_state.get_expert_data_parallel_rank(), dense, experts)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        text = "".join(d for dp, _, d, _ in every if dp == 0) + "".join(e for _, edp, _, e in every if edp == 0)
        return hashlib.sha256(text.encode()).hexdigest()

    def _write(self, path: str) -> None:
        if dist.get_rank() != 0:
            return
        atomic.write_file_atomically(path, json.dumps(self.record, indent=1))


def _synced_clock() -> float:
    """Seconds, once the device is idle: a check's time is its own, not the tail of the step before it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_allocated_mib(reserved: bool = False) -> Optional[float]:
    """The most memory torch's allocator held on any rank's GPU so far, in MiB (a collective over the whole job),
    allocated to tensors or (`reserved`) reserved from the device, CUDA graphs' private pools included; None on
    CPU ranks."""
    if not torch.cuda.is_available():
        return None
    most = torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()
    peak = torch.tensor([float(most)], device=collective_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak) / 2**20


def _float(x) -> Optional[float]:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _last_stage_loss(loss_dict) -> Optional[float]:
    """The iteration's loss as the last pipeline stage computed it, on every rank (a collective over the pipeline
    group when there are several stages: only the last holds the loss)."""
    from megatron.core import parallel_state

    loss = _loss(loss_dict)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return loss
    value = torch.tensor([float("nan") if loss is None else loss], dtype=torch.float64, device=collective_device())
    dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())  # fmt: skip
    return None if value.isnan().item() else float(value.item())


def _loss(loss_dict) -> Optional[float]:
    if not loss_dict:
        return None
    value = loss_dict.get("lm loss", next(iter(loss_dict.values())))
    if isinstance(value, torch.Tensor) and value.numel() == 2:  # (sum, tokens) as Megatron's loss_func reports
        return float(value[0] / value[1])
    return _float(value)


MONITOR = Monitor()
