"""Cases of what a PyTorch user meets on 2 gloo ranks (torchrun): ranks that disagree, Zero1Optimizer's
gradient semantics, a standard DCP load into a fresh optimizer.

    torchrun --nproc-per-node 2 tests/distributed/torch_user_cases.py CASE [CASE ...]

The cases run one after the other in one job and one process group, as a user's script would meet them: after each,
every rank prints one line ``RESULT <rank> <case> <outcome>`` (what it raised, or OK) that the test reads, and the
ranks meet at a barrier, so a case that left the group unusable fails the cases after it. No pytest here.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import fp4_dist
from fp4_dist.launch import init_distributed, shutdown
from fp4_dist.optim import Zero1Config, Zero1Optimizer

from fp4_dist.cast import RankMismatchError
from rank_results import say  # beside this script

SHAPES = [(48, 80), (33, 112), (64, 48)]


def weights_and_masters(rank: int, size: int, shapes=SHAPES, numerics="te"):
    weights, masters, starts = [], [], []
    for i, (m, k) in enumerate(shapes):
        full = torch.randn(m * k, generator=torch.Generator().manual_seed(i))
        weights.append(fp4_dist.quantize(full.view(m, k), numerics=numerics))
        per = (m * k // size) & ~1
        lo, hi = rank * per, (m * k if rank == size - 1 else (rank + 1) * per)
        masters.append(full[lo:hi].clone())
        starts.append(lo)
    return weights, masters, starts


def cast(rank, size, weights, masters, starts, group=None):
    fp4_dist.cast_master_weights_to_nvfp4(weights, masters, starts, group=group)


def case_fewer_weights(rank, size):
    w, m, s = weights_and_masters(rank, size)
    n = 2 if rank == 1 else 3
    cast(rank, size, w[:n], m[:n], s[:n])


def case_overlapping_shards(rank, size):
    w, m, s = weights_and_masters(rank, size)
    m[1] = torch.randn(33 * 112 // 2 + 2, generator=torch.Generator().manual_seed(5))  # both claim [0, n/2 + 2)
    s[1] = 0
    cast(rank, size, w, m, s)


def case_other_shape_same_numel(rank, size):
    shapes = [(80, 48) if rank == 1 else (48, 80), *SHAPES[1:]]
    cast(rank, size, *weights_and_masters(rank, size, shapes))


def case_other_numerics(rank, size):
    cast(rank, size, *weights_and_masters(rank, size, numerics="te-2.14" if rank == 1 else "te"))


def case_groups_of_one(rank, size):
    groups = [dist.new_group([r]) for r in range(size)]
    cast(rank, size, *weights_and_masters(rank, size), group=groups[rank])


def case_group_without_this_rank(rank, size):
    only_rank_0 = dist.new_group([0])
    cast(rank, size, *weights_and_masters(rank, size), group=only_rank_0)


def model(extra: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(32, 48), nn.Linear(48, 32)] + ([nn.Linear(32, 32)] if extra else [])
    net = nn.Sequential(*layers).to(torch.bfloat16)
    fp4_dist.convert_linear_weights(net)
    return net


def adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def case_zero1_other_parameters(rank, size):
    Zero1Optimizer(model(extra=rank == 1).named_parameters(), adamw)


def _snapshot(opt):
    return [t.clone() for t in opt.full_masters()] + [
        v.clone() for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _bits_equal(a, b):
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(a, b))


def _loss(net, rank, step):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank)).to(torch.bfloat16)
    return net(x).float().square().mean()


def stepped_once(rank):
    """A model and its Zero1Optimizer after one step (the inner optimizer has state)."""
    net = model()
    opt = Zero1Optimizer(net.named_parameters(), adamw)
    _loss(net, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def case_zero1_nan_on_one_rank(rank, size):
    net, opt = stepped_once(rank)
    before = _snapshot(opt)
    _loss(net, rank, 1).backward()
    if rank == 1:
        net[1].weight.grad[0, 0] = float("nan")
    try:
        opt.step()
    except ValueError as e:
        intact = _bits_equal(_snapshot(opt), before)
        raise ValueError(f"{e} [state intact: {intact}]") from None


def case_zero1_skip_continues(rank, size):
    net = model()
    opt = Zero1Optimizer(net.named_parameters(), adamw, config=Zero1Config(nonfinite_grads="skip"))
    for step in range(3):
        _loss(net, rank, step).backward()
        if step == 1 and rank == 0:
            net[0].bias.grad[3] = float("inf")
        before = _snapshot(opt)
        opt.step()
        opt.zero_grad()
        if (step == 1) != _bits_equal(_snapshot(opt), before):
            raise AssertionError(f"step {step}: skipped={step == 1} but the state {'did not change' if step != 1 else 'changed'}")
    if opt.skipped_steps != 1:
        raise AssertionError(f"skipped_steps = {opt.skipped_steps}")


def case_zero1_gradient_on_one_rank_only(rank, size):
    net = model(extra=True)
    opt = Zero1Optimizer(net.named_parameters(), adamw)
    before = [t.clone() for t in opt.full_masters()]
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    y = net[1](net[0](x))
    if rank == 1:  # the third layer gets a gradient on rank 1 only: every rank must step it
        y = net[2](y)
    y.float().square().mean().backward()
    opt.step()
    after = opt.full_masters()
    changed = [not torch.equal(a, b) for a, b in zip(after, before)]
    if not all(changed):
        raise AssertionError(f"parameters not stepped: {[i for i, c in enumerate(changed) if not c]}")
    # A weight no rank has a gradient for is left out of the cast and keeps its bytes; the others (weight 1 is cut
    # between the ranks mid-tile) still equal quantize(full master). Then the cut weight is the frozen one.
    for frozen_layer, master_index in ((2, 4), (1, 2)):
        opt.zero_grad()
        for i, layer in enumerate(net):
            layer.weight.requires_grad_(i != frozen_layer)
        frozen = opt.full_masters()[master_index].clone()
        frozen_bytes = net[frozen_layer].weight.rowwise_data.clone()
        net[2](net[1](net[0](x))).float().square().mean().backward()
        opt.step()
        if not torch.equal(opt.full_masters()[master_index], frozen):
            raise AssertionError("a frozen weight's master changed")
        if not torch.equal(net[frozen_layer].weight.rowwise_data, frozen_bytes):
            raise AssertionError(f"frozen layer {frozen_layer}: its bytes changed")
        masters = opt.full_masters()
        for i, layer in enumerate(net):
            want = fp4_dist.quantize(masters[2 * i].to(torch.bfloat16))
            for field in ("rowwise_data", "rowwise_scale_inv", "amax"):
                if not torch.equal(getattr(layer.weight, field), getattr(want, field)):
                    raise AssertionError(f"frozen layer {frozen_layer}: layer {i} {field} != quantize(full master)")


def case_zero1_dcp_fresh_load(rank, size):
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp

    _, opt = stepped_once(rank)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        dcp.save({"optimizer": opt}, checkpoint_id=path[0])
        fresh = Zero1Optimizer(model().named_parameters(), adamw)
        dcp.load({"optimizer": fresh}, checkpoint_id=path[0])
    noisy = [str(w.message) for w in caught if "ShardedTensor" in str(w.message)]
    if noisy:
        raise AssertionError(f"{len(noisy)} ShardedTensor warnings shown: {noisy[0]}")
    if not _bits_equal(_snapshot(fresh), _snapshot(opt)):
        raise AssertionError("the freshly loaded optimizer's masters or state differ from the saved one's")


def run(case: str, rank: int, size: int) -> str:
    try:
        globals()[f"case_{case}"](rank, size)
        return "OK"
    except RankMismatchError as e:
        return f"RankMismatchError {e}"
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__} {e}"


def main() -> None:
    info = init_distributed("gloo")
    for case in sys.argv[1:]:
        say(info.rank, case, run(case, info.rank, info.world_size))
        dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
