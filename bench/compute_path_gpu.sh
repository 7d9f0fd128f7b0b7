#!/usr/bin/env bash
# The compute-path measurements on a GPU machine, in one command (results and logs under ${OUT:-bench/out}):
#   bash bench/compute_path_gpu.sh                          # every part below
#   PARTS="linear megatron-dp1" bash bench/compute_path_gpu.sh
# Parts:
#   tests          GPU unit tests: every CUDA kernel bit-exact against the reference (dequantize included)
#   kernels        bench/kernels.py: each stage against the device copy bandwidth, 1,000-weight launches/host time
#   linear         bench/linear.py: a linear layer's forward + backward with an NVFP4 weight vs bf16
#   megatron-dp1   bench/megatron_compare.py on one GPU, GPT hidden 256 x 4 layers and 2048 x 8 layers (seq 1024):
#                  --fp4-param-gather vs plain bf16 paired (the two models in alternating steps, $GPT256_PAIRED /
#                  $GPT2048_PAIRED steps each: the step-time verdict), in ABBA rounds ($ROUNDS, default 1: information,
#                  determinism) and against the fake-quant reference
#   megatron-dp2   the same on two GPUs (needs 2; skipped with a note otherwise)
#   step           bench/step.py on every GPU: one optimizer step's weight path (cast, gather, compute copies)
# Megatron-Core must be importable (the device image lacks it: carry its wheel, see bench/RESULTS.md).
# Exit status is non-zero if any part fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/out}
PARTS=${PARTS:-"tests kernels linear megatron-dp1 megatron-dp2 step"}
GPT256_STEPS=${GPT256_STEPS:-60}
GPT2048_STEPS=${GPT2048_STEPS:-25}
GPT256_PAIRED=${GPT256_PAIRED:-200}
GPT2048_PAIRED=${GPT2048_PAIRED:-80}
ROUNDS=${ROUNDS:-1}  # megatron_compare.py's ABBA rounds (bf16, fp4, fp4, bf16 each; information and determinism)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
status=0
part() {  # part NAME CMD...: run it, keep its log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e 'c10d_logger' | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [[ $rc -eq 0 ]] || status=1
}
has() { [[ " $PARTS " == *" $1 "* ]]; }
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" | tee "$OUT/device.txt"
megatron() {  # megatron NPROC MODEL STEPS PAIRED_STEPS
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$1" bench/megatron_compare.py --model "$2" \
    --steps "$3" --rounds "$ROUNDS" --paired-steps "$4" --check-every 10 --log-interval 10 \
    --json "$OUT/megatron_$2_dp$1.json"
}
has tests && part gpu_tests "$PY" -m pytest tests/unit -m gpu -q -n 4 -p no:cacheprovider
has kernels && part kernels "$PY" bench/kernels.py --out "$OUT" --reps 10
has linear && part linear "$PY" bench/linear.py --out "$OUT"
if has megatron-dp1; then
  part megatron_gpt256_dp1 megatron 1 gpt256 "$GPT256_STEPS" "$GPT256_PAIRED"
  part megatron_gpt2048_dp1 megatron 1 gpt2048 "$GPT2048_STEPS" "$GPT2048_PAIRED"
fi
if has megatron-dp2; then
  if [[ "$ngpu" -ge 2 ]]; then
    part megatron_gpt256_dp2 megatron 2 gpt256 "$GPT256_STEPS" "$GPT256_PAIRED"
    part megatron_gpt2048_dp2 megatron 2 gpt2048 "$GPT2048_STEPS" "$GPT2048_PAIRED"
  else
    echo "=== megatron-dp2: skipped ($ngpu GPU on this machine)"
  fi
fi
has step && part step "$PY" -m torch.distributed.run --standalone --nproc_per_node="$ngpu" bench/step.py \
  --out "$OUT" --no-compile-baseline
echo "compute_path_gpu.sh: $([[ $status -eq 0 ]] && echo ALL PASSED || echo FAILURES, see $OUT/*.log)"
exit $status
