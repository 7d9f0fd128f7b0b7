"""A training run that checkpoints and resumes the way docs/zero.md and docs/fsdp2.md show it, for the
killed-rank tests (a plain script under torchrun).

    torchrun --nproc_per_node 2 killed_rank_run.py --trainer zero1|fsdp2 --ckpt ROOT --steps N --save-every K \\
        --out RECORD

On start it resumes from `fp4_dist.checkpoint.latest_complete_checkpoint(ROOT)` (none: from the initial
weights), trains to N steps and saves after every K-th into ``ROOT/step_<n>`` with `fp4_dist.checkpoint.save`
(Zero1: `fp4_dist.optim.save_checkpoint`). Batches depend only on the step and the rank, so a resumed run must
continue exactly as the uninterrupted one. After every step rank 0 rewrites RECORD: the checkpoint it resumed
from, what was skipped, the loss of every step; at the end the digests of the full fp32 masters, the optimizer
state and the gathered NVFP4 bytes, and the events of every phase per rank (`kill_switch`, which kills a rank
where FP4_DIST_TEST_KILL says).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fp4_dist.checkpoint import atomic  # noqa: E402
from fp4_dist.checkpoint import latest_complete_checkpoint, step_folder  # noqa: E402
from fp4_dist.launch import init_distributed, shutdown  # noqa: E402
from kill_switch import KillSwitch  # noqa: E402

FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax")


def sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Zero1Run:
    """zero1_checkpoint.py's model and Adam under Zero1Optimizer."""

    def __init__(self, rank: int):
        from zero1_checkpoint import build

        self.rank = rank
        self.model, self.opt = build(seed=0, bucket_numel=3000)

    def step(self, step: int) -> float:
        x = torch.randn(4, 48, generator=torch.Generator().manual_seed(100 * step + self.rank)).to(torch.bfloat16)
        loss = self.model(x).float().pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())

    def save(self, path) -> None:
        from fp4_dist.optim import save_checkpoint

        save_checkpoint(self.opt, path)

    def load(self, path) -> None:
        from fp4_dist.optim import load_checkpoint

        load_checkpoint(self.opt, path)

    def digests(self) -> dict:
        from zero1_checkpoint import digests

        d = digests(self.opt)  # every full master, Adam moment and step
        d["gathered"] = sha(getattr(w, f) for w in self.opt.nvfp4_params for f in FIELDS)
        return d


class FSDP2Run:
    """fsdp_suite.py's net under fully_shard_nvfp4 with AdamW; checkpoints of model and optimizer through
    get_state_dict / set_state_dict."""

    def __init__(self, rank: int):
        import fsdp_suite

        self.rank, self.suite = rank, fsdp_suite
        self.model, self.opt, _, _, _ = fsdp_suite.build(seed=0)

    def step(self, step: int) -> float:
        loss = self.suite.loss_of(self.model(self.suite.batch(step, self.rank).to(torch.bfloat16)))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())

    def save(self, path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import fp4_dist.checkpoint

        msd, osd = get_state_dict(self.model, self.opt)
        fp4_dist.checkpoint.save({"model": msd, "optim": osd}, path)

    def load(self, path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        import fp4_dist.checkpoint

        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optim": osd}
        fp4_dist.checkpoint.load_distributed_checkpoint(state, path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def digests(self) -> dict:
        d = self.suite.digest(self.suite.full_state(self.model, self.opt))  # every full master and AdamW state
        gathered = self.suite.Gathered(self.model)
        with torch.no_grad():  # one more forward: the bytes the next step would gather
            self.model(self.suite.batch(10**6, self.rank).to(torch.bfloat16))
        d["gathered"] = sha(gathered.seen[n][f] for n in sorted(gathered.seen) for f in FIELDS)
        return d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", choices=("zero1", "fsdp2"), required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = init_distributed("gloo")
    switch = KillSwitch(info.rank).install()
    run = (Zero1Run if args.trainer == "zero1" else FSDP2Run)(info.rank)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = latest_complete_checkpoint(args.ckpt)
    record = {"resumed_from": found.step if found else None, "skipped": found.skipped if found else [],
              "notes": [str(w.message) for w in caught if "fp4_dist" in str(w.message)], "losses": {}}
    start = 0
    if found is not None:
        run.load(found.path)
        start = found.step
    if info.rank == 0:
        atomic.write_file_atomically(args.out, json.dumps(record, indent=1))
    for step in range(start, args.steps):
        with switch.phase("step", step):
            record["losses"][str(step)] = run.step(step)
        if info.rank == 0:
            atomic.write_file_atomically(args.out, json.dumps(record, indent=1))
        if (step + 1) % args.save_every == 0:
            with switch.phase("save", step + 1):
                run.save(step_folder(args.ckpt, step + 1))
    record["digests"] = run.digests()
    counts = [None] * info.world_size
    dist.all_gather_object(counts, switch.counts)
    record["counts"] = counts
    if info.rank == 0:
        atomic.write_file_atomically(args.out, json.dumps(record, indent=1))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
