"""python -m fp4_dist.export megatron SAVE_DIR OUT_DIR [--iteration N] [--max-shard-bytes B]

Export the NVFP4 weights of a checkpoint written by fp4_dist's Megatron entry point (``--save SAVE_DIR``) as a
compressed-tensors checkpoint folder (docs/export.md), and print the report."""

from __future__ import annotations

import argparse
import sys

from .ct_format import DEFAULT_SHARD_BYTES
from .save import export_megatron_checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4_dist.export", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="source", required=True)
    meg = sub.add_parser("megatron", help="a Megatron checkpoint folder of fp4_dist's entry point")
    meg.add_argument("save_dir")
    meg.add_argument("out_dir")
    meg.add_argument("--iteration", type=int, default=None, help="default: the latest")
    meg.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    args = p.parse_args(argv)
    report = export_megatron_checkpoint(args.save_dir, args.out_dir, iteration=args.iteration,
                                        max_shard_bytes=args.max_shard_bytes)  # fmt: skip
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
