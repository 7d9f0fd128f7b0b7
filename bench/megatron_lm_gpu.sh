#!/usr/bin/env bash
# megatron.training's own loop on one GPU through fp4_dist.megatron.run: plain bf16 against --fp4-param-gather (same
# seed, data and arguments), for examples/pretrain_gpt.py and, when MEGATRON_LM names a Megatron-LM checkout
# (core_r0.19.0), its own unmodified pretrain_gpt.py. The table (bench/megatron_lm_table.py) puts the loss curves
# side by side and gives the median step time of each run.
#   bash bench/megatron_lm_gpu.sh                                 # the example script only
#   MEGATRON_LM=/path/to/Megatron-LM ITERS=100 ROUNDS=2 bash bench/megatron_lm_gpu.sh
# Logs and the run records under ${OUT:-bench/out}. GPT 4 layers x 512, seq 512, micro-batch 8, byte tokens of
# examples/data; the fp4 runs check gathered == quantize(master) every $CHECK iterations (those steps are left out
# of the medians).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench/out}
ITERS=${ITERS:-100}
CHECK=${CHECK:-25}
ROUNDS=${ROUNDS:-1}  # rounds per script; the medians pool every round's steps
mkdir -p "$OUT"
export PYTHONPATH="$PWD${MEGATRON_LM:+:$MEGATRON_LM}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore
"$PY" -m examples.megatron_preprocess --input examples/data/tiny_corpus.txt --output-prefix "$OUT/data/corpus" || exit 1
ARGS="--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --micro-batch-size 8 --global-batch-size 8 --train-iters $ITERS --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
  --lr-warmup-iters 10 --clip-grad 1.0 --bf16 --use-distributed-optimizer --tokenizer-type NullTokenizer
  --vocab-size 256 --data-path $OUT/data/corpus --split 90,5,5 --log-interval 1 --eval-interval 100000
  --eval-iters 1 --seed 1234 --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --deterministic-mode"
status=0
run() {  # run NAME SCRIPT [--fp4-param-gather]
  local name=$1 script=$2; shift 2
  local opts=(--log-json "$OUT/$name.json")
  [[ " $* " == *" --fp4-param-gather "* ]] && opts+=(--check-every "$CHECK")
  echo "=== $name: $script $*"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m fp4_dist.megatron.run "${opts[@]}" "$script" \
    $ARGS "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc"; [[ $rc -eq 0 ]] || { status=1; tail -30 "$OUT/$name.log"; }
}
pair() {  # pair NAME SCRIPT: ROUNDS rounds, bf16 then fp4 in odd rounds and the other way round in even ones (ABBA)
  local name=$1 script=$2 r sfx
  for r in $(seq "$ROUNDS"); do
    sfx=$([[ $r -eq 1 ]] || echo "-r$r")
    if (( r % 2 )); then
      run "$name-bf16$sfx" "$script"; run "$name-fp4$sfx" "$script" --fp4-param-gather
    else
      run "$name-fp4$sfx" "$script" --fp4-param-gather; run "$name-bf16$sfx" "$script"
    fi
  done
}
pair example examples/pretrain_gpt.py
tables=(example)
if [[ -n "${MEGATRON_LM:-}" ]]; then
  pair megatron-lm "$MEGATRON_LM/pretrain_gpt.py"
  tables+=(megatron-lm)
fi
for t in "${tables[@]}"; do "$PY" bench/megatron_lm_table.py "$OUT" "$t" --check-every "$CHECK" || status=1; done
exit $status
