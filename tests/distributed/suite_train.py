"""End-to-end: Zero1Optimizer + NVFP4 param gather == one process quantizing its weights each step, bit for bit.

Distributed: rank r trains TinyLM on micro-batch r of every step; grads are reduced in rank order
(`grad_reduction="ordered"`), Adam steps over the fp32 master shard, the cast + packed all-gather rebuild the
NVFP4 weights. Baseline (in the same process, no collectives): the same model and Adam over full fp32 masters;
each step its linear weights are `fp4_dist.quantize(master.to(bf16))` and its dense params `master.to(bf16)`,
and it accumulates the grads of micro-batches 0..ws-1 in fp32 in rank order (gradient accumulation).
Checked: the loss of this rank's micro-batch is bitwise equal at every step; collectives per step, counted by
wrapping torch.distributed, equal (reduce-scatter + all-gather) per bucket + exactly one all-reduce (tensor and
cut-tile amaxes) + one all-gather of the compact tile scales; the final
weights equal the baseline's bytes. At ws <= 2 the default reduce-scatter path is checked the same way.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

import fp4_dist
from examples.model import TinyLMConfig, build_model
from fp4_dist.cast import CommStats
from fp4_dist.optim.zero1 import Zero1Config, Zero1Optimizer

from _harness import count_collectives

CFG = TinyLMConfig(vocab=40, dim=48, hidden=80, heads=2, layers=2, seq=16)
LR = 3e-3
BATCH = 4


def batch(step: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, CFG.vocab, (BATCH, CFG.seq + 1), generator=g).to(device)


def make_optimizer(groups):
    return torch.optim.Adam(groups, lr=LR, foreach=False)


class Baseline:
    """One process: full fp32 masters, weights re-quantized with `fp4_dist.quantize` every step."""

    def __init__(self, device):
        self.model, init = build_model(CFG, seed=0, device=device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.nvfp4 = {n for n in self.names if n.endswith(".weight") and _is_linear(self.model, n)}
        self.masters = [init[n].clone() for n in self.names]
        self.opt = make_optimizer([{"params": self.masters}])

    def _load_weights(self):
        for name, master in zip(self.names, self.masters):
            module, attr = _owner(self.model, name)
            if name in self.nvfp4:
                setattr(module, attr, nn.Parameter(fp4_dist.quantize(master.to(torch.bfloat16))))
            else:
                getattr(module, attr).data = master.to(torch.bfloat16)

    def step(self, step: int, world_size: int, device) -> list:
        self._load_weights()
        params = [p for _, p in self.model.named_parameters()]
        acc, losses = None, []
        for r in range(world_size):
            loss = self.model.loss(batch(step, r, device))
            grads = torch.autograd.grad(loss, params)
            if acc is None:
                acc = [g.float() for g in grads]
            else:
                for a, g in zip(acc, grads):
                    a.add_(g.float())
            losses.append(loss.detach())
        for m, a in zip(self.masters, acc):
            m.grad = a.div_(world_size) if world_size > 1 else a
        self.opt.step()
        return losses


def _owner(model, name):
    *path, attr = name.split(".")
    module = model
    for p in path:
        module = getattr(module, p)
    return module, attr


def _is_linear(model, name) -> bool:
    return isinstance(_owner(model, name)[0], nn.Linear)


def distributed_model(ctx, grad_reduction: str, stats: CommStats):
    model, init = build_model(CFG, seed=0, device=ctx.device)
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    config = Zero1Config(bucket_numel=6000, grad_reduction=grad_reduction)
    opt = Zero1Optimizer(model.parameters(), make_optimizer, config=config,
                         master_init=[init[n] for n in names], stats=stats)
    return model, opt


def expected_calls(opt, world_size: int, grad_reduction: str) -> Counter:
    if world_size == 1:
        return Counter()
    buckets = sum(len(s.buf.layout.buckets) for s in opt._sections)
    reduce_name = "all_to_all_single" if grad_reduction == "ordered" else "reduce_scatter_single"
    # + 1 all-gather: the compact NVFP4 tile scales (cast/sharded.py); 2 all-reduces: the gradient check
    # (presence and finiteness flags, before the inner step) and the cast's amaxes
    return Counter({reduce_name: buckets, "all_gather_single": buckets + 1, "all_reduce": 2})


def train(ctx, steps: int, grad_reduction: str) -> dict:
    stats = CommStats()
    model, opt = distributed_model(ctx, grad_reduction, stats)
    base = Baseline(ctx.device)
    want_calls = expected_calls(opt, ctx.world_size, grad_reduction)
    mismatched, losses = [], []
    for step in range(steps):
        ref_losses = base.step(step, ctx.world_size, ctx.device)
        with count_collectives() as calls:
            loss = model.loss(batch(step, ctx.rank, ctx.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        ctx.check(calls == want_calls, f"{grad_reduction} step {step}: collectives {dict(calls)}, "
                                       f"expected {dict(want_calls)}")
        if not torch.equal(loss.detach().view(torch.int32), ref_losses[ctx.rank].view(torch.int32)):
            mismatched.append((step, loss.item(), ref_losses[ctx.rank].item()))
        losses.append(loss.item())
    ctx.check(not mismatched, f"{grad_reduction}: loss differs from the single-process baseline at "
                              f"{len(mismatched)}/{steps} steps, first (step, got, want) = {mismatched[:1]}")
    base._load_weights()
    for (name, p), (_, q) in zip(model.named_parameters(), base.model.named_parameters()):
        if fp4_dist.is_nvfp4_tensor(p):
            ctx.same_bytes(p.rowwise_data, q.rowwise_data, f"{grad_reduction} final {name} rowwise_data")
            ctx.same_bytes(p.rowwise_scale_inv, q.rowwise_scale_inv, f"{grad_reduction} final {name} scales")
            ctx.same_bytes(p.amax, q.amax, f"{grad_reduction} final {name} amax")
        else:
            ctx.same_bytes(p.detach(), q.detach(), f"{grad_reduction} final {name}")
    return {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1],
            "collectives_per_step": dict(want_calls), "gather_bytes_per_step": opt.gathered_bytes_per_step()}


def run(ctx) -> dict:
    out = {"ordered": train(ctx, 60, "ordered")}
    if ctx.world_size <= 2:
        out["reduce_scatter"] = train(ctx, 10, "reduce_scatter")
    return out
