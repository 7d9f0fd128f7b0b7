"""Megatron-Core --fp4-param-gather on CPU ranks (gloo): a plain script, launched by test_megatron.py.

    torchrun --nproc-per-node N tests/distributed/megatron_suite.py --out report.json [--suites a,b,...]

Every suite drives megatron-core's real GPTModel / DDP / DistributedOptimizer through
fp4_dist.megatron.pretrain_gpt on a tiny GPT whose linear weights hit upstream's packed-layout bug at
data-parallel sizes 2, 3 and 4 (hidden 48, 4 heads of 12 channels, 1 KV group, ffn 64: qkv [72, 48],
proj [48, 48], fc1 [64, 48], fc2 [48, 64]).

  parity    after every step, every rank's gathered NVFP4 bytes (rowwise, scales, amax, columnwise) equal
            quantize(full fp32 master); the real buffers' packed layout has no stale byte; no weight keeps its
            bf16 init value past setup; overlap of the param gather and grad reduce off, then on with several
            buckets and bf16 first/last layers.
  upstream  the same with megatron-core's own packed layout: stale bytes in the buffers, and the step-1 check
            fails (the bug this integration fixes, reproduced with Megatron's code).
  resume    N steps + save + load + M steps == N + M steps: losses, fp32 masters, Adam state, NVFP4 bytes.
  lean      the default, lean compute (copies only around each use), trains bit for bit like --fp4-compute-copy.
  fake      an --fp4-param-gather run (overlap on) equals the bf16-weight fake-quant run bit for bit. Two ranks
            only: with three or more, the fp32 sum in the grad reduce-scatter depends on where an element
            sits in the bucket, and an NVFP4 model lays its buffers out differently from a bf16 one, so
            last-bit differences are expected there (the NVFP4 bytes still equal quantize(master)).

Rank 0 writes a JSON report: per-suite results and every rank's failures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402
from fp4_dist.launch import shutdown  # noqa: E402
from fp4_dist.megatron.parity import stale_packed_bytes  # noqa: E402
from fp4_dist.testing import bytes_mismatch  # noqa: E402

TINY = ("--num-layers 1 --hidden-size 48 --num-attention-heads 4 --group-query-attention --num-query-groups 1 "
        "--kv-channels 12 --ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
        "--lr 2e-3 --bf16 --use-distributed-optimizer --log-interval 1000 --seed 7").split()
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "3000"]


class Suite:
    def __init__(self, name: str, corpus: str):
        self.name, self.corpus, self.failures, self.results = name, corpus, [], {}

    def check(self, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append(f"[{self.name}] rank {dist.get_rank()}: {message}")
        return ok

    def argv(self, *extra: str, gbs: int | None = None) -> list[str]:
        gbs = gbs or 2 * dist.get_world_size()
        return TINY + ["--global-batch-size", str(gbs), "--fp4-corpus", self.corpus, *extra]


def run_session(argv: list[str]):
    s = pretrain_gpt.setup(argv)
    return s, pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, s.start_iteration)


def nvfp4_buffers(model) -> list:
    return [b for b in model.buffers if getattr(b, "has_nvfp4_params", False)]


def suite_parity(t: Suite) -> None:
    variants = {"no-overlap": [], "overlap-buckets-bf16-ends": OVERLAP + ["--num-layers", "3",
                                                                           "--first-last-layers-bf16"]}
    for name, extra in variants.items():
        s, result = run_session(t.argv("--fp4-param-gather", "--fp4-check-every", "1", "--train-iters", "3", *extra))
        checks = [r.parity or "missing" for r in result.records]
        t.check(len(checks) == 3 and all(c.startswith("ok") for c in checks), f"{name}: {checks}")
        bufs = nvfp4_buffers(s.model)
        stale = sum(stale_packed_bytes(b) for b in bufs)
        t.check(bool(bufs) and stale == 0, f"{name}: {len(bufs)} NVFP4 buffers, {stale} stale bytes")
        t.check(result.nvfp4_weights == 4, f"{name}: {result.nvfp4_weights} NVFP4 weights, expected 4")
        # The bf16 init values serve the masters' construction only: a weight owned whole by another rank keeps
        # none either (upstream clears only the ones its rank owns a piece of).
        held = [n for n, p in s.model.module.named_parameters() if "_fp4_dist_init_value" in p.__dict__]
        t.check(not held, f"{name}: NVFP4 weights still holding their bf16 init value after setup: {held}")
        t.check(all(l == l for l in result.losses), f"{name}: non-finite loss {result.losses}")
        t.results[name] = {"checks": checks, "buckets": sum(len(b.buckets) for b in bufs),
                           "losses": result.losses}


def suite_upstream(t: Suite) -> None:
    try:
        s = pretrain_gpt.setup(t.argv("--fp4-param-gather", "--fp4-check-every", "1", "--train-iters", "2",
                                      "--fp4-upstream-layout"))
        stale = sum(stale_packed_bytes(b) for b in nvfp4_buffers(s.model))
        pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, 0)
        error = None
    except RuntimeError as e:
        error = str(e)
    t.check(stale > 0, f"upstream layout: expected stale bytes in the NVFP4 buffer, found {stale}")
    t.check(error is not None and "differ from quantize(master)" in error,
            f"upstream layout: the step-1 check should fail, got {error!r}")
    t.results = {"stale_bytes": stale, "error": (error or "")[:300]}


def _load(path: Path):
    return torch.load(path, weights_only=True)


def _walk(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, f"{prefix}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _walk(v, f"{prefix}/{i}")
    elif isinstance(x, torch.Tensor):
        yield prefix, x


def suite_resume(t: Suite, root: Path) -> None:
    common = t.argv("--fp4-param-gather", "--train-iters", "6", "--save-interval", "1000", *OVERLAP)
    whole = pretrain_gpt.main(common + ["--save", str(root / "whole")])
    first = pretrain_gpt.main(common + ["--exit-interval", "3", "--save", str(root / "half")])
    second = pretrain_gpt.main(common + ["--load", str(root / "half"), "--save", str(root / "resumed")])
    t.check(whole.losses == first.losses + second.losses,
            f"losses differ: {whole.losses} vs {first.losses} + {second.losses}")
    t.check(second.start_iteration == 3, f"resumed at {second.start_iteration}, expected 3")
    if dist.get_rank() == 0:
        for name in ("model.pt", "distrib_optim.pt", "common.pt"):
            a = dict(_walk(_load(root / "whole" / "iter_0000006" / name)))
            b = dict(_walk(_load(root / "resumed" / "iter_0000006" / name)))
            t.check(a.keys() == b.keys(), f"{name}: different entries")
            if name == "common.pt":  # step counts, LR schedule, param groups: everything but tensors
                plain = [json.dumps({k: v for k, v in _load(root / d / "iter_0000006" / name).items()
                                     if k != "config"}, default=str, sort_keys=True) for d in ("whole", "resumed")]
                t.check(plain[0] == plain[1], "common.pt: optimizer / scheduler state differs")
            bad = [m for k in a.keys() & b.keys() if (m := bytes_mismatch(a[k], b[k], f"{name}{k}"))]
            t.check(not bad, f"{name}: {bad[:3]}")
            t.results[name] = len(a)
    t.results["losses"] = whole.losses


def suite_reshard_save(t: Suite, ckpt: Path) -> None:
    """Train 3 of 6 steps, save, and record the digest of every full fp32 master (world-size independent)."""
    r = pretrain_gpt.main(t.argv("--fp4-param-gather", "--train-iters", "6", "--exit-interval", "3",
                                 "--save", str(ckpt), "--save-interval", "1000", "--fp4-master-digest", gbs=24))
    t.results = {"digest": r.master_digest, "world_size": dist.get_world_size()}


def suite_reshard_load(t: Suite, ckpt: Path) -> None:
    """Load that checkpoint at this world size: masters bit for bit (digest), the re-cast NVFP4 weights equal
    the saved ones (load_checkpoint checks model.pt) and quantize(full master); the next steps run."""
    from fp4_dist.megatron.parity import master_digest

    s = pretrain_gpt.setup(t.argv("--fp4-param-gather", "--train-iters", "6", "--load", str(ckpt),
                                  "--fp4-check-every", "1", gbs=24))
    t.results = {"digest": master_digest(s.model.module, s.optimizer), "start": s.start_iteration}
    r = pretrain_gpt.train(s.args, s.model, s.optimizer, s.scheduler, s.device, s.start_iteration)
    checks = [x.parity or "missing" for x in r.records]
    t.check(len(checks) == 3 and all(c.startswith("ok") for c in checks), f"after the load: {checks}")


def suite_fake(t: Suite) -> None:
    common = t.argv("--train-iters", "4", "--clip-grad", "0", "--fp4-master-digest")
    fp4 = pretrain_gpt.main(common + ["--fp4-param-gather", *OVERLAP])
    fake = pretrain_gpt.main(common + ["--fp4-fake-quant"])
    t.check(fp4.losses == fake.losses, f"losses: fp4 {fp4.losses} vs fake-quant {fake.losses}")
    t.check(fp4.master_digest == fake.master_digest, "fp32 masters differ between fp4 and fake-quant")
    t.results = {"losses": fp4.losses, "digest": fp4.master_digest}


def suite_lean(t: Suite) -> None:
    """The default, lean compute (a copy only around each use, fp4_dist.compute.lean), trains bitwise like kept copies
    (--fp4-compute-copy), with the param-gather and grad-reduce overlap on and two microbatches per step; so does a
    pool two layers deep (--fp4-lean-depth 2), which makes fewer copies."""
    from fp4_dist.compute import pool_stats

    common = t.argv("--fp4-param-gather", "--train-iters", "4", "--fp4-master-digest", *OVERLAP, "--num-layers", "2",
                    gbs=4 * dist.get_world_size())  # fmt: skip
    kept = pretrain_gpt.main(common + ["--fp4-compute-copy"])
    copies = {}
    for name, extra in (("lean", []), ("deep", ["--fp4-lean-depth", "2"])):
        before = pool_stats()["copies"]
        run = pretrain_gpt.main(common + extra)
        copies[name] = pool_stats()["copies"] - before
        t.check(kept.losses == run.losses, f"losses: kept copies {kept.losses} vs {name} {run.losses}")
        t.check(kept.master_digest == run.master_digest, f"fp32 masters differ between kept copies and {name}")
        if name == "lean":
            lean = run
    t.check(copies["deep"] < copies["lean"], f"copies made: {copies}")
    t.results = {"losses": lean.losses, "compute_copy_bytes": lean.compute_copy_bytes, "copies": copies}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--suites", default="parity,upstream,resume,fake")
    p.add_argument("--corpus", default=None, help="text corpus (default: a generated one)")
    p.add_argument("--ckpt", default=None, help="checkpoint folder of the reshard_save / reshard_load suites")
    opts = p.parse_args()
    dist.init_process_group("gloo")
    tmp = Path(tempfile.mkdtemp(prefix="fp4_megatron_")) if dist.get_rank() == 0 else None
    shared = [str(tmp) if tmp else None]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    corpus = opts.corpus or str(root / "corpus.txt")
    if not opts.corpus and dist.get_rank() == 0:
        words = "the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak trees".split()
        g = torch.Generator().manual_seed(0)
        picks = torch.randint(0, len(words), (6000,), generator=g).tolist()
        (root / "corpus.txt").write_text(" ".join(words[i] for i in picks) + ".\n")
    dist.barrier()
    report = {"world_size": dist.get_world_size(), "suites": {}, "failures": []}
    for name in opts.suites.split(","):
        t = Suite(name, corpus)
        try:
            if name == "resume":
                suite_resume(t, root)
            elif name.startswith("reshard"):
                (suite_reshard_save if name == "reshard_save" else suite_reshard_load)(t, Path(opts.ckpt))
            else:
                {"parity": suite_parity, "upstream": suite_upstream, "fake": suite_fake, "lean": suite_lean}[name](t)
        except Exception:  # a crash is a failure of this suite, not of the report
            t.failures.append(f"[{name}] rank {dist.get_rank()}: crashed:\n{traceback.format_exc()[-3000:]}")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, t.failures)
        report["failures"] += [f for fs in gathered for f in fs]
        report["suites"][name] = t.results
    if dist.get_rank() == 0:
        Path(opts.out).write_text(json.dumps(report, indent=1, default=str))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
