#!/usr/bin/env bash
# The main job: a small language model trained with NVFP4 param gather under ZeRO-1.
# 2 CPU ranks (gloo) by default; one rank per GPU (NCCL) when CUDA devices are present.
# Options go to the training script (--help lists them); NPROC overrides the number of ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # once, not once per rank
  exec .venv/bin/python -m examples.train_lm --help
fi
ngpu=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
nproc=${NPROC:-$([[ "$ngpu" -gt 0 ]] && echo "$ngpu" || echo 2)}
exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" -m examples.train_lm "$@"
