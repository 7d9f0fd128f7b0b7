"""python -m fp4_dist.megatron.pretrain_gpt with one rank failing mid-setup (the others go on into a collective).

    torchrun --nproc_per_node 3 megatron_fail_rank.py FAIL_RANK <pretrain_gpt arguments>

Rank FAIL_RANK raises inside `setup` (as a missing file or a bad shard would); the claim tested is the entry
point's: that rank prints its cause, prefixed with its rank, and the job exits non-zero promptly instead of
the other ranks hanging in their next collective.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples import megatron_pretrain_gpt as pretrain_gpt  # noqa: E402

FAIL_RANK = int(sys.argv.pop(1))
real_build = pretrain_gpt.build


def build(args, device):
    out = real_build(args, device)
    if int(os.environ["RANK"]) == FAIL_RANK:
        raise FileNotFoundError(f"injected failure on rank {FAIL_RANK}: no such file data/shard_{FAIL_RANK}.bin")
    return out


pretrain_gpt.build = build
sys.exit(pretrain_gpt._cli())
