#!/usr/bin/env bash
# Megatron-Core --fp4-param-gather on 2 GPUs with NCCL, in one command (device kind nvidia-h200-x2):
#   bash bench/megatron_gpu.sh                  # GPT hidden 256 x 4 layers, 200 steps; results under ${OUT:-bench/out}
#   NPROC=1 bash bench/megatron_gpu.sh --model gpt2048 --steps 30   # GPT hidden 2048 x 8 layers on one GPU
#   CPU=1 bash bench/megatron_gpu.sh            # the same on 2 CPU ranks (gloo) with a tiny model, 20 steps
# Runs bench/megatron_compare.py under torchrun: fp4 param gather vs bf16 gather (loss within 1e-2 at every
# step), fp4 vs the fake-quant reference (bitwise), fp4 twice (bitwise), gathered bytes == quantize(master),
# median step time against plain bf16 (limit 1.05x on GPUs), DDP param-buffer and compute-copy bytes; prints a
# table and exits non-zero on any FAIL.
# Extra arguments go to megatron_compare.py (e.g. --steps 50, or `-- --overlap-param-gather --overlap-grad-reduce`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
NPROC=${NPROC:-2}
size=()
if [[ "${CPU:-0}" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  size=(--tiny --steps "${STEPS:-20}" --check-every 5 --log-interval 10)
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" | tee "$OUT/megatron_device.txt"
"$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" bench/megatron_compare.py \
  "${size[@]}" --json "$OUT/megatron_compare.json" "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e 'c10d_logger' | tee "$OUT/megatron_compare.log"
exit "${PIPESTATUS[0]}"
