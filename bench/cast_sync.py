"""Cost of the one device-to-host read in `cast_master_weights_to_nvfp4` (the non-finite / error-flag check).

    python bench/cast_sync.py [--device cuda] [--hidden 2048 --layers 24] [--ws-shard 2]

Times the whole cast call (one process, no collective) over the linear weights of a GPT-like model, each rank's
shard = 1/ws of every weight, call by call in the same run: as shipped (one scalar read per call) and with the check
replaced by a no-op (what a sync-free cast would cost). The difference is the price of the read. Host time per
call and device time (CUDA events) are both reported; median of `--iters` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp4_dist.cast import master_weights as cast_mod
from fp4_dist.tensor import NVFP4Tensor


def gpt_linear_shapes(hidden: int, layers: int, ffn_mult: int = 4):
    per_layer = [(3 * hidden, hidden), (hidden, hidden), (ffn_mult * hidden, hidden), (hidden, ffn_mult * hidden)]
    return per_layer * layers


def setup(shapes, ws: int, device):
    weights, shards, starts = [], [], []
    for m, k in shapes:
        n = m * k
        step = (n // ws) // 64 * 64  # rank 0's piece: an even, aligned start/end
        weights.append(NVFP4Tensor.empty((m, k), device=device))
        shards.append(torch.randn(step, device=device))
        starts.append(0)
    return weights, shards, starts


def time_once(fn, device) -> tuple[float, float]:
    """(host seconds, device seconds or nan) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    if device.type != "cuda":
        return host, float("nan")
    b.record()
    torch.cuda.synchronize()
    return host, a.elapsed_time(b) / 1e3


def no_check(*args, **kwargs):
    return None


def time_both(call, iters: int, device):
    """Median (host, device) with and without the check, interleaved call by call so drift hits both."""
    runs = {True: [], False: []}
    original = cast_mod._raise_if_bad
    try:
        for _ in range(iters):
            for checked in (True, False):
                cast_mod._raise_if_bad = original if checked else no_check
                runs[checked].append(time_once(call, device))
    finally:
        cast_mod._raise_if_bad = original
    med = lambda xs: (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs))  # noqa: E731
    return med(runs[True]), med(runs[False])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ws-shard", type=int, default=2, help="each weight's shard is 1/ws of it")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":  # the reference path is slow: a smaller model still shows the (zero) cost
        args.hidden, args.layers = min(args.hidden, 256), min(args.layers, 2)
    shapes = gpt_linear_shapes(args.hidden, args.layers)
    weights, shards, starts = setup(shapes, args.ws_shard, device)
    call = lambda: cast_mod.cast_master_weights_to_nvfp4(weights, shards, starts)  # noqa: E731
    for _ in range(3):
        call()
    with_check, without = time_both(call, args.iters, device)
    elems = sum(s.numel() for s in shards)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}; {len(shapes)} weights, {elems / 1e6:.1f} M master elements on this rank")
    print(f"{'':24s}{'host ms/call':>14s}{'device ms/call':>16s}")
    print(f"{'with the scalar read':24s}{with_check[0] * 1e3:14.3f}{with_check[1] * 1e3:16.3f}")
    print(f"{'check removed':24s}{without[0] * 1e3:14.3f}{without[1] * 1e3:16.3f}")
    print(f"cost of the read: host {(with_check[0] - without[0]) * 1e3:+.3f} ms, "
          f"device {(with_check[1] - without[1]) * 1e3:+.3f} ms per call")


if __name__ == "__main__":
    main()
