"""The one way the benches time GPU work (CUDA events around the work on the current stream; wall clock on CPU), and
keep their tables.

    median_ms(fn, reps)    median device milliseconds of fn() over reps runs, after warm-ups
    copy_bandwidth()       the GPU's device-to-device copy bandwidth, GB/s (read + write)
    Span                   device time between two points of a step (start(), stop(), ms())
    publish(text, ...)     print a table, and keep it with its numbers under --out
    SLOW_LINK              the NCCL environment of the benches' slow-link mode (no NVLink, shared memory or
                           InfiniBand: NCCL over sockets, a proxy for data parallelism across nodes)
    require_gpu(script, what)  stop a GPU-only bench on a machine without CUDA, saying so
    timed(seconds, calls, label, fn)   fn, its host wall time and calls added up under `label`
    patched(targets, seconds, calls)   functions and properties replaced by their `timed` form inside a block
    max_over_ranks(values)  each value's maximum over the job's ranks (peak memory per rank, say)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed as dist


SLOW_LINK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def require_gpu(script: str, what: str) -> None:
    """Stop with a sentence (exit status 1) when no CUDA device is here: `script` measures `what` on a GPU only."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: measures {what} on a CUDA GPU, and this machine has none (torch sees no CUDA "
                         "device); run it on a GPU machine (README, 'GPU tests and benchmarks')")


def timed(seconds: dict, calls: dict, label: str, fn, per_op: bool = False):
    """`fn`, adding its host wall time to `seconds[label]` and counting its calls in `calls` (by op for a
    ``__torch_dispatch__``: `per_op`)."""

    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t
            key = f"{label} {a[1]}" if per_op else label  # dispatch(cls, func, ...): count by op
            calls[key] = calls.get(key, 0) + 1
    return run


@contextmanager
def patched(targets, seconds: dict, calls: dict):
    """Inside the block each (owner, attribute name, label) of `targets` is its `timed` form (a property's getter
    timed, as a property); the originals come back after. Wrapped, not mocked: the real call runs."""
    saved = []
    try:
        for owner, name, label in targets:
            real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if isinstance(real, property):
                setattr(owner, name, property(timed(seconds, calls, label, real.fget), doc=real.__doc__))
            else:
                setattr(owner, name, timed(seconds, calls, label, real))
            saved.append((owner, name, real))
        yield
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


class Span:
    """Device milliseconds between `start()` and `stop()` on the current stream: CUDA events recorded at both
    points, read by `ms()` (which waits for the second). On CPU, the wall time between the calls."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.t0 = self.t1 = 0.0

    def start(self) -> "Span":
        if self.cuda:
            self.e0, self.e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.e0.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def stop(self) -> "Span":
        if self.cuda:
            self.e1.record()
        else:
            self.t1 = time.perf_counter()
        return self

    def ms(self) -> float:
        if self.cuda:
            self.e1.synchronize()
            return self.e0.elapsed_time(self.e1)
        return 1e3 * (self.t1 - self.t0)


def median_ms(fn: Callable[[], object], reps: int, *, warmup: int = 3,
              before: Optional[Callable[[], object]] = None) -> float:  # fmt: skip
    """Median device milliseconds of `fn()` over `reps` runs after `warmup` untimed ones; `before()` (an L2 flush,
    say) runs untimed before each timed run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        span = Span().start()
        fn()
        times.append(span.stop().ms())
    return statistics.median(times)


def bandwidth(fn: Callable[[], object], nbytes: int, reps: int, copy_gbs: float) -> dict:
    """{ms, gbs, pct_copy} of `fn()`: its median device milliseconds (`median_ms`), the GB/s of the `nbytes` it
    must move, and those in % of the device copy's `copy_gbs` (`copy_bandwidth`)."""
    ms = median_ms(fn, reps)
    gbs = nbytes / ms / 1e6
    return dict(ms=ms, gbs=gbs, pct_copy=100.0 * gbs / copy_gbs)


def host_ms(fn: Callable[[], object], reps: int) -> float:
    """Median host milliseconds of a `fn()` call, the device idle before each (so a call never waits on the last)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s (read + write) of a device-to-device copy of `nbytes` on the current GPU: the ceiling the benches'
    bandwidths are given against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src), 20) / 1e6


def publish(text: str, out: Optional[str], stem: str, data: dict) -> None:
    """Print a bench's table and, with `out`, keep it as OUT/STEM.md beside its numbers as OUT/STEM.json."""
    print(text, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump(data, f, indent=1)


def max_over_ranks(values: list[float]) -> list[float]:
    """Each of `values` (this rank's) maximised over the ranks of the default process group; the values themselves
    without one. The collective's tensor sits where NCCL needs it (the current GPU) or, without CUDA, on the host."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
