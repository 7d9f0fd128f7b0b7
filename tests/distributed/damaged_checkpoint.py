"""A Zero1Optimizer checkpoint saved, then loaded after the test damaged one of its files (a plain script).

    torchrun --nproc_per_node 2 damaged_checkpoint.py --mode save --dir CKPT/step_00000002 --out save.json
    torchrun --nproc_per_node 2 damaged_checkpoint.py --mode load --dir CKPT/step_00000002 --out load.json

save: zero1_checkpoint.py's model trains 2 steps and saves with `fp4_dist.optim.save_checkpoint` (committed with its
manifest). load: a fresh model (another seed) tries both loaders, `fp4_dist.optim.load_checkpoint` and
`fp4_dist.checkpoint.load_distributed_checkpoint`; each rank records what each raised and whether its fp32 masters
and Adam state are still the fresh ones (nothing loaded), in ``OUT.<rank>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from zero1_checkpoint import build, digests, train  # noqa: E402

from fp4_dist.checkpoint import load_distributed_checkpoint  # noqa: E402
from fp4_dist.launch import init_distributed, shutdown  # noqa: E402
from fp4_dist.optim import load_checkpoint, save_checkpoint  # noqa: E402
from fp4_dist.optim.zero1_state import sharded_state_dict  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    info = init_distributed("gloo")
    record = {}
    if args.mode == "save":
        model, opt = build(seed=0, bucket_numel=3000)
        train(model, opt, 2, info.rank)
        save_checkpoint(opt, args.dir)
        record["saved"] = digests(opt)
    else:
        model, opt = build(seed=1, bucket_numel=3000)
        train(model, opt, 1, info.rank)  # Adam state to compare with
        fresh = digests(opt)
        for name, load in (("zero1", lambda: load_checkpoint(opt, args.dir, verify=not args.no_verify)),
                           ("dcp", lambda: load_distributed_checkpoint({"optimizer": sharded_state_dict(opt)},
                                                                       args.dir, verify=not args.no_verify))):
            try:
                load()
                record[name] = {"error": None}
            except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
                record[name] = {"error": f"{type(e).__name__}: {e}"}
            record[name]["unchanged"] = digests(opt) == fresh
            record[name]["state"] = digests(opt)
    with open(f"{args.out}.{info.rank}", "w") as f:
        json.dump(record, f)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
