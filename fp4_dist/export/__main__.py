"""python -m fp4_dist.export megatron SAVE_DIR OUT_DIR [--iteration N] [--max-shard-bytes B] [--trust-checkpoint]
                                   [--no-verify]

Export the NVFP4 weights of a Megatron checkpoint (written with --save SAVE_DIR --ckpt-format torch by a run through
fp4_dist.megatron.run or the example trainer) as a compressed-tensors checkpoint folder under Megatron's parameter
names, and print the report. There is no architecture mapping: fp4_dist.export.load_compressed_tensors loads the
folder into a Megatron GPTModel with NVFP4 weights; transformers and vLLM do not (docs/export.md)."""

from __future__ import annotations

import argparse
import sys

from .ct_format import DEFAULT_SHARD_BYTES
from .save import export_megatron_checkpoint


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4_dist.export", usage="%(prog)s SOURCE ...",
                                description=__doc__.split("\n\n")[1])  # fmt: skip
    sub = p.add_subparsers(dest="source", required=True, metavar="SOURCE",
                           help="what wrote the checkpoint; `megatron`: a Megatron checkpoint folder")  # fmt: skip
    meg = sub.add_parser("megatron", prog="python -m fp4_dist.export megatron", description=__doc__.split("\n\n")[1],
                         help="a Megatron checkpoint folder (--save of a Megatron run with fp4_dist)")  # fmt: skip
    meg.add_argument("save_dir", metavar="SAVE_DIR", help="the run's --save folder (holds "
                     "latest_checkpointed_iteration.txt and iter_*/ folders)")
    meg.add_argument("out_dir", metavar="OUT_DIR", help="the compressed-tensors folder to write (created if missing; "
                     "an export already there is replaced whole, atomically)")
    meg.add_argument("--iteration", type=int, default=None, metavar="N",
                     help="the iteration to export (default: the latest)")
    meg.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, metavar="B",
                     help=f"largest safetensors shard in bytes (default {DEFAULT_SHARD_BYTES})")
    meg.add_argument("--trust-checkpoint", action="store_true",
                     help="unpickle the checkpoint in full, which runs any code stored in it: only for a checkpoint "
                     "you made or whose source you trust (default: read weights-only, and refuse a file that holds "
                     "anything but tensors, NVFP4 weights and what Megatron's own loader allows)")
    meg.add_argument("--no-verify", action="store_true",
                     help="read the checkpoint without checking its files against its manifest (default: a file "
                     "whose bytes differ from the digest written with it is refused, naming it)")
    args = p.parse_args(argv)
    try:
        report = export_megatron_checkpoint(args.save_dir, args.out_dir, iteration=args.iteration,
                                            max_shard_bytes=args.max_shard_bytes, trusted=args.trust_checkpoint,
                                            verify=not args.no_verify)
    except (ValueError, FileNotFoundError) as e:  # refusals (UnsafeCheckpointError among them) and missing folders
        p.exit(1, f"python -m fp4_dist.export: {e}\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
