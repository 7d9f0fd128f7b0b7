"""fp4_dist.fsdp.fully_shard_nvfp4 on real FSDP2 (gloo, CPU ranks), a plain script run under torchrun.

    torchrun --nproc_per_node N fsdp_suite.py --mode train --out report.json
    torchrun --nproc_per_node N fsdp_suite.py --mode save --dir CKPT --out save.json
    torchrun --nproc_per_node M fsdp_suite.py --mode load --dir CKPT --out load.json

train-fp8: the same net with ``compute="fp8"``: the unsharded weights are FP8 block copies of quantize(full master)
and the run equals a single process computing the same FP8 GEMMs (emulated on the CPU), and layers converted with
``compute="fp8"`` first compute in FP8.
train-nvfp4: the same net with ``compute="nvfp4"``: the unsharded weights are NVFP4Tensors on the gathered bytes,
equal to quantize(full master), and the run (stochastic-rounding seeds included) equals a single process running
each rank's micro-batch with the recipe's GEMMs; layers converted with ``compute="nvfp4"`` first keep their recipe.
compiled: torch.compile (aot_eager) over the net in both compute modes trains bit for bit like the same net eagerly,
every weight with a gradient.
train: a small net (weights gathered as NVFP4, weights whose shards are not whole 16-row tile bands gathered in
bf16 and quantized after, a weight kept in bf16) trains STEPS steps; at every step, inside the forward, every
gathered NVFP4 weight equals ``fp4_dist.quantize(full fp32 master)`` bit for bit, and the loss and every full
master equal a single process that quantizes its weights each step and sums the ranks' gradients in rank order.
Also: the all-gather bytes of one forward (counted by wrapping torch.distributed) equal the expected packed
sizes; meta-device init; the orderings (convert_linear_weights first; torch's fully_shard on NVFP4Tensor weights;
convert after sharding); HSDP 2x2 at 4 ranks. save/load: torch.distributed.checkpoint of model and optimizer
(get_state_dict / set_state_dict), digests of the full masters and Adam states, and one more step after loading.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import fp4_dist  # noqa: E402
from fp4_dist.fsdp import fully_shard_nvfp4, nvfp4_weights  # noqa: E402
from fp4_dist.compute.fp8_gemm import Fp8Operand  # noqa: E402
from fp4_dist.compute.fp8_param import Fp8Param  # noqa: E402
from fp4_dist.compute.linear import NVFP4Linear, ready_for_compile  # noqa: E402
from fp4_dist.kernels import nvfp4_1d_reference as q1d  # noqa: E402
from fp4_dist.fsdp.master import local_master  # noqa: E402
from fp4_dist.launch import init_distributed, shutdown  # noqa: E402
from fp4_dist.testing import bytes_mismatch  # noqa: E402

STEPS = 20
DEVICE = torch.device("cpu")  # --device cuda: the train suite on one GPU per rank (NCCL)
LR = 2e-2
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


class Net(nn.Module):
    """192 and 96 rows: NVFP4 gather at 1-3 ranks (96 rows fall back at 4); 40 rows: bf16 gather (quantized after);
    the head's K = 40: kept in bf16. `inp` and `hid` are sharded on their own; `mix` and `odd` share the root's
    parameter group, so their gathers are dequantized by one launch (one tile-grid and one row-expanded scale form
    below 4 ranks)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(48, 192)
        self.hid = nn.Linear(192, 96)
        self.mix = nn.Linear(96, 96)
        self.odd = nn.Linear(96, 40)
        self.norm = nn.LayerNorm(40)
        self.head = nn.Linear(40, 24)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hid(x))
        x = torch.relu(self.mix(x))
        return self.head(self.norm(self.odd(x)))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 48, generator=torch.Generator().manual_seed(7919 * step + rank)).to(DEVICE)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def build(seed: int = 0, *, ordered: bool = True, mesh=None, compute: str = "bf16"):
    torch.manual_seed(seed)
    model = Net().to(DEVICE)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fully_shard_nvfp4(model, mp_policy=BF16, shard_modules=[model.inp, model.hid], mesh=mesh,
                                   ordered_grad_reduction=ordered, compute=compute)  # fmt: skip
    messages = [str(w.message) for w in caught if "fp4_dist.fsdp" in str(w.message)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    return model, opt, init, report, messages


def full_masters(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = (t._data if hasattr(t, "_data") else t).detach().clone()
    return out


class Gathered:
    """Clones of every gathered NVFP4 weight, taken inside the forward (while FSDP2 holds them unsharded)."""

    def __init__(self, model):
        self.seen = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda m, a, name=name: self.take(model, f"{name}.weight"))

    def take(self, model, fqn):
        g = nvfp4_weights(model).get(fqn)
        if g is not None:
            self.seen[fqn] = {f: getattr(g, f).clone() for f in FIELDS}


class Reference:
    """One process: full fp32 masters and AdamW; each step every NVFP4 weight is quantize(master.to(bf16)),
    dequantized; every other param master.to(bf16); each rank's micro-batch backward alone, the bf16 grads
    summed in rank order and averaged (as OrderedReduceScatter and FSDP2's AVG do), then cast to fp32."""

    def __init__(self, init: dict, nvfp4: set, compute: str = "bf16", seed_of=None):
        self.net = Net().to(DEVICE)
        self.masters = {n: t.clone() for n, t in init.items()}
        self.nvfp4, self.compute, self.seed_of = nvfp4, compute, seed_of
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=LR, foreach=False)
        if compute == "nvfp4":  # the layers multiply NVFP4 weights by the recipe's GEMMs
            ready_for_compile()
            for fqn in nvfp4:
                layer = self.net.get_submodule(fqn[: -len(".weight")])
                layer.__class__, layer.fp4_compute = NVFP4Linear, compute

    def weight(self, master: torch.Tensor) -> torch.Tensor:
        """What the layer computes with: quantize(master in bf16) dequantized, or in the FP8 mode its FP8 block
        copy as a parameter (F.linear on it runs the FP8 GEMMs; the gradient comes back plain), or in the nvfp4
        mode the NVFP4 weight itself."""
        q = fp4_dist.quantize(master.to(torch.bfloat16))
        if self.compute == "fp8":
            return Fp8Param(Fp8Operand.weight(q), torch.bfloat16)
        if self.compute == "nvfp4":
            return q
        return q.dequantize(torch.bfloat16)

    def step(self, step: int, world: int) -> list[float]:
        grads, losses = None, []
        for r in range(world):
            if self.seed_of is not None:  # rank r's generator as that rank sets it before its micro-batch
                torch.manual_seed(self.seed_of(step, r))
            params = {}
            for n, m in self.masters.items():
                v = self.weight(m) if n in self.nvfp4 else m.to(torch.bfloat16)
                params[n] = v.requires_grad_()
            out = torch.func.functional_call(self.net, params, (batch(step, r).to(torch.bfloat16),))
            loss = loss_of(out)
            loss.backward()
            losses.append(loss.item())
            g = {n: p.grad for n, p in params.items()}
            grads = g if grads is None else {n: grads[n].add_(g[n]) for n in g}
        for n, m in self.masters.items():
            m.grad = (grads[n].div_(world) if world > 1 else grads[n]).float()
        self.opt.step()
        self.opt.zero_grad()
        return losses


def check_gathered(ctx, step, masters, gathered: Gathered, states) -> None:
    for fqn, st in states.items():
        got = gathered.seen.get(fqn)
        if not ctx.check(got is not None, f"step {step}: {fqn} was not gathered as NVFP4 in the forward"):
            continue
        ref = fp4_dist.quantize(masters[fqn].to(st.model_dtype), numerics=st.numerics, dtype=st.model_dtype)
        for f in FIELDS:
            msg = bytes_mismatch(got[f], getattr(ref, f), f"step {step} {fqn} {f} (mode {st.mode})")
            ctx.check(msg is None, msg or "")


class Ctx:
    def __init__(self, rank):
        self.rank, self.failures = rank, []

    def check(self, ok, msg) -> bool:
        if not ok:
            self.failures.append(f"rank {self.rank}: {msg}")
        return bool(ok)


def agree_with_reference(ctx, losses: list, ref_losses: list, model, ref: Reference) -> None:
    """The run's losses and, after its last step, every full fp32 master equal the single-process reference's."""
    ctx.check(losses == ref_losses, f"losses differ from the single-process reference: {losses} vs {ref_losses}")
    final = full_masters(model)
    differ = [n for n in final if not torch.equal(final[n], ref.masters[n])]
    ctx.check(not differ, f"after {len(losses)} steps these fp32 masters differ from the reference: {differ}")


def suite_train(ctx, world, rank) -> dict:
    model, opt, init, report, messages = build()
    states = model._fp4_dist_nvfp4.states
    ctx.check(len(messages) == 1, f"expected one warning naming the fallbacks, got {len(messages)}: {messages}")
    expect_bf16 = {"odd.weight"} | ({"hid.weight", "mix.weight"} if world == 4 else set())
    ctx.check(set(report.bf16_gather) == expect_bf16, f"bf16-gather weights {sorted(report.bf16_gather)}")
    ctx.check(set(report.kept) == {"head.weight"}, f"kept {sorted(report.kept)}")
    ctx.check(all(n in messages[0] for n in [*report.bf16_gather, *report.kept]) if messages else False,
              "the warning names every fallback")
    batches = sorted(b.size for b in model._fp4_dist_nvfp4.batches)
    ctx.check(batches == [1, 1, 2], f"dequantize batches per FSDP2 parameter group {batches}, expected [1, 1, 2]")
    gathered = Gathered(model)
    ref = Reference(init, set(states))
    losses, ref_losses = [], []
    for step in range(STEPS):
        masters = full_masters(model)
        gathered.seen.clear()
        loss = loss_of(model(batch(step, rank).to(torch.bfloat16)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        check_gathered(ctx, step, masters, gathered, states)
        losses.append(loss.item())
        ref_losses.append(ref.step(step, world)[rank])
    agree_with_reference(ctx, losses, ref_losses, model, ref)
    return {"losses": losses, "bytes": gathered_bytes(ctx, model, report, rank), "report": str(report)}


FP8_STEPS = 8


def sharded_after_conversion(compute: str) -> tuple:
    """(a fresh Net converted with ``convert_linear_weights(compute=...)`` and then sharded by fully_shard_nvfp4 with
    the default compute, its FSDPReport): the layers keep the mode they were converted to."""
    torch.manual_seed(1)
    converted = Net().to(DEVICE)
    fp4_dist.convert_linear_weights(converted, dtype=torch.bfloat16, compute=compute)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return converted, fully_shard_nvfp4(converted, mp_policy=BF16)


def suite_train_fp8(ctx, world, rank) -> dict:
    """compute="fp8": inside every forward each NVFP4 linear's unsharded weight is the FP8 block copy of
    quantize(full master) (its bits and block scales bit for bit), the gathered bytes are quantize(full master),
    and losses and masters equal one process computing the same FP8 GEMMs on each rank's micro-batch."""
    model, opt, init, report, _ = build(compute="fp8")
    states = model._fp4_dist_nvfp4.states
    ctx.check(sorted(report.fp8) == sorted(states), f"FP8 weights {report.fp8}, NVFP4 weights {sorted(states)}")
    ctx.check(model._fp4_dist_nvfp4.batches == [], "a dequantize batch for weights that compute in FP8")
    gathered, copies = Gathered(model), {}

    def take(module, args, fqn):  # a clone: FSDP2 frees the unsharded weight's memory when it reshards
        w = module.weight
        copies[fqn] = (type(w), *((w.operand.bits.clone(), w.operand.scales.clone()) if type(w) is Fp8Param else ()))

    for fqn in states:
        model.get_submodule(fqn[: -len(".weight")]).register_forward_pre_hook(lambda m, a, fqn=fqn: take(m, a, fqn))
    ref = Reference(init, set(states), compute="fp8")
    losses, ref_losses = [], []
    for step in range(FP8_STEPS):
        masters = full_masters(model)
        gathered.seen.clear()
        copies.clear()
        loss = loss_of(model(batch(step, rank).to(torch.bfloat16)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        check_gathered(ctx, step, masters, gathered, states)
        ctx.check(sorted(copies) == sorted(states), f"step {step}: forwards of {sorted(copies)}")
        for fqn, (kind, *seen) in copies.items():
            if not ctx.check(kind is Fp8Param, f"step {step}: {fqn} computed with a {kind.__name__}"):
                continue
            want = Fp8Operand.weight(fp4_dist.quantize(masters[fqn].to(torch.bfloat16)))
            for name, got, exp in (("bits", seen[0], want.bits), ("scales", seen[1], want.scales)):
                ctx.check(torch.equal(got.cpu().view(torch.uint8), exp.cpu().view(torch.uint8)),
                          f"step {step}: {fqn}'s FP8 copy {name} differ from that of quantize(full master)")
        losses.append(loss.item())
        ref_losses.append(ref.step(step, world)[rank])
    agree_with_reference(ctx, losses, ref_losses, model, ref)
    # Layers converted with compute="fp8" first compute in FP8 under the default compute="bf16" too
    converted, second = sharded_after_conversion("fp8")
    seen = []
    converted.mix.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight)))
    loss_of(converted(batch(0, rank).to(torch.bfloat16))).backward()
    ctx.check(sorted(second.fp8) == ["hid.weight", "inp.weight", "mix.weight", "odd.weight"] and seen == [Fp8Param],
              f"converted in FP8 first: FP8 weights {second.fp8}, mix computed with {seen}")
    # A subclass of nn.Linear with a forward of its own computes in bf16, and the report says why
    torch.manual_seed(2)
    mixed = nn.Sequential(OwnForward(48, 96), nn.Linear(96, 32)).to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        third = fully_shard_nvfp4(mixed, mp_policy=BF16, compute="fp8")
    kinds = []
    for layer in mixed:
        layer.register_forward_pre_hook(lambda m, a: kinds.append(type(m.weight)))
    loss_of(mixed(batch(0, rank).to(torch.bfloat16))).backward()
    ctx.check(third.fp8 == ["1.weight"] and list(third.not_fp8) == ["0.weight"]
              and "keeps its own forward" in str(third) and kinds[1] is Fp8Param and kinds[0] is not Fp8Param,
              f"a layer with its own forward: FP8 {third.fp8}, not FP8 {third.not_fp8}, computed with {kinds}")
    # reshard_after_forward=False and a forward without a backward: FSDP2 keeps the layers unsharded. The next
    # forward trains on them while no master changed; after a step it says so and what to do
    torch.manual_seed(3)
    kept = Net().to(DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(kept, mp_policy=BF16, reshard_after_forward=False, compute="fp8")
    sgd = torch.optim.SGD(kept.parameters(), lr=0.1)
    with torch.no_grad():
        kept(batch(0, rank).to(torch.bfloat16))
    loss_of(kept(batch(1, rank).to(torch.bfloat16))).backward()
    no_grad = [n for n, p in kept.named_parameters() if p.grad is None]
    ctx.check(not no_grad, f"a training forward after an evaluation one left no gradient for {no_grad}")
    with torch.no_grad():
        kept(batch(2, rank).to(torch.bfloat16))
    sgd.step()
    try:
        kept(batch(3, rank).to(torch.bfloat16))
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    ctx.check("a master changed" in error and "reshard_after_forward=False" in error and "call reshard()" in error,
              f"a forward on weights FSDP2 left unsharded, after a step: {error}")
    kept.reshard()
    with torch.no_grad():
        kept(batch(3, rank).to(torch.bfloat16))  # resharded as the message says: the forward runs
    return {"losses": losses, "fp8": report.fp8}


NVFP4_STEPS = 4


def nvfp4_seed(step: int, rank: int) -> int:
    """The seed of torch's default CPU generator before each step's micro-batch on `rank` (and in the reference
    before that rank's micro-batch): the stochastic roundings draw their seeds from it."""
    return 1000 + 7919 * step + rank


def suite_train_nvfp4(ctx, world, rank) -> dict:
    """compute="nvfp4": inside every forward each NVFP4 linear's unsharded weight is an NVFP4Tensor whose codes,
    scales and amax are quantize(full master)'s, its bytes FSDP2's gathered bytes themselves (no copy) and its
    fields the same tensors at every gather; the gathered bytes are quantize(full master); the stochastic roundings
    draw the same seeds in the same order as one process running each rank's micro-batch with that rank's
    generator; and losses and masters equal that process's, bit for bit."""
    model, opt, init, report, _ = build(compute="nvfp4")
    states = model._fp4_dist_nvfp4.states
    ctx.check(sorted(report.in_mode) == sorted(states), f"nvfp4 weights {report.in_mode}, NVFP4 {sorted(states)}")
    ctx.check(model._fp4_dist_nvfp4.batches == [], "a dequantize batch for weights that compute in the nvfp4 mode")
    gathered, seen, fields = Gathered(model), {}, {}

    def take(module, fqn):  # clones: FSDP2 frees the unsharded weight's memory when it reshards
        w, st = module.weight, states[fqn]
        if not ctx.check(type(w) is fp4_dist.NVFP4Tensor, f"{fqn} computed with a {type(w).__name__}"):
            return
        seen[fqn] = {f: getattr(w, f).clone() for f in FIELDS}
        ctx.check(w.rowwise_data.data_ptr() == st.gathered_fields[0].data_ptr(),
                  f"{fqn}: the unsharded weight's bytes are not the gathered bytes (a copy)")
        ids = tuple(id(getattr(w, f)) for f in FIELDS)
        ctx.check(fields.setdefault(fqn, ids) == ids, f"{fqn}: the unsharded weight's fields are new tensors")

    for fqn in states:
        model.get_submodule(fqn[: -len(".weight")]).register_forward_pre_hook(lambda m, a, fqn=fqn: take(m, fqn))
    drawn, real_draw = [], q1d.draw_seed

    def recording_draw(generator=None):
        drawn.append(real_draw(generator))
        return drawn[-1]

    q1d.draw_seed = recording_draw
    try:
        ref = Reference(init, set(states), compute="nvfp4", seed_of=nvfp4_seed)
        losses, ref_losses, seeds, ref_seeds = [], [], [], []
        for step in range(NVFP4_STEPS):
            masters = full_masters(model)
            gathered.seen.clear()
            seen.clear()
            torch.manual_seed(nvfp4_seed(step, rank))
            drawn.clear()
            loss = loss_of(model(batch(step, rank).to(torch.bfloat16)))
            loss.backward()
            seeds.append(list(drawn))
            opt.step()
            opt.zero_grad()
            check_gathered(ctx, step, masters, gathered, states)
            ctx.check(sorted(seen) == sorted(states), f"step {step}: forwards of {sorted(seen)}")
            for fqn, got in seen.items():
                want = fp4_dist.quantize(masters[fqn].to(torch.bfloat16))
                for f in FIELDS:
                    msg = bytes_mismatch(got[f], getattr(want, f), f"step {step}: {fqn}'s unsharded weight's {f}")
                    ctx.check(msg is None, msg or "")
            losses.append(loss.item())
            drawn.clear()
            ref_losses.append(ref.step(step, world)[rank])
            per_rank = len(drawn) // world
            ref_seeds.append(drawn[rank * per_rank: (rank + 1) * per_rank])
    finally:
        q1d.draw_seed = real_draw
    # two per layer with an input gradient (dgrad, then wgrad), one for the first layer (wgrad only)
    ctx.check(seeds == ref_seeds and all(len(s) == 2 * len(states) - 1 for s in seeds),
              f"stochastic-rounding seeds differ from the reference's: {seeds} vs {ref_seeds}")
    agree_with_reference(ctx, losses, ref_losses, model, ref)
    # Layers converted with compute="nvfp4" first keep their recipe under the default compute: its first and last
    # linears compute in bf16, the others multiply the unsharded NVFP4 weights
    converted, second = sharded_after_conversion("nvfp4")
    kinds = {}
    for name in ("inp", "mix", "odd"):
        converted.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: kinds.update({name: type(m.weight).__name__}))
    loss_of(converted(batch(0, rank).to(torch.bfloat16))).backward()
    ctx.check(sorted(second.in_mode) == ["hid.weight", "mix.weight"]
              and [n for n, kind in kinds.items() if kind == "NVFP4Tensor"] == ["mix"] and len(kinds) == 3,
              f"converted in the nvfp4 mode first: in the mode {second.in_mode}, computed with {kinds}")
    return {"losses": losses, "nvfp4": report.in_mode, "seeds_per_step": len(seeds[0])}


class OwnForward(nn.Linear):
    """An nn.Linear subclass whose forward uses its weight other than through F.linear."""

    def forward(self, x):
        return x @ self.weight.t() + self.bias


def suite_non_finite(ctx, world, rank) -> dict:
    """One rank's fp32 master turns NaN after a step: the next forward raises ValueError naming the weight on
    every rank instead of returning; with the value fixed, the forward after that casts again and gathers
    quantize(full master)."""
    model, opt, _, _, _ = build(seed=3)
    states = model._fp4_dist_nvfp4.states
    x = batch(0, rank).to(torch.bfloat16)
    loss_of(model(x)).backward()
    opt.step()
    opt.zero_grad()
    shard = local_master(model.inp.weight).fp32
    bad = rank == world - 1
    kept = shard[0, 0].item()
    if bad:
        shard[0, 0] = float("nan")
    try:
        model(x)
        ctx.check(False, "a forward whose weights were cast from a NaN master returned its output")
        error = None
    except ValueError as e:
        error = str(e)
        ctx.check("inp.weight" in error and "not finite" in error, f"the error does not name the weight: {error}")
    if bad:
        shard[0, 0] = kept
    gathered = Gathered(model)
    masters = full_masters(model)
    loss = loss_of(model(x))
    loss.backward()
    check_gathered(ctx, "after a non-finite master was fixed", masters, gathered, states)
    ctx.check(bool(torch.isfinite(loss)), f"loss after the fix {loss.item()}")
    return {"error": error}


def gathered_bytes(ctx, model, report, rank) -> dict:
    """All-gather bytes of one forward, counted on the real collective, against the packed sizes."""
    seen = []
    # FSDP2 calls all_gather_single (torch >= 2.12) or all_gather_into_tensor: wrap (not mock) whichever exists
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(fn):
        def wrapper(out, inp, *a, **k):
            seen.append(out.numel() * out.element_size())
            return fn(out, inp, *a, **k)
        return wrapper

    for n in names:
        setattr(dist, n, counting(real[n]))
    try:
        with torch.no_grad():
            model(batch(0, rank).to(torch.bfloat16))
    finally:
        for n in names:
            setattr(dist, n, real[n])
    world = dist.get_world_size()
    expect = 0
    for n, p in model.named_parameters():
        st = model._fp4_dist_nvfp4.states.get(n)
        rows = -(-p.shape[0] // world) * world
        if st is None:
            expect += rows * (p.numel() // p.shape[0]) * 2  # bf16 dense params, padded to whole shards
        elif st.mode == "nvfp4":
            m, k = st.shape
            expect += m * k // 2 + (m // 16) * (k // 16)
        else:
            expect += rows * st.shape[1] * 2
    per_elem = report.gathered_bytes_per_element(model)
    if world > 1:
        ctx.check(sum(seen) == expect, f"all-gather bytes of one forward {sum(seen)} != expected {expect}")
    nvfp4_elems = sum(model._fp4_dist_nvfp4.states[n].shape[0] * model._fp4_dist_nvfp4.states[n].shape[1]
                      for n in report.nvfp4)  # fmt: skip
    return {"measured": sum(seen), "expected": expect, "per_element": per_elem, "nvfp4_elements": nvfp4_elems,
            "nvfp4_bytes_if_bf16": 2 * nvfp4_elems}


def suite_meta_init(ctx, world, rank) -> None:
    with torch.device("meta"):
        torch.manual_seed(0)
        model = Net()
    fully_shard_nvfp4(model, mp_policy=BF16, shard_modules=[model.inp])
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    gathered = Gathered(model)
    masters = full_masters(model)
    model(batch(0, rank).to(torch.bfloat16)).float().sum().backward()
    check_gathered(ctx, "meta-init", masters, gathered, model._fp4_dist_nvfp4.states)


def suite_orderings(ctx, world, rank) -> None:
    # convert_linear_weights first: the masters start from the NVFP4 values
    torch.manual_seed(1)
    model = Net()
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    before = {n: p.dequantize(torch.float32) for n, p in model.named_parameters()
              if isinstance(p, fp4_dist.NVFP4Tensor)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard_nvfp4(model, mp_policy=BF16)
    masters = full_masters(model)
    ctx.check(all(torch.equal(masters[n], v) for n, v in before.items()), "masters != converted NVFP4 values")
    gathered = Gathered(model)
    model(batch(0, rank).to(torch.bfloat16)).float().sum().backward()
    check_gathered(ctx, "convert-first", masters, gathered, model._fp4_dist_nvfp4.states)
    # torch's fully_shard on NVFP4Tensor weights: refused, naming the remedy
    torch.manual_seed(1)
    model = Net()
    fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
    try:
        fully_shard(model)
        ctx.check(False, "torch fully_shard accepted NVFP4Tensor weights (they would be gathered as bf16)")
    except Exception as e:  # noqa: BLE001 - the point is the message
        ctx.check("fully_shard_nvfp4" in str(e), f"fully_shard on NVFP4Tensor weights: unclear error {e!r}")
    # converting after sharding: refused
    torch.manual_seed(1)
    model = Net()
    fully_shard(model)
    try:
        fp4_dist.convert_linear_weights(model, dtype=torch.bfloat16)
        ctx.check(False, "convert_linear_weights accepted FSDP2-sharded weights")
    except ValueError as e:
        ctx.check("fully_shard_nvfp4" in str(e), f"convert after fully_shard: unclear error {e!r}")


def suite_hsdp(ctx, world, rank) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model, opt, init, report, _ = build(mesh=mesh, ordered=False)
    gathered = Gathered(model)
    for step in range(3):
        masters = full_masters(model)
        gathered.seen.clear()
        loss_of(model(batch(step, rank).to(torch.bfloat16))).backward()
        opt.step()
        opt.zero_grad()
        check_gathered(ctx, f"hsdp {step}", masters, gathered, model._fp4_dist_nvfp4.states)
    return {"nvfp4": report.nvfp4}


def digest(tensors: dict) -> dict:
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for k, v in sorted(tensors.items())}  # fmt: skip


def full_state(model, opt) -> dict:
    out = {f"master:{n}": t for n, t in full_masters(model).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[f"{k}:{names[id(p)]}"] = v.detach().reshape(-1).clone() if v.dim() else v.detach().reshape(1)
    return out


def suite_checkpoint(ctx, world, rank, mode, ckpt) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, _, _, _ = build(seed=3 if mode == "load" else 0)
    steps = 4 if mode == "save" else 0
    for step in range(steps):
        loss_of(model(batch(step, rank).to(torch.bfloat16))).backward()
        opt.step()
        opt.zero_grad()
    if mode == "save":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        saved = digest(full_state(model, opt))
        loss_of(model(batch(4, rank).to(torch.bfloat16))).backward()  # the uninterrupted run's next step
        opt.step()
        return {"digests": saved, "next_step": digest(full_state(model, opt))}
    loss_of(model(batch(99, rank).to(torch.bfloat16))).backward()  # materialise Adam state to load into
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    fp4_dist.checkpoint.load_distributed_checkpoint(state, ckpt)  # dcp.load, nothing in the files run
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    digests = digest(full_state(model, opt))
    gathered = Gathered(model)
    masters = full_masters(model)
    loss_of(model(batch(4, rank).to(torch.bfloat16))).backward()
    opt.step()
    check_gathered(ctx, "after load", masters, gathered, model._fp4_dist_nvfp4.states)
    return {"digests": digests, "next_step": digest(full_state(model, opt))}


COMPILED_STEPS = 4


def suite_compiled(ctx, world, rank) -> dict:
    """torch.compile (aot_eager: eager numerics) over a model from fully_shard_nvfp4, in both compute modes: the
    losses, every weight's gradient (an NVFP4 weight whose gradient is lost would keep its master) and the masters
    after each step equal the same model's run without compile, bit for bit."""
    out = {}
    for compute in ("bf16", "fp8"):
        runs = {}
        for compiled in (False, True):
            model, opt, init, _, _ = build(compute=compute)
            forward = torch.compile(model, backend="aot_eager") if compiled else model
            losses, masters, no_grad = [], [], set()
            for step in range(COMPILED_STEPS):
                loss = loss_of(forward(batch(step, rank).to(torch.bfloat16)))
                loss.backward()
                no_grad |= {n for n, p in model.named_parameters() if p.grad is None}
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                masters.append(full_masters(model))
            moved = {n for n, t in masters[-1].items() if not torch.equal(t, init[n].to(t.device))}
            ctx.check(not no_grad and moved == set(init), f"{compute}, compiled {compiled}: no gradient for "
                      f"{sorted(no_grad)}; masters that never moved: {sorted(set(init) - moved)}")
            runs[compiled] = (losses, masters)
        ctx.check(runs[True][0] == runs[False][0], f"{compute}: compiled losses {runs[True][0]} != {runs[False][0]}")
        for step, (a, b) in enumerate(zip(runs[True][1], runs[False][1])):
            differ = [n for n in a if not torch.equal(a[n], b[n])]
            ctx.check(not differ, f"{compute}, step {step}: compiled masters differ: {differ}")
        out[compute] = runs[True][0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("train", "train-fp8", "train-nvfp4", "compiled", "save", "load"),
                    default="train")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the train suite only, NCCL, deterministic kernels (GPU runs on the device machine)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    global DEVICE
    if args.device == "cuda":
        # The parity compares two models in one process: keep every GPU op deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    info = init_distributed("nccl" if args.device == "cuda" else "gloo")
    DEVICE = info.device
    world, rank = info.world_size, info.rank
    ctx = Ctx(rank)
    report = {"world_size": world}
    suites = {"train": [("train", suite_train), ("non_finite", suite_non_finite), ("meta_init", suite_meta_init),
                        ("orderings", suite_orderings)] + ([("hsdp", suite_hsdp)] if world == 4 else [])
              if DEVICE.type == "cpu" else [("train", suite_train), ("non_finite", suite_non_finite)],
              "train-fp8": [("train_fp8", suite_train_fp8)],
              "train-nvfp4": [("train_nvfp4", suite_train_nvfp4)],
              "compiled": [("compiled", suite_compiled)],
              "save": [("checkpoint", lambda c, w, r: suite_checkpoint(c, w, r, "save", args.dir))],
              "load": [("checkpoint", lambda c, w, r: suite_checkpoint(c, w, r, "load", args.dir))]}[args.mode]
    for name, fn in suites:
        try:
            report[name] = fn(ctx, world, rank)
        except Exception:  # a crash is a failure of this suite
            ctx.failures.append(f"[{name}] rank {rank}: crashed:\n{traceback.format_exc()[-3000:]}")
    everyone = [None] * world
    dist.all_gather_object(everyone, ctx.failures)
    report["failures"] = [f for fs in everyone for f in fs]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        for f in report["failures"][:20]:
            print("FAIL", f)
        print(json.dumps({k: v for k, v in report.items() if k not in ("failures",)}, default=str)[:3000])
    shutdown()
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
