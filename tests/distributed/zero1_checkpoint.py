"""Zero1Optimizer checkpoints through torch.distributed.checkpoint across world sizes (a plain script).

    torchrun --nproc_per_node N zero1_checkpoint.py --mode save --dir CKPT --out save.json
    torchrun --nproc_per_node M zero1_checkpoint.py --mode load --dir CKPT --out load.json

save: a small model with NVFP4 and dense parameters trains 3 ZeRO-1 steps (Adam) and saves with ``dcp.save`` of
the optimizer itself (the Stateful protocol). load: a fresh model and optimizer (another seed, another bucket
size, any world size) load it with `load_checkpoint`. Both write digests of every parameter's full fp32 master
and full Adam state (assembled from all ranks: each rank's piece scattered into zeros and summed, exact) and of
the NVFP4 weights' bytes, so the test compares save against load bit for bit; load also checks on every rank
that the weights equal quantize(full master) and that one more step runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fp4_dist  # noqa: E402
from fp4_dist.launch import init_distributed, shutdown  # noqa: E402
from fp4_dist.optim import Zero1Config, Zero1Optimizer  # noqa: E402
from fp4_dist.optim.zero1_state import load_checkpoint  # noqa: E402


def build(seed: int, bucket_numel: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 64, bias=False), nn.LayerNorm(64),
                          nn.Linear(64, 40))  # fmt: skip
    init = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), lambda g: torch.optim.Adam(g, lr=1e-2, foreach=False),
                         master_init=init, config=Zero1Config(bucket_numel=bucket_numel))  # fmt: skip
    return model, opt


def train(model, opt, steps: int, rank: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 48, generator=g).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_state(opt) -> dict:
    """name -> full tensor of every master and per-element Adam state, and Adam's steps; identical on all ranks."""
    out = {f"master.{i}": m.reshape(-1) for i, m in enumerate(opt.full_masters())}
    for i, p in enumerate(opt.params):
        piece = opt._master_pieces.get(i)
        st = opt.optimizer.state.get(piece, {}) if piece is not None else {}
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(p.numel(), dtype=torch.float32)
            if key in st:
                start = next(s.buf.pieces[j].span.start for s in opt._sections for j, k in enumerate(s.indices)
                             if k == i)  # fmt: skip
                full[start:start + piece.numel()] = st[key]
            dist.all_reduce(full)  # x + 0 is exact: the full tensor, bit for bit
            out[f"{key}.{i}"] = full
        step = torch.tensor([float(st["step"]) if "step" in st else -1.0])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        out[f"step.{i}"] = step
    return out


def digests(opt) -> dict:
    d = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
         for k, v in full_state(opt).items()}  # fmt: skip
    for j, w in enumerate(opt.nvfp4_params):
        d[f"nvfp4.{j}"] = hashlib.sha256(w.rowwise_data.contiguous().numpy().tobytes()).hexdigest()[:16]
    return d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    info = init_distributed("gloo")
    failures = []
    if args.mode == "save":
        model, opt = build(seed=0, bucket_numel=3000)
        train(model, opt, 3, info.rank)
        import torch.distributed.checkpoint as dcp

        dcp.save({"optimizer": opt}, checkpoint_id=args.dir)
        report = {"world_size": info.world_size, "digests": digests(opt)}
    else:
        model, opt = build(seed=7, bucket_numel=5000)
        load_checkpoint(opt, args.dir)
        report = {"world_size": info.world_size, "digests": digests(opt)}
        for w, m in zip(opt.params, opt.full_masters()):
            if fp4_dist.is_nvfp4_tensor(w):
                ref = fp4_dist.quantize(m.to(torch.bfloat16))
                if not torch.equal(w.rowwise_data, ref.rowwise_data) or not torch.equal(w.amax, ref.amax):
                    failures.append(f"rank {info.rank}: weight {list(w.shape)} != quantize(full master) after load")
        train(model, opt, 1, info.rank)  # the loaded optimizer steps
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, failures)
    report["failures"] = [f for per in everyone for f in per]
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    shutdown()
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
