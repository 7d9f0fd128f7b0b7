#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py through fp4_dist.megatron.run on 4 GPUs (NCCL), plain bf16 against
# --fp4-param-gather (same seed, data and arguments), in the parallel layouts users train with: TP 2 x DP 2,
# PP 2 x DP 2, TP 2 x PP 2, MoE (4 experts) EP 2 x DP 2 (alltoall dispatcher) and EP 4 (allgather dispatcher);
# by name also tp2-dp2-cpu-init (Megatron's --use-cpu-initialization on GPUs).
# Every fp4 run checks gathered == quantize(full fp32 master) after setup and every $CHECK iterations.
#   MEGATRON_LM=/path/to/Megatron-LM bash bench/megatron_layouts_gpu.sh [LAYOUT ...]
# MEGATRON_LM: a Megatron-LM core_r0.19.0 checkout, or a folder holding its pretrain_gpt.py, gpt_builders.py and
# model_provider.py (megatron itself then comes from the installed megatron-core). Logs, run records and the table
# under ${OUT:-bench/out}, with each run's peak memory (max over ranks). GPT 4 layers x 512, seq 512, micro-batch 4,
# global batch 16, byte tokens of TEXT (default: this Python's standard library sources); the llama-* layouts
# override the model. KEPT=1: each fp4 run again with kept compute copies (the launcher's --compute-copy), tabled
# under $OUT/kept against the same bf16 run; FP8=1 likewise in the FP8 compute mode (--compute fp8, Hopper), under
# $OUT/fp8. FP4=0 leaves out the default mode's runs (and their table).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench/out}
ITERS=${ITERS:-100}
CHECK=${CHECK:-10}
NPROC=${NPROC:-4}
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (core_r0.19.0)}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore
if [[ ! -f "$OUT/data/corpus.idx" ]]; then
  TEXT=${TEXT:-$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}
  "$PY" -m examples.megatron_preprocess --input $(find "$TEXT" -maxdepth 1 -name '*.py' | sort | head -300) \
    --output-prefix "$OUT/data/corpus" || exit 1
fi
ARGS="--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --micro-batch-size 4 --global-batch-size 16 --train-iters $ITERS --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
  --lr-warmup-iters 10 --clip-grad 1.0 --bf16 --use-distributed-optimizer --tokenizer-type NullTokenizer
  --vocab-size 256 --data-path $OUT/data/corpus --split 98,1,1 --log-interval 1 --eval-interval 100000
  --eval-iters 1 --seed 1234 --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --distributed-timeout-minutes 2"
MOE="--num-experts 4 --moe-router-topk 2"
declare -A LAYOUT=(
  [tp2-dp2]="--tensor-model-parallel-size 2"
  [tp2-dp2-cpu-init]="--tensor-model-parallel-size 2 --use-cpu-initialization"
  [pp2-dp2]="--pipeline-model-parallel-size 2"
  [tp2-pp2]="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  [moe-ep2-dp2]="$MOE --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  [moe-ep4]="$MOE --expert-model-parallel-size 4 --moe-token-dispatcher-type allgather"
)
# A Llama-shaped model (RMSNorm, SwiGLU, GQA 8 groups, RoPE, untied embeddings, seq 2048, hidden 4096 x 8 layers,
# ffn 11008) in the layouts users train it with, by name: llama-tp2-dp2, llama-dp4, llama-pp2-dp2 and
# llama-ep2-dp2 (4 experts of that shape, top-2, alltoall dispatcher).
LLAMA="--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --ffn-hidden-size 11008 --normalization RMSNorm --swiglu --position-embedding-type rope
  --untie-embeddings-and-output-weights --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1
  --global-batch-size 16 --vocab-size 32000"
LAYOUT[llama-tp2-dp2]="$LLAMA --tensor-model-parallel-size 2"
LAYOUT[llama-dp4]="$LLAMA"
LAYOUT[llama-pp2-dp2]="$LLAMA --pipeline-model-parallel-size 2"
LAYOUT[llama-ep2-dp2]="$LLAMA $MOE --disable-bias-linear --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
ORDER=(tp2-dp2 pp2-dp2 tp2-pp2 moe-ep2-dp2 moe-ep4)
(( $# )) && ORDER=("$@")
status=0
KEPT=${KEPT:-0}
FP8=${FP8:-0}
FP4=${FP4:-1}
run() {  # run DIR NAME LAYOUT-ARGS [--fp4-param-gather]; the launcher's own options in $LAUNCHER_OPTS
  local dir=$1 name=$2 layout=$3; shift 3
  local opts=(--log-json "$dir/$name.json" ${LAUNCHER_OPTS:-})
  [[ " $* " == *" --fp4-param-gather "* ]] && opts+=(--check-every "$CHECK")
  echo "=== $name: $layout $*"
  timeout 400 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m fp4_dist.megatron.run \
    "${opts[@]}" "$MEGATRON_LM/pretrain_gpt.py" $ARGS $layout "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc"; [[ $rc -eq 0 ]] || { status=1; grep "fp4_dist\|Error" "$dir/$name.log" | tail -8; }
}
(( KEPT )) && mkdir -p "$OUT/kept"
(( FP8 )) && mkdir -p "$OUT/fp8"
for l in "${ORDER[@]}"; do
  run "$OUT" "$l-bf16" "${LAYOUT[$l]}"
  (( FP4 )) && run "$OUT" "$l-fp4" "${LAYOUT[$l]}" --fp4-param-gather
  if (( KEPT )); then
    cp "$OUT/$l-bf16.json" "$OUT/$l-bf16.log" "$OUT/kept/"
    LAUNCHER_OPTS=--compute-copy run "$OUT/kept" "$l-fp4" "${LAYOUT[$l]}" --fp4-param-gather
  fi
  if (( FP8 )); then
    cp "$OUT/$l-bf16.json" "$OUT/$l-bf16.log" "$OUT/fp8/"
    LAUNCHER_OPTS="--compute fp8" run "$OUT/fp8" "$l-fp4" "${LAYOUT[$l]}" --fp4-param-gather
  fi
done
if (( FP4 )); then
  "$PY" bench/megatron_lm_table.py "$OUT" "${ORDER[@]}" --check-every "$CHECK" --summary | tee "$OUT/layouts.md" ||
    status=1
fi
if (( KEPT )); then
  echo "kept compute copies (--compute-copy) in the fp4 columns:"
  "$PY" bench/megatron_lm_table.py "$OUT/kept" "${ORDER[@]}" --check-every "$CHECK" --summary |
    tee "$OUT/kept/layouts.md" || status=1
fi
if (( FP8 )); then
  echo "the FP8 compute mode (--compute fp8) in the fp4 columns:"
  "$PY" bench/megatron_lm_table.py "$OUT/fp8" "${ORDER[@]}" --check-every "$CHECK" --summary |
    tee "$OUT/fp8/layouts.md" || status=1
fi
exit $status
