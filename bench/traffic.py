"""Collectives and bytes per step of each public API, on gloo CPU ranks: a table to compare across versions.

    python bench/traffic.py [--world-sizes 2 3] [--json PATH]

For each data-parallel size the script spawns that many gloo ranks, builds one small model with ragged weight
shapes (rows not a multiple of 16, in_features not a multiple of 64, so rank boundaries cut tiles) and counts
every torch.distributed collective of one step, by wrapping (not mocking) torch.distributed's functions:

    te-cast   fp4_dist.cast_master_weights_to_nvfp4 over ZeRO shards (TransformerEngine's signature) and
              post_all_gather_processing (the byte all-gather between them is the caller's)
    zero1     Zero1Optimizer.step() after one backward (gradient reduce-scatter, cast, gathers)
    fsdp2     one forward + backward of a fully_shard_nvfp4 model and the AdamW step

Bytes are those of the largest tensor argument of each call (the all-reduce buffer, the all-gather output, the
reduce-scatter input): the logical message, as fp4_dist.cast.collectives.CommStats counts it.
The amax exchange is reported on its own line (all_reduce): it must stay the boundary-tile exchange for zero1
and the tensor-amax exchange for fsdp2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import warnings
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4_dist  # noqa: E402
from fp4_dist.optim import Zero1Config, Zero1Optimizer  # noqa: E402

NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
         "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_gather", "all_gather_object",
         "broadcast_object_list", "gather_object", "scatter_object_list")  # fmt: skip
"""Each counts once per call, with the bytes of its largest tensor argument (none for the object helpers): the
collectives a call makes inside it are its own."""
CANONICAL = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
SHAPES = [(48, 80), (40, 96), (64, 48), (33, 112), (96, 64)]


def _detail(name: str, values: tuple) -> tuple[str, str, str, str]:
    """(collective, reduce op, dtype, the group's ranks) of one call: what tells a step's collectives apart."""
    op = next((_op_name(v) for v in values if isinstance(v, (dist.ReduceOp.RedOpType, dist.ReduceOp))),
              "SUM" if "reduce" in name else "")
    group = next((v for v in values if isinstance(v, dist.ProcessGroup)), None)
    tensor = next((v for v in values if isinstance(v, torch.Tensor)), None)
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else ""
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return name, op, dtype, ",".join(map(str, ranks))


def _op_name(op) -> str:
    """A reduce op's name; a ReduceOp that carries a factor (NCCL's premul-sum, made per call) is PREMUL_SUM, so that
    its calls share one row."""
    if isinstance(op, dist.ReduceOp.RedOpType):
        return str(op).split(".")[-1]
    return "PREMUL_SUM" if "object at" in str(op) else str(op).split(".")[-1]


def _module_attributes(values: dict):
    """(module, attribute, name) of every module attribute that holds one of `values`' keys (`name` its value)."""
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            try:
                name = values.get(value)
            except Exception:  # an attribute that cannot be hashed or compared
                continue
            if name is not None:
                yield module, attr, name


@contextmanager
def counted(detail: bool = False):
    """Wrap torch.distributed's collectives; yields (calls, bytes) Counters keyed by canonical name, or with
    `detail` by (name, reduce op, dtype, the group's ranks)."""
    calls, nbytes = Counter(), Counter()
    originals = {fn: name for name in NAMES if (fn := getattr(dist, name, None)) is not None}
    # Libraries keep module-level aliases of some (Megatron's buffers call `dist_all_gather_func`, bound at import):
    # every module attribute that is one of these functions is wrapped, and put back after.
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in _module_attributes(originals)]

    # A call inside another (torch's __torch_function__ dispatch looks the function up again; an object helper's own
    # collectives) counts once, per thread: the autograd engine's thread makes a backward's collectives.
    inside = threading.local()

    def wrapped(fn, name):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(inside, "depth", 0):
                return fn(*args, **kwargs)
            key = CANONICAL.get(name, name)
            if detail:
                key = _detail(key, (*args, *kwargs.values()))
            sizes = [t.numel() * t.element_size() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            calls[key] += 1
            nbytes[key] += max(sizes, default=0)
            inside.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside.depth = 0

        return wrapper

    wrappers = {fn: wrapped(fn, name) for fn, name in originals.items()}
    try:
        for module, attr, value in saved:
            setattr(module, attr, wrappers[value])
        yield calls, nbytes
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        # A module imported meanwhile may have bound a wrapper (`from torch.distributed import all_reduce`).
        unwrap = {w: fn for fn, w in wrappers.items()}
        for module, attr, _ in list(_module_attributes(unwrap)):
            setattr(module, attr, unwrap[getattr(module, attr)])


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(k, m, bias=False) for m, k in SHAPES])


def te_cast(rank: int, size: int):
    """ZeRO shards of each weight (even cuts of the flat weight, mid-row and mid-tile), TE's call."""
    weights = [fp4_dist.quantize(torch.randn(m, k, generator=torch.Generator().manual_seed(i)))
               for i, (m, k) in enumerate(SHAPES)]  # fmt: skip
    masters, starts = [], []
    for w in weights:
        full = w.dequantize(torch.float32).reshape(-1) * 1.01
        per = (full.numel() // size) & ~1
        lo, hi = rank * per, (full.numel() if rank == size - 1 else (rank + 1) * per)
        masters.append(full[lo:hi].clone())
        starts.append(lo)
    fp4_dist.cast_master_weights_to_nvfp4(weights, masters, starts)  # bind once (first-call checks)
    with counted() as (calls, nbytes):
        fp4_dist.cast_master_weights_to_nvfp4(weights, masters, starts)
        fp4_dist.post_all_gather_processing(weights)
    return calls, nbytes


def zero1(rank: int, size: int):
    net = model()
    fp4_dist.convert_linear_weights(net, dtype=torch.bfloat16)
    opt = Zero1Optimizer(net.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-3),
                         config=Zero1Config(bucket_numel=6000))  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(8, k, generator=gen, dtype=torch.bfloat16) for _, k in SHAPES]

    # each layer on its own input: the shapes do not chain
    return second_step(lambda: sum(layer(x).float().square().mean() for layer, x in zip(net, xs)), opt)


def fsdp2(rank: int, size: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp4_dist.fsdp import fully_shard_nvfp4

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 96 * size), nn.Linear(96 * size, 64), nn.Linear(64, 32 * size)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                          shard_modules=list(net))  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

    return second_step(lambda: net(x).float().square().mean(), opt)


def second_step(loss, opt):
    """(calls, bytes) of the collectives of a training step after a first one (bindings and buffers built)."""
    def step():
        loss().backward()
        opt.step()
        opt.zero_grad()

    step()
    with counted() as (calls, nbytes):
        step()
    return calls, nbytes


APIS = {"te-cast": te_cast, "zero1": zero1, "fsdp2": fsdp2}


def worker(rank: int, size: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        out = {api: fn(rank, size) for api, fn in APIS.items()}
        if rank == 0:
            queue.put({api: {"calls": dict(c), "bytes": dict(b)} for api, (c, b) in out.items()})
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for i, size in enumerate(args.world_sizes):
        queue = ctx.Queue()
        mp.start_processes(worker, args=(size, 29650 + i, queue), nprocs=size, start_method="spawn", join=True)
        results[size] = queue.get()
    print("| dp | API | collective | calls per step | bytes per step |\n|---|---|---|---|---|")
    for size, per_api in results.items():
        for api, r in per_api.items():
            for name in sorted(r["calls"]):
                print(f"| {size} | {api} | {name} | {r['calls'][name]} | {r['bytes'][name]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
