"""What the device did during traced steps, from torch.profiler's events (one summary for every bench that asks).

    summary = summarize(prof.events(), steps)
    summary.busy_ms      GPU busy time per step: the union of kernel and copy intervals (streams may overlap)
    summary.kernels      {kernel: GPU ms per step}
    summary.calls        {CUDA runtime/driver call on the host: calls per step}
    summary.gaps         {(kernel before, kernel after): GPU idle ms per step}
    counting_waits(...)  the calls that make the host wait for the GPU, by caller (torch's sync debug mode)

Trace the device only (`ProfilerActivity.CUDA`): the host then runs at nearly its own speed, so the idle gaps
are those of an untraced run.
"""

from __future__ import annotations

import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch


class DeviceSummary(NamedTuple):
    kernels: dict
    calls: dict
    busy_ms: float
    gaps: dict
    steps: int


def short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def summarize(events, steps: int) -> DeviceSummary:
    kernels, calls, intervals = {}, {}, []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:  # host-side records: CUDA runtime/driver calls
            calls[e.name] = calls.get(e.name, 0) + 1 / steps
        # GPU-side user annotations (ProfilerStep#, Optimizer.step#...) span whole phases: not device work.
        elif not getattr(e, "is_user_annotation", False) and not e.name.startswith("ProfilerStep"):
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / steps
            intervals.append((e.time_range.start, e.time_range.end, e.name))
    busy, end, last, gaps = 0.0, float("-inf"), None, {}
    for a, b, name in sorted(intervals):
        if last is not None and a > end:
            key = (short(last, 60), short(name, 60))
            gaps[key] = gaps.get(key, 0.0) + (a - end) / 1e3 / steps
        if b > end:
            busy += b - max(a, end)
            end, last = b, name
    return DeviceSummary(kernels, calls, busy / 1e3 / steps, gaps, steps)


def launches(summary: DeviceSummary) -> float:
    """Kernel launches per step the host made (runtime and driver launch calls)."""
    return sum(v for k, v in summary.calls.items() if "LaunchKernel" in k or "cuLaunch" in k)


def collective_kind(name: str):
    """"all-gather", "reduce-scatter", "all-reduce" for an NCCL kernel, else None."""
    if not name.startswith("ncclDevKernel") and not name.startswith("ncclKernel"):
        return None
    for key, kind in (("AllGather", "all-gather"), ("ReduceScatter", "reduce-scatter"), ("AllReduce", "all-reduce"),
                      ("SendRecv", "send/recv")):
        if key in name:
            return kind
    return "other"


def exposed_collectives(events, steps: int) -> dict:
    """{collective kind: (device ms per step, exposed ms per step)}: exposed is the part of the collective's
    kernels during which no other kernel runs (a collective overlapped with compute costs the step nothing;
    NCCL's kernels also spin while they wait for the slowest rank, and that waiting shows here too)."""
    comm, work = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith("ProfilerStep"):
            continue
        kind = collective_kind(e.name)
        (comm if kind else work).append((e.time_range.start, e.time_range.end, kind))
    merged = []  # the union of the other kernels' intervals
    for a, b, _ in sorted(work):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    import bisect

    starts = [m[0] for m in merged]
    out: dict = {}
    for a, b, kind in comm:
        covered, i = 0.0, max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(merged) and merged[i][0] < b:
            covered += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
            i += 1
        total, exposed = out.get(kind, (0.0, 0.0))
        out[kind] = (total + (b - a) / 1e3 / steps, exposed + (b - a - covered) / 1e3 / steps)
    return out


@contextmanager
def counting_waits(where: dict, steps: int):
    """Inside the block, every call that makes the host wait for the GPU adds 1/`steps` to `where[caller]`, the
    caller being the innermost frames outside torch; counting starts when the caller turns torch's sync debug
    mode to "warn" (each such call then warns) and ends with the block, which turns it off. Other warnings pass
    through."""
    pass_on = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return pass_on(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "site-packages/torch/" not in f.filename and "warnings" not in f.filename]
        key = " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in frames[-4:][::-1])
        where[key] = where.get(key, 0) + 1 / steps

    try:
        with warnings.catch_warnings():  # restores showwarning and the filters
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
