#!/usr/bin/env bash
# The main job: a small language model trained with NVFP4 param gather under ZeRO-1.
# 2 CPU ranks (gloo) by default; one rank per GPU (NCCL) when CUDA devices are present.
# Options go to the training script (--help lists them); NPROC overrides the number of ranks.
set -euo pipefail
# Relative --data and --save paths are the caller's: the trainer resolves them against this folder.
export FP4_DIST_CALLER_DIR=${FP4_DIST_CALLER_DIR:-$PWD}
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
# The options are parsed once here, before any rank starts: a mistyped one ends the script with one usage error and
# exit status 2 (under torchrun every rank would print it, and torchrun a traceback of its own); --help prints once.
# The same process counts the GPUs.
ngpu=$(.venv/bin/python -c '
import sys
sys.argv[0] = "train.sh"  # the name argparse gives in its usage and error lines
from examples.train_lm import parse_args
parse_args()
import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' "$@")
if [[ ! "$ngpu" =~ ^[0-9]+$ ]]; then  # --help: argparse printed the options instead of a count, and exited 0
  printf '%s\n' "$ngpu"
  exit 0
fi
nproc=${NPROC:-$([[ "$ngpu" -gt 0 ]] && echo "$ngpu" || echo 2)}
if [[ ! "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "train.sh: NPROC is a number of ranks, 1 or more; got '$nproc'" >&2
  exit 2
fi
exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" -m examples.train_lm "$@"
