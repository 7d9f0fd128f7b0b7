"""Bad input in a multi-rank cast: every rank raises (no hang), and no weight, scale or amax changes anywhere.

* odd boundary on every rank            -> ValueError naming the weight on every rank
* one rank's master has the wrong dtype -> TypeError there, RuntimeError naming that rank elsewhere
* one rank's master has a NaN           -> ValueError naming the weight on every rank (the reduced amax is inf)
* a master shard that does not match the buffer layout -> ShardBuffer.check_shards raises naming the weight
* a malformed call on the last rank only (one master too few, master_weights=None, start_offsets=None, a plain
  bf16 tensor among the weights) -> a named error there, RuntimeError naming that rank everywhere else, within
  the collective's round trip (the bad rank joins the all-reduce with its error flag instead of raising first)
Afterwards a good cast on the same group still works and matches quantize (the group is not wedged).
"""

from __future__ import annotations

import torch

import fp4_dist
from fp4_dist.buffers import ShardBuffer, build_layout
from fp4_dist.cast import cast_master_weights_to_nvfp4

from _harness import fp32_generator
from suite_cast import poisoned

SHAPES = [(40, 48), (33, 80)]
FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


def masters(device):
    g = fp32_generator(5)
    return [torch.randn(m * k, generator=g).to(device) for m, k in SHAPES]


def layout_shards(ctx, full):
    buf = ShardBuffer(build_layout([m * k for m, k in SHAPES], ctx.world_size, align=2), ctx.rank, packed=True,
                      device=ctx.device)
    for i, piece in enumerate(buf.pieces):
        if piece is not None:
            buf.master_piece(i).copy_(full[i][piece.span.start:piece.span.end])
    return buf


def expect_error(ctx, label, weights, shards, starts, want, call_weights=None):
    """Run the cast, expect `want` = {exception type: text in message}; check nothing changed.

    ``call_weights``: what this rank passes as model_weights (default ``weights``)."""
    before = [{f: getattr(w, f).clone() for f in FIELDS} for w in weights]
    try:
        cast_master_weights_to_nvfp4(weights if call_weights is None else call_weights, shards, starts)
        ctx.check(False, f"{label}: no error raised")
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        text = want.get(type(e))
        ctx.check(text is not None and text in str(e), f"{label}: got {type(e).__name__}: {e}")
    for i, (w, snap) in enumerate(zip(weights, before)):
        for f in FIELDS:
            ctx.same_bytes(getattr(w, f), snap[f], f"{label}: weight {i} {f} changed")


def run(ctx) -> dict:
    full = masters(ctx.device)
    buf = layout_shards(ctx, full)
    shards, starts = buf.master_pieces(), buf.start_offsets()
    weights = poisoned(SHAPES, ctx.device)
    n0 = SHAPES[0][0] * SHAPES[0][1]
    r, ws = ctx.rank, ctx.world_size

    # Odd boundaries: rank r owns [odd_r, odd_{r+1}) of weight 0 with interior cuts at odd elements.
    bounds = [0] + [n0 * j // ws | 1 for j in range(1, ws)] + [n0]
    odd = [full[0][bounds[r]:bounds[r + 1]], shards[1]]
    if ws > 1:
        expect_error(ctx, "odd boundary", weights, odd, [bounds[r], starts[1]],
                     {ValueError: "model_weights[0] (40x48)", RuntimeError: "rejected"})

    bad_dtype = [s.double() if (r == ws - 1 and s is not None) else s for s in shards]
    expect_error(ctx, "wrong dtype on the last rank", weights, bad_dtype, starts,
                 {TypeError: "fp32", RuntimeError: f"rank(s) [{ws - 1}]"})

    nan = [s.clone() if s is not None else None for s in shards]
    if r == ws - 1 and nan[1] is not None:
        nan[1][-1] = float("nan")
    expect_error(ctx, "NaN on the last rank", weights, nan, starts, {ValueError: "model_weights[1] (33x80)"})

    last = r == ws - 1
    others = {RuntimeError: f"rank(s) [{ws - 1}]"}
    expect_error(ctx, "one master too few on the last rank", weights, shards[:-1] if last else shards, starts,
                 {ValueError: "master_weights", **others} if last else others)
    expect_error(ctx, "master_weights=None on the last rank", weights, None if last else shards, starts,
                 {TypeError: "master_weights must be a list", **others} if last else others)
    expect_error(ctx, "start_offsets=None on the last rank", weights, shards, None if last else starts,
                 {TypeError: "start_offsets must be a list", **others} if last else others)
    plain = [weights[0].dequantize(torch.bfloat16), weights[1]] if last else weights
    expect_error(ctx, "a plain tensor among the weights on the last rank", weights, shards, starts,
                 {TypeError: "model_weights[0] is a Tensor", **others} if last else others, call_weights=plain)

    wrong_len = [s[:-2] if s is not None and s.numel() > 2 else s for s in shards]
    try:
        buf.check_shards(wrong_len, starts, names=["w0", "w1"])
        ctx.check(all(s is None or s.numel() <= 2 for s in shards), "layout mismatch not detected")
    except ValueError as e:
        ctx.check("does not match" not in str(e) and "buffer layout assigns" in str(e), f"layout mismatch: {e}")

    cast_master_weights_to_nvfp4(weights, shards, starts)  # the group still works after the errors
    for i, (w, m) in enumerate(zip(weights, full)):
        ref = fp4_dist.quantize(m.view(SHAPES[i]).cpu())
        ctx.same_bytes(w.amax, ref.amax, f"after errors: weight {i} amax")
        ctx.same_bytes(w.rowwise_scale_inv, ref.rowwise_scale_inv, f"after errors: weight {i} scales")
    return {"cases": 8}
