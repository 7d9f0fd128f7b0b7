#!/usr/bin/env bash
# Lean compute (issue 26) on one GPU, in one command (logs under ${OUT:-bench/out}):
#   bash bench/lean_gpu.sh                  # every part below
#   PARTS="paired2048 zero1" bash bench/lean_gpu.sh
# Parts:
#   tests       tests/unit/test_lean.py (the CUDA case: lean equals kept copies bitwise; the pool never replaced)
#   check       bench/lean_check.py: a Megatron GPT 256 (4 layers share each pool buffer) trained kept and lean,
#               bitwise equal losses and fp32 masters on CUDA
#   paired2048  bench/megatron_compare.py --paired-only fp4,lean: GPT hidden 2048 x 8, bf16 / kept copies / lean
#               in rotating alternating steps of one process ($PAIRED2048 steps each): the issue's step measure
#   paired4096  the same for GPT hidden 4096 x 6 (mb 2), bf16 / lean ($PAIRED4096 steps each)
#               REPEAT=N runs each paired part in N processes and pools them (bench/paired_pool.py)
#   memory      one process per mode (examples.megatron_pretrain_gpt, 12 iterations): peak allocated memory and
#               median step of bf16, kept copies and lean, both models
#   zero1       bench/lean.py: the Zero1Optimizer GPT-like stack, bf16 / kept copies / lean
#   profile     bench/megatron_profile.py --gpu: GPU time per kernel and idle gaps, bf16 against lean (GPT 2048)
# Megatron-Core must be importable (the device image lacks it: carry its wheel, see bench/RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/out}
PARTS=${PARTS:-"tests check paired2048 paired4096 memory zero1 profile"}
PAIRED2048=${PAIRED2048:-40}
PAIRED4096=${PAIRED4096:-20}
REPEAT=${REPEAT:-1}  # processes per paired part: one process's ratio moves by several percent between processes
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
# No apex / TransformerEngine on the device: Megatron's fused weight-gradient accumulation is unavailable.
MEGATRON_EXTRA=${MEGATRON_EXTRA:-"--no-gradient-accumulation-fusion"}
status=0
part() {  # part NAME CMD...: run it, keep its log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e 'c10d_logger' -e 'warnings.warn' -e 'DEPRECATED' | tee "$OUT/$name.log" \
    | grep -v -e '^ *\[' -e 'iteration' -e '^WARNING'
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [[ $rc -eq 0 ]] || status=1
}
has() { [[ " $PARTS " == *" $1 "* ]]; }
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
torchrun1() { "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$@"; }
has tests && part lean_tests "$PY" -m pytest tests/unit/test_lean.py -q -p no:cacheprovider
has check && part lean_check torchrun1 bench/lean_check.py --model gpt256 --steps 6 -- $MEGATRON_EXTRA
paired() {  # paired NAME MODEL VARIANTS STEPS: $REPEAT processes, then their pooled verdict when more than one
  local name=$1 model=$2 variants=$3 steps=$4 i
  for ((i = 1; i <= REPEAT; i++)); do
    part "$name.$i" torchrun1 bench/megatron_compare.py --model "$model" --paired-only "$variants" \
      --steps "$steps" --json "$OUT/$name.$i.json" -- $MEGATRON_EXTRA
  done
  if ((REPEAT > 1)); then part "$name.pooled" "$PY" bench/paired_pool.py $(seq -f "$OUT/$name.%g.json" 1 "$REPEAT"); fi
}
has paired2048 && paired paired2048 gpt2048 fp4,lean "$PAIRED2048"
has paired4096 && paired paired4096 gpt4096 lean "$PAIRED4096"
if has memory; then
  for model in gpt2048 gpt4096; do
    margs=$("$PY" -c "from bench.megatron_compare import MODELS, COMMON; print(MODELS['$model'], COMMON)")
    for mode in bf16 fp4 lean; do
      extra=""; [[ $mode != bf16 ]] && extra="--fp4-param-gather"; [[ $mode == lean ]] && extra+=" --fp4-no-compute-copy"
      part "memory_${model}_$mode" torchrun1 -m examples.megatron_pretrain_gpt $margs $extra $MEGATRON_EXTRA \
        --train-iters 12 --log-interval 12 --lr-warmup-iters 1
    done
  done
fi
has zero1 && part zero1 "$PY" bench/lean.py --rounds 1
has profile && part profile torchrun1 bench/megatron_profile.py --gpu --model gpt2048 --steps 9 -- \
  --fp4-no-compute-copy $MEGATRON_EXTRA
exit $status
