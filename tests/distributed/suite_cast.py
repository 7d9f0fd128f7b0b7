"""Distributed partial cast == quantize(full_master.to(bf16)), bit for bit, for this world size.

Cases (identical on every rank and every world size):
* random lists of weight shapes (ragged M, K % 64 != 0), laid out by `build_layout` with several bucket
  sizes and alignments (align=2 puts rank boundaries mid-tile and mid-row), cast with
  `cast_master_weights_to_nvfp4`, all-gathered per bucket from the packed buffer in place;
* TransformerEngine's test model shapes (one rank boundary cuts a 16x16 tile);
* arbitrary even cuts per weight (empty shards included), gathered by assembling every rank's byte range;
* the layout cases again through `ShardedCast` (Zero1Optimizer's cast: only cut-tile amaxes are all-reduced,
  each tile's scale comes from its owner through the compact scale all-gather): the same bytes.

Checked on every rank: gathered rowwise_data, the whole rowwise_scale_inv (valid region = reference, padding
zero), amax, columnwise data/scales == the reference's make_columnwise(); before the gather, every byte outside
this rank's shard is still poison. The digest of each case goes to the report (same for every world size).
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import fp4_dist
from fp4_dist.buffers import ShardBuffer, build_layout
from fp4_dist.cast import cast_master_weights_to_nvfp4, post_all_gather_processing
from fp4_dist.cast.collectives import CommStats, all_gather_inplace
from fp4_dist.cast.sharded import ShardedCast
from fp4_dist.tensor import NVFP4Tensor
from fp4_dist.testing import POISON_BYTE, awkward_shapes, poison_, random_weight, shard_cuts

from _harness import digest, fp32_generator

TE_SHAPES = [(320, 128), (768, 320), (128, 768)]


def cases():
    rng = random.Random(20240611)
    out = []
    for c in range(14):
        shapes = awkward_shapes(rng, rng.randint(1, 6), max_m=90)
        out.append(dict(name=f"random{c}", shapes=shapes, bucket=rng.choice([None, 900, 4000]),
                        align=rng.choice([2, 2, 64]), seed=1000 + c))
    out.append(dict(name="te-model", shapes=TE_SHAPES, bucket=None, align=64, seed=7))
    out.append(dict(name="ragged-big", shapes=[(272, 80), (33, 144), (2, 16)], bucket=5000, align=2, seed=8))
    return out


def make_masters(shapes, seed):
    g = fp32_generator(seed)
    return [random_weight(m, k, generator=g, heavy_tailed=i % 2 == 1) for i, (m, k) in enumerate(shapes)]


def reference(masters):
    refs = [fp4_dist.quantize(m.to(torch.bfloat16)) for m in masters]
    for r in refs:
        if r.shape[0] % 2 == 0:
            r.make_columnwise()
    return refs


def compare(ctx, weights, refs, label):
    for i, (w, r) in enumerate(zip(weights, refs)):
        tag = f"{label} weight {i} {list(w.shape)}"
        ctx.same_bytes(w.rowwise_data, r.rowwise_data, f"{tag} rowwise_data")
        ctx.same_bytes(w.rowwise_scale_inv, r.rowwise_scale_inv, f"{tag} rowwise_scale_inv")
        ctx.same_bytes(w.amax, r.amax, f"{tag} amax")
        if r.columnwise_data is not None:
            ctx.same_bytes(w.columnwise_data, r.columnwise_data, f"{tag} columnwise_data")
            ctx.same_bytes(w.columnwise_scale_inv, r.columnwise_scale_inv, f"{tag} columnwise_scale_inv")


def poisoned(shapes, device):
    ws = [NVFP4Tensor.empty(s, device=device) for s in shapes]
    for w in ws:
        for f in ("rowwise_data", "rowwise_scale_inv", "amax"):
            poison_(getattr(w, f))
    return ws


def check_only_own_bytes_written(ctx, buf, label):
    """Before the gather: bytes of weights outside this rank's shards are untouched poison."""
    owned = torch.zeros(buf.param.numel(), dtype=torch.bool)
    for b in range(len(buf.layout.buckets)):
        s = buf.layout.buckets[b].shard(buf.rank).packed()
        owned[s.start:s.end] = True
    in_weights = torch.zeros_like(owned)
    for slot in buf.layout.weights:
        p = slot.span.packed()
        in_weights[p.start:p.end] = True
    foreign = buf.param.cpu()[in_weights & ~owned]
    ctx.check(bool((foreign == POISON_BYTE).all()), f"{label}: a rank wrote bytes outside its shard")


def layout_buffers(ctx, case):
    """(masters, layout, buffer with this rank's master pieces, poisoned weights stored in the buffer)."""
    shapes, device = case["shapes"], ctx.device
    masters = make_masters(shapes, case["seed"])
    layout = build_layout([m * k for m, k in shapes], ctx.world_size, bucket_numel=case["bucket"],
                          align=case["align"])
    buf = ShardBuffer(layout, ctx.rank, packed=True, device=device)
    poison_(buf.param)
    weights = poisoned(shapes, device)
    for i, w in enumerate(weights):
        w.set_rowwise_storage(buf.param_view(i))
        piece = buf.pieces[i]
        if piece is not None:
            buf.master_piece(i).copy_(masters[i].view(-1)[piece.span.start:piece.span.end])
    return masters, layout, buf, weights


def run_layout_case(ctx, case, group=None):
    masters, layout, buf, weights = layout_buffers(ctx, case)
    cast_master_weights_to_nvfp4(weights, buf.master_pieces(), buf.start_offsets(), group)
    check_only_own_bytes_written(ctx, buf, case["name"])
    for b in range(len(layout.buckets)):
        all_gather_inplace(buf.bucket_param(b), group)
    post_all_gather_processing(weights)
    compare(ctx, weights, reference(masters), case["name"])
    return digest([t for w in weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax, w.columnwise_data)])


def run_sharded_case(ctx, case, group=None):
    """The same case through ShardedCast: cut-tile amax all-reduce, owner scales, compact scale gather."""
    masters, layout, buf, weights = layout_buffers(ctx, case)
    stats = CommStats()
    cast = ShardedCast.from_buffer(weights, buf)
    cast.cast(group, stats)
    check_only_own_bytes_written(ctx, buf, f"{case['name']}/sharded")
    cast.gather_scales(group, stats)
    for b in range(len(layout.buckets)):
        all_gather_inplace(buf.bucket_param(b), group)
    cast.after_gather()
    compare(ctx, weights, reference(masters), f"{case['name']}/sharded")
    tiles = sum(-(-m // 16) * -(-k // 16) for m, k in case["shapes"])
    if ctx.world_size > 1:
        ctx.check(stats.bytes["all_reduce"] == cast.message_bytes() <= 4 * (len(weights) + tiles),
                  f"{case['name']}/sharded: all-reduce of {stats.bytes['all_reduce']} bytes")
    return digest([t for w in weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax, w.columnwise_data)])


def run_arbitrary_cuts(ctx, seed=99):
    """Random even cuts per weight (mid-tile, mid-row, empty shards), independent of any buffer layout."""
    rng = random.Random(seed)
    shapes = awkward_shapes(rng, 5, max_m=70) + [(64, 48)]
    masters = make_masters(shapes, seed)
    cuts = [list(shard_cuts(m * k, ctx.world_size, rng)) for m, k in shapes]
    weights = poisoned(shapes, ctx.device)
    mine = [c[ctx.rank] for c in cuts]
    shards = [masters[i].view(-1)[a:b].to(ctx.device) if b > a else None for i, (a, b) in enumerate(mine)]
    cast_master_weights_to_nvfp4(weights, shards, [a if b > a else None for a, b in mine])
    for i, w in enumerate(weights):
        data = w.rowwise_data.view(-1)
        if ctx.world_size > 1:
            copies = [torch.empty_like(data) for _ in range(ctx.world_size)]
            dist.all_gather(copies, data)
            for r, (a, b) in enumerate(cuts[i]):
                data[a // 2:b // 2] = copies[r][a // 2:b // 2]
    post_all_gather_processing(weights)
    compare(ctx, weights, reference(masters), "arbitrary-cuts")
    return digest([t for w in weights for t in (w.rowwise_data, w.rowwise_scale_inv, w.amax)])


def run(ctx) -> dict:
    digests = {case["name"]: run_layout_case(ctx, case) for case in cases()}
    for case in cases():
        digests[f"{case['name']}/sharded"] = run_sharded_case(ctx, case)
        ctx.check(digests[f"{case['name']}/sharded"] == digests[case["name"]],
                  f"{case['name']}: ShardedCast bytes differ from cast_master_weights_to_nvfp4")
    digests["arbitrary-cuts"] = run_arbitrary_cuts(ctx)
    if ctx.world_size > 1:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, digests)
        ctx.check(all(d == digests for d in everyone), "ranks disagree on the gathered bytes")
    return {"digests": digests, "cases": len(digests)}
