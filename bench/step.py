"""One optimizer step's NVFP4 weight path, stage by stage, against its byte floor and three baselines.

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/step.py --out DIR   # NCCL, 2 GPUs (about 2 minutes)
    PYTHONPATH=. python bench/step.py --out DIR                        # one GPU (collectives are local no-ops)
    PYTHONPATH=. python bench/step.py --tiny --no-compile-baseline     # CPU smoke test (also under torchrun)

Weights: the linear weights of a GPT (per layer qkv [3h, h], proj [h, h], fc1 [4h, h], fc2 [h, 4h]) with hidden
2048 x 24 layers and hidden 4096 x 32 layers (the 8B class), laid out as Zero1Optimizer does (40M-element
buckets, align 64), random fp32 masters. Our path is `ShardedCast` (Zero1Optimizer's cast):

    partial_amax | amax all-reduce (tensor + cut-tile amaxes, check, scatter back) | scales (owner_scales) |
    partial_cast | byte all-gather (per bucket) + compact scale all-gather | expand scales |
    compute copies (one dequantize launch: the bf16 values every forward and backward use)
    [| transposes (columnwise copies; only with --columnwise, Zero1Optimizer's default is off)]

Each stage is timed alone and the whole step in one piece: device events, median of --reps runs after warm-up.
Compared in the same run with
  (a) the byte floor: minimal device bytes (spec section 5) / measured copy bandwidth + all-gather bytes /
      measured all-gather bandwidth;
  (b) Megatron's default bf16 param gather: fp32 -> bf16 copy of the shard + 2-byte all-gather per bucket
      (which also ends with bf16 weights to compute on);
  (c) the same kernels launched one tensor at a time (as TransformerEngine loops), with its full exchange of
      every tile amax (one all-reduce here; TE issues two), compute copies one weight at a time too;
  (d) the PyTorch reference quantizer under torch.compile (a speed baseline only: compiled code may give
      other bytes), timed on one layer's weights and scaled to the rank's share of all layers.
Also: all-gather bytes vs bf16, amax all-reduce payload vs TE's scheme, stage launches per step (for each list
and for 1,000 weights) and host time per step for 1,000 weights. Rank 0 prints the tables (final table last)
and writes step.md, step.json and step.png (time per stage) to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import fp4_dist.kernels as K
from fp4_dist.buffers.layout import build_layout
from fp4_dist.format import columnwise_scale_shape, num_tiles, rowwise_scale_shape
from fp4_dist.kernels import _launch
from fp4_dist.kernels import reference as R
from fp4_dist.launch import init_distributed
from fp4_dist.cast.master_weights import cast_master_weights_to_nvfp4
from fp4_dist.cast.collectives import CommStats, all_gather_inplace, all_reduce_max_
from fp4_dist.cast.sharded import ShardedCast
from fp4_dist.tensor import NVFP4Tensor
from timing import median_ms, publish  # noqa: E402 - bench/timing.py, beside this script

MODELS = {"gpt-h2048-l24": (2048, 24), "gpt-h4096-l32": (4096, 32)}
TINY = {"tiny-h64-l2": (64, 2), "tiny-h96-l3": (96, 3)}
BUCKET = 40_000_000


def linear_shapes(hidden: int, layers: int) -> list[tuple[int, int]]:
    h = hidden
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)] * layers


# ------------------------------------------------------------------------------------------------ timing
class Clock:
    """Median time of a callable: CUDA events on a GPU, perf_counter (after a sync) elsewhere."""

    def __init__(self, device: torch.device, reps: int):
        self.cuda, self.reps = device.type == "cuda", reps

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn, reps: int | None = None, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        return median_ms(fn, reps or self.reps, warmup=0)

    def host_ms(self, fn, reps: int | None = None) -> float:
        """Median wall time of the Python call itself (it may include the one device sync of a step)."""
        fn()
        self.sync()
        times = []
        for _ in range(reps or self.reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        self.sync()
        return statistics.median(times)


def copy_bandwidth(clock: Clock, device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / clock.ms(lambda: dst.copy_(src), 10) / 1e6  # GB/s, read + write


def all_gather_bandwidth(clock: Clock, device, nbytes: int, world: int) -> float:
    """GB/s of output bytes for an in-place uint8 all-gather of `nbytes` (0 on one rank)."""
    if world == 1:
        return 0.0
    buf = torch.zeros(nbytes - nbytes % world, dtype=torch.uint8, device=device)
    return buf.numel() / clock.ms(lambda: all_gather_inplace(buf), 10) / 1e6


# ------------------------------------------------------------------------------------------------ setup
@dataclass
class Model:
    """One weight list on this rank: the packed gather buffer, fp32 master shard, NVFP4 weights, ShardedCast."""

    name: str
    shapes: list
    rank: int
    world: int
    device: torch.device
    layout: object = None
    weights: list = field(default_factory=list)

    def build(self, bucket: int, columnwise: bool = False) -> "Model":
        numels = [m * k for m, k in self.shapes]
        self.layout = build_layout(numels, self.world, bucket_numel=bucket, align=64)
        self.param = torch.zeros(self.layout.total // 2, dtype=torch.uint8, device=self.device)
        self.master = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self.device)
        self.master.normal_(0.0, 0.02, generator=None)
        pieces = self.layout.pieces(self.rank)
        self.masters = [None if p is None else self.master[p.master_offset:p.master_offset + p.span.numel]
                        for p in pieces]  # fmt: skip
        self.starts = [None if p is None else p.span.start for p in pieces]
        for i, shape in enumerate(self.shapes):
            w = NVFP4Tensor.empty(shape, device=self.device)
            w.set_rowwise_storage(self.param[self.layout.weights[i].span.packed().start:
                                             self.layout.weights[i].span.packed().end])  # fmt: skip
            self.weights.append(w)
        self.cast = ShardedCast(self.weights, self.layout, self.rank, self.masters, self.starts,
                                columnwise=columnwise)
        self.columnwise = columnwise
        return self

    @property
    def shard_elements(self) -> int:
        return sum(0 if m is None else m.numel() for m in self.masters)

    @property
    def elements(self) -> int:
        return sum(m * k for m, k in self.shapes)

    def gather_data(self):
        for b in range(len(self.layout.buckets)):
            s = self.layout.buckets[b].span.packed()
            all_gather_inplace(self.param[s.start:s.end])

    def step(self, stats=None):
        self.cast.cast(stats=stats)
        self.cast.gather_scales(stats=stats)
        self.gather_data()
        self.cast.after_gather()


# ------------------------------------------------------------------------------------------------ our path
def time_our_stages(model: Model, clock: Clock) -> list[dict]:
    c = model.cast
    shard, total = model.shard_elements, model.elements
    tiles = sum(num_tiles(m, k) for m, k in model.shapes)
    scale_bytes = sum(rowwise_scale_shape(m, k)[0] * rowwise_scale_shape(m, k)[1] for m, k in model.shapes)
    col_scale_bytes = sum(columnwise_scale_shape(m, k)[0] * columnwise_scale_shape(m, k)[1] for m, k in model.shapes)
    gather_bytes = model.param.numel() + c.gathered.numel()
    rows = [
        ("partial_amax", c.local_amaxes, 4 * shard, "copy"),
        ("amax all-reduce", c.exchange_amaxes, c.message_bytes(), "reduce"),
        ("scales (owner)", c.owner_scales, 9 * tiles // model.world, "copy"),
        ("partial_cast", c.cast_shards, 4.5 * shard, "copy"),
        ("byte all-gather", lambda: (c.gather_scales(), model.gather_data()), gather_bytes, "gather"),
        ("expand scales", c.expand_scales, scale_bytes, "copy"),
        ("compute copies (dequantize)", c.refresh_compute_copies, 2.5 * total + scale_bytes, "copy"),
    ]
    if model.columnwise:
        rows.append(("transposes", c.columnwise, total + scale_bytes + col_scale_bytes, "copy"))
    out = []
    for name, fn, nbytes, bound_by in rows:
        with _launch.LaunchCounter() as lc:
            fn()
        out.append(dict(stage=name, ms=clock.ms(fn), bytes=nbytes, bound=bound_by, launches=lc.calls))
    return out


# ------------------------------------------------------------------------------------------------ baselines
def bf16_gather(model: Model):
    """(b): Megatron's default: each bucket's fp32 master shard -> bf16 param shard, then a 2-byte all-gather."""
    buf = torch.zeros(model.layout.total, dtype=torch.bfloat16, device=model.device)
    parts = []
    for b, bucket in enumerate(model.layout.buckets):
        off = model.layout.bucket_master_offset(b)
        shard = bucket.shard(model.rank)
        parts.append((buf[shard.start:shard.end], model.master[off:off + bucket.shard_numel],
                      buf[bucket.span.start:bucket.span.end]))  # fmt: skip

    def cast():
        for dst, src, _ in parts:
            dst.copy_(src)

    def gather():
        for _, _, full in parts:
            all_gather_inplace(full)

    return cast, gather, buf.numel() * 2


def per_tensor_path(model: Model):
    """(c): the same kernels bound one weight at a time (one launch per weight and stage), TE's full exchange."""
    shapes, n = model.shapes, len(model.shapes)
    sizes = [1 + num_tiles(m, k) for m, k in shapes]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=model.device)
    blocks, off = [], 0
    for s in sizes:
        blocks.append(flat[off:off + s])
        off += s
    amax, scale, cast, post = [], [], [], []
    for i, (w, shape) in enumerate(zip(model.weights, shapes)):
        shard, start = model.masters[i], model.starts[i] or 0
        frag = None if shard is None else w.rowwise_data.view(-1)[start >> 1:(start + shard.numel() + 1) >> 1]
        enc = torch.zeros(sizes[i] - 1, dtype=torch.float32, device=model.device)
        amax.append(K.bind_partial_amax([shard], [start], [shape], blocks[i]))
        scale.append(K.bind_fused_scale(blocks[i], [shape], [w.rowwise_scale_inv], [w.amax], enc))
        cast.append(K.bind_partial_cast([shard], [start], [shape], enc, [frag]))
        post.append(K.bind_dequantize([w.rowwise_data], [w.rowwise_scale_inv], [w.amax],
                                          [w._compute_copy.value]))  # fmt: skip
        if model.columnwise and shape[0] % 2 == 0:
            post.append(K.bind_nibble_transpose([w.rowwise_data], [w.columnwise_data]))
            post.append(K.bind_scale_transpose([w.rowwise_scale_inv], [w.columnwise_scale_inv], [shape]))

    def stages():
        for run in amax:
            run()
        all_reduce_max_(flat)
        bool(torch.isfinite(flat).all().item())
        for s, c in zip(scale, cast):
            s()
            c()

    def after():
        for run in post:
            run()

    return stages, after, flat.numel() * 4 + 4 * n


def compiled_reference(model: Model, clock: Clock):
    """(d): ms per step of torch.compile(reference.quantize) over one layer's weights, scaled to all layers / dp."""
    fn = torch.compile(R.quantize, dynamic=True)
    layer = model.shapes[:4]
    xs = [torch.randn(m, k, device=model.device) * 0.02 for m, k in layer]
    t0 = time.perf_counter()
    for x in xs:
        fn(x)
    clock.sync()
    compile_s = time.perf_counter() - t0
    ms = clock.ms(lambda: [fn(x) for x in xs], max(3, clock.reps // 4))
    return ms * (len(model.shapes) // 4) / model.world, compile_s


# ------------------------------------------------------------------------------------------------ host time
def thousand_weights(device, rank: int, world: int, clock: Clock, columnwise: bool) -> dict:
    """Host time and launches per step of ShardedCast and of cast_master_weights_to_nvfp4 for 1,000 weights."""
    g = torch.Generator().manual_seed(0)
    shapes = [(int(m), int(k)) for m, k in zip(torch.randint(1, 17, (1000,), generator=g) * 32,
                                                torch.randint(1, 17, (1000,), generator=g) * 64)]  # fmt: skip
    model = Model("1000 weights", shapes, rank, world, device).build(BUCKET, columnwise)
    with _launch.LaunchCounter() as lc:
        model.step()
    host = clock.host_ms(model.step)
    te_args = (model.weights, model.masters, model.starts)
    cast_master_weights_to_nvfp4(*te_args)
    te_host = clock.host_ms(lambda: cast_master_weights_to_nvfp4(*te_args))
    return dict(weights=1000, launches=lc.calls, host_ms_step=host, host_ms_te_cast=te_host,
                device_ms_step=clock.ms(model.step))  # fmt: skip


# ------------------------------------------------------------------------------------------------ report
def bench_model(name, shapes, info, clock, bw, args) -> dict:
    model = Model(name, shapes, info.rank, info.world_size, info.device).build(BUCKET, args.columnwise)
    stats = CommStats()
    model.step(stats)  # warm-up, and one step's collective payloads
    stages = time_our_stages(model, clock)
    whole = clock.ms(model.step)
    with _launch.LaunchCounter() as lc:
        model.step()
    n, tiles = len(shapes), sum(num_tiles(m, k) for m, k in shapes)
    b_cast, b_gather, b_bytes = bf16_gather(model)
    c_stages, c_after, c_payload = per_tensor_path(model)
    res = dict(model=name, weights=n, elements=model.elements, shard_elements=model.shard_elements, stages=stages,
               whole_ms=whole, launches=lc.calls, amax_payload=model.cast.message_bytes(),
               te_amax_payload=4 * (tiles + n), gather_bytes=model.param.numel() + model.cast.gathered.numel(),
               bf16_gather_bytes=b_bytes)  # fmt: skip
    res["bf16"] = dict(cast_ms=clock.ms(b_cast), gather_ms=clock.ms(b_gather),
                       whole_ms=clock.ms(lambda: (b_cast(), b_gather())))  # fmt: skip
    res["per_tensor"] = dict(
        cast_path_ms=clock.ms(c_stages), host_ms=clock.host_ms(c_stages, 5),
        whole_ms=clock.ms(lambda: (c_stages(), model.cast.gather_scales(), model.gather_data(), c_after())),
    )  # fmt: skip
    res["cast_path_ms"] = sum(s["ms"] for s in stages if s["stage"] in ("partial_amax", "scales (owner)", "partial_cast"))
    res["host_ms"] = clock.host_ms(model.step, 5)
    res["floor"] = floors(res, bw, model)
    if args.compile_baseline:
        try:
            ms, compile_s = compiled_reference(model, clock)
            res["compiled_ms"], res["compile_s"] = ms, compile_s
        except Exception as e:  # a baseline only: report, keep going
            res["compiled_error"] = f"{type(e).__name__}: {e}"[:200]
    del model
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def floors(res, bw, model) -> dict:
    shard, total = res["shard_elements"], res["elements"]
    cast_bytes = 8.5 * shard  # amax reads 4 B, cast reads 4 B and writes 0.5 B per owned element
    post_bytes = 2.5 * total  # compute copies: 0.5 B read + 2 B (bf16) written per element
    if model.columnwise:
        post_bytes += 1.0 * total  # nibble transpose: 0.5 B read + 0.5 B written per element
    out = dict(cast_path_ms=cast_bytes / bw["copy_gbs"] / 1e6, post_ms=post_bytes / bw["copy_gbs"] / 1e6)
    out["gather_ms"] = res["gather_bytes"] / bw["gather_gbs"] / 1e6 if bw["gather_gbs"] else 0.0
    out["step_ms"] = out["cast_path_ms"] + out["post_ms"] + out["gather_ms"]
    return out


def mb(nbytes) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.2f} KB"


def bound_gbs(row, bw) -> float:
    return {"copy": bw["copy_gbs"], "gather": bw["gather_gbs"]}.get(row["bound"], 0.0)


def render(results, bw, host, device_name, world) -> str:
    lines = [f"device: {device_name} x {world}; copy {bw['copy_gbs']:.0f} GB/s (read + write)"
             + (f"; all-gather {bw['gather_gbs']:.0f} GB/s (output bytes)" if world > 1 else "; 1 rank: "
                "collectives are local no-ops")]  # fmt: skip
    for r in results:
        lines += ["", f"### {r['model']}: {r['weights']} weights, {r['elements'] / 1e9:.2f}B elements, "
                      f"{r['shard_elements'] / 1e9:.2f}B on this rank (dp {world})", "",
                  "| stage | ms | min bytes | GB/s | % of bound | launches |", "|---|---|---|---|---|---|"]  # fmt: skip
        for s in r["stages"]:
            gbs = s["bytes"] / s["ms"] / 1e6 if s["ms"] > 0 else 0.0
            b = bound_gbs(s, bw)
            pct = f"{100 * gbs / b:.0f}% of {s['bound']}" if b else "-"
            lines.append(f"| {s['stage']} | {s['ms']:.3f} | {mb(s['bytes'])} | {gbs:.0f} | {pct} | {s['launches']} |")
        f = r["floor"]
        lines += [f"| **whole step** | **{r['whole_ms']:.3f}** | | | floor {f['step_ms']:.3f} ms "
                  f"({r['whole_ms'] / f['step_ms']:.2f}x) | {r['launches']} |", "",
                  f"- cast path (amax + scales + cast, no collectives): {r['cast_path_ms']:.3f} ms vs byte floor "
                  f"{f['cast_path_ms']:.3f} ms = **{r['cast_path_ms'] / f['cast_path_ms']:.2f}x** (goal <= 1.25x)",
                  f"- all-gather bytes {mb(r['gather_bytes'])} vs bf16 {mb(r['bf16_gather_bytes'])}"
                  f" = **{r['gather_bytes'] / r['bf16_gather_bytes']:.3f}x** (goal <= 0.29x)",
                  f"- amax all-reduce payload {mb(r['amax_payload'])} (1 all-reduce) vs TE's {mb(r['te_amax_payload'])}"
                  f" (2 all-reduces) = **{r['te_amax_payload'] / r['amax_payload']:.0f}x smaller** (goal >= 100x)",
                  f"- host time of a step (wall, incl. its one sync): {r['host_ms']:.3f} ms; per-tensor path (c) "
                  f"cast stages alone: {r['per_tensor']['host_ms']:.3f} ms"]  # fmt: skip
    lines += ["", f"1,000 weights: {host['launches']} stage launches per step (same as above: independent of the "
                  f"number of weights), host time per step {host['host_ms_step']:.3f} ms (wall, incl. its one sync; "
                  f"device {host['device_ms_step']:.3f} ms); cast_master_weights_to_nvfp4 (TE semantics, cached "
                  f"binding) {host['host_ms_te_cast']:.3f} ms", "",
              "### Final: whole weight path per step (ms) and speed-ups measured in this run", "",
              "| model | ours | (a) byte floor | (b) bf16 gather | (c) per-tensor launches | (d) torch.compile ref "
              "(est.) | ours vs (c) | ours vs (d) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        d, whole, c = r.get("compiled_ms"), r["whole_ms"], r["per_tensor"]["whole_ms"]
        d_ms = "-" if d is None else f"{d:.3f}"
        d_ratio = "-" if d is None else f"{(d + r['floor']['gather_ms']) / whole:.1f}x"
        lines.append(f"| {r['model']} | {whole:.3f} | {r['floor']['step_ms']:.3f} | {r['bf16']['whole_ms']:.3f} | "
                     f"{c:.3f} | {d_ms} | {c / whole:.2f}x | {d_ratio} |")
    lines += ["", "(d) is the compiled reference's cast time (amax + scales + cast of whole weights, one layer timed, "
              "scaled to this rank's share) plus the floor of the gather; it is a speed baseline only."]  # fmt: skip
    return "\n".join(lines)


def plot(results, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels = [s["stage"] for s in r["stages"]]
        ax.barh(labels[::-1], [s["ms"] for s in r["stages"]][::-1], color="tab:blue")
        ax.set_xlabel("ms per step (median)")
        ax.set_title(f"{r['model']}: step {r['whole_ms']:.2f} ms, floor {r['floor']['step_ms']:.2f} ms, "
                     f"bf16 {r['bf16']['whole_ms']:.2f} ms", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small models (CPU smoke test)")
    p.add_argument("--models", default=None, help="comma-separated subset of the model names")
    p.add_argument("--no-compile-baseline", dest="compile_baseline", action="store_false")
    p.add_argument("--columnwise", action="store_true", help="also build the columnwise copies every step")
    args = p.parse_args()
    info = init_distributed()
    clock = Clock(info.device, args.reps)
    models = TINY if args.tiny else MODELS
    if args.models:
        models = {k: v for k, v in models.items() if k in args.models.split(",")}
    size = (1 << 24) if args.tiny else (1 << 30)
    bw = dict(copy_gbs=copy_bandwidth(clock, info.device, size),
              gather_gbs=all_gather_bandwidth(clock, info.device, size, info.world_size))  # fmt: skip
    results = [bench_model(name, linear_shapes(*hl), info, clock, bw, args) for name, hl in models.items()]
    host = thousand_weights(info.device, info.rank, info.world_size, clock, args.columnwise)
    if info.rank == 0:
        name = torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"
        text = render(results, bw, host, name, info.world_size)
        if args.out:
            print(plot(results, os.path.join(args.out, "step.png")))
        publish(text, args.out, "step", dict(device=name, world=info.world_size, bw=bw, results=results, host=host))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
