#!/usr/bin/env bash
# The compute-path measurements on a GPU machine, in one command (results and logs under ${OUT:-bench/out}):
#   bash bench/compute_gpu.sh                                  # the default parts (first list below)
#   PARTS="linear megatron-dp1 paired2048" bash bench/compute_gpu.sh
# Parts (default):
#   tests          GPU unit tests: every CUDA kernel bit-exact against the reference, lean equal to kept copies
#   kernels        bench/kernels.py: each stage against the device copy bandwidth, 1,000-weight launches/host time
#   linear         bench/linear.py: a linear layer's forward + backward with an NVFP4 weight vs bf16
#   megatron-dp1   bench/megatron_compare.py on one GPU, GPT hidden 256 x 4 layers and 2048 x 8 layers (seq 1024):
#                  --fp4-param-gather vs plain bf16 paired ($GPT256_PAIRED / $GPT2048_PAIRED steps each: the
#                  step-time verdict), in ABBA rounds ($ROUNDS) and against the fake-quant reference
#   megatron-dp2   the same on two GPUs (needs 2; skipped with a note otherwise)
#   step           bench/step.py on every GPU: one optimizer step's weight path (cast, gather, compute copies)
# Parts (lean compute, the default, against kept compute copies; on request):
#   paired2048     megatron_compare.py --paired-only fp4,kept: GPT 2048 x 8, bf16 / lean / kept copies in rotating
#                  alternating steps of one process ($PAIRED2048 steps each); REPEAT=N processes, pooled (--pool)
#   paired4096     the same for GPT hidden 4096 x 6 (mb 2), bf16 / lean ($PAIRED4096 steps each)
#   memory         one process per mode (examples.megatron_pretrain_gpt, 12 iterations): peak memory, median step
#   zero1          bench/zero1_stack.py: the Zero1Optimizer GPT-like stack, bf16 / kept copies / lean
#   host           bench/host_per_use.py: host time per use of a weight, bf16 / kept copy / lean
#   profile        bench/megatron_profile.py --gpu: GPU time per kernel and idle gaps, bf16 against lean (GPT 2048)
# Megatron-Core must be importable (the device image lacks it: carry its wheel, see README "GPU tests").
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
PAIRED2048=${PAIRED2048:-40}
PAIRED4096=${PAIRED4096:-20}
REPEAT=${REPEAT:-1}  # processes per lean paired part: one process's ratio moves by several percent between processes
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
# No apex / TransformerEngine on the device: Megatron's fused weight-gradient accumulation is unavailable.
MEGATRON_EXTRA=${MEGATRON_EXTRA:-"--no-gradient-accumulation-fusion"}
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
torchrun1() { "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$@"; }
megatron() {  # megatron NPROC MODEL STEPS PAIRED_STEPS
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$1" bench/megatron_compare.py --model "$2" \
    --steps "$3" --rounds "$ROUNDS" --paired-steps "$4" --check-every 10 --log-interval 10 \
    --json "$OUT/megatron_$2_dp$1.json"
}
paired() {  # paired NAME MODEL VARIANTS STEPS: $REPEAT processes, then their pooled verdict when more than one
  local name=$1 model=$2 variants=$3 steps=$4 i
  for ((i = 1; i <= REPEAT; i++)); do
    part "$name.$i" torchrun1 bench/megatron_compare.py --model "$model" --paired-only "$variants" \
      --steps "$steps" --json "$OUT/$name.$i.json" -- $MEGATRON_EXTRA
  done
  if ((REPEAT > 1)); then part "$name.pooled" "$PY" bench/megatron_compare.py --pool $(seq -f "$OUT/$name.%g.json" 1 "$REPEAT"); fi
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
has paired2048 && paired paired2048 gpt2048 fp4,kept "$PAIRED2048"
has paired4096 && paired paired4096 gpt4096 fp4 "$PAIRED4096"
if has memory; then
  for model in gpt2048 gpt4096; do
    margs=$("$PY" -c "from bench.megatron_compare import MODELS, COMMON; print(MODELS['$model'], COMMON)")
    for mode in bf16 fp4 kept; do
      extra=""; [[ $mode != bf16 ]] && extra="--fp4-param-gather"; [[ $mode == kept ]] && extra+=" --fp4-compute-copy"
      part "memory_${model}_$mode" torchrun1 -m examples.megatron_pretrain_gpt $margs $extra $MEGATRON_EXTRA \
        --train-iters 12 --log-interval 12 --lr-warmup-iters 1
    done
  done
fi
has zero1 && part zero1 "$PY" bench/zero1_stack.py --rounds 1
has host && part host "$PY" bench/host_per_use.py
has profile && part profile torchrun1 bench/megatron_profile.py --gpu --model gpt2048 --steps 9 -- \
  $MEGATRON_EXTRA
echo "compute_gpu.sh: $([[ $status -eq 0 ]] && echo ALL PASSED || echo FAILURES, see $OUT/*.log)"
exit $status
