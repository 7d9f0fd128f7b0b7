#!/usr/bin/env bash
# The "One node" table of bench/RESULTS.md (step time and peak memory against plain bf16, every stack, 4 GPUs of one
# host), part by part; logs and JSON under ${OUT:-bench/out}/one_node, a summary of every part's verdict lines last.
#   PARTS="gpt4096-dp4 gpt4096-tp2" bash bench/one_node_gpu.sh
#   CPU=1 bash bench/one_node_gpu.sh          # every part on 2 CPU ranks with tiny models: the commands run as written
# Parts, each one process (or one per mode, for memory), in the order the table gives them; minutes on 4 x H200:
#   gpt4096-dp4      megatron_compare.py GPT 4096 x 6 at DP 4, bf16 / default / kept copies / FP8 in alternating
#                    steps of one process ($PAIRED steps each; about 3)
#   gpt4096-tp2      the same at TP 2 x DP 2 (about 3)
#   gpt2048-dp4      GPT 2048 x 8 at DP 4, bf16 / default / kept copies ($PAIRED2048 steps each; about 2)
#   memory           --memory-only per mode at GPT 4096, DP 4 and TP 2 x DP 2 (6 processes; about 4)
#   fsdp2            bench/fsdp.py hidden 4096 x 8, dp 4, bf16 and FP8 compute ($ROUNDS ABBA rounds; about 4)
#   zero1            bench/zero1_stack.py hidden 4096 x 8 at 4 data-parallel ranks (about 3)
#   llama            bench/megatron_layouts_gpu.sh llama-dp4 llama-tp2-dp2 llama-pp2-dp2 llama-ep2-dp2: Megatron-LM's
#                    own pretrain_gpt.py (needs MEGATRON_LM; $LLAMA_ITERS iterations; about 4 a layout)
# A part's ratio over its limit prints a verdict line and exits 0 (the benches' --strict is not passed); a part that
# fails (a crash, a parity check) makes the exit status non-zero. Megatron-Core must be importable (the device image
# lacks it: carry its wheel, README "GPU tests").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-bench/out}/one_node
PARTS=${PARTS:-"gpt4096-dp4 gpt4096-tp2 gpt2048-dp4 memory fsdp2 zero1"}
PAIRED=${PAIRED:-30}
PAIRED2048=${PAIRED2048:-45}
ROUNDS=${ROUNDS:-3}
ZERO1_ROUNDS=${ZERO1_ROUNDS:-2}
LLAMA_ITERS=${LLAMA_ITERS:-30}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export CUDA_DEVICE_MAX_CONNECTIONS=1
NPROC=4
MEGATRON=(-- --no-gradient-accumulation-fusion)
if [[ "${CPU:-0}" == 1 ]]; then  # the commands as written, on gloo ranks, with models small enough for a CPU
  export CUDA_VISIBLE_DEVICES=""
  NPROC=2 PAIRED=4 PAIRED2048=4 ROUNDS=1 ZERO1_ROUNDS=1
  gpt4096=(--model gpt256) gpt2048=(--tiny) fsdp=(--hidden 64 --layers 2 --tokens 64 --steps 2)
  zero1=(--hidden 256 --layers 1 --seq 32 --micro-batch 1 --steps 2 --device cpu)
else
  gpt4096=(--model gpt4096) gpt2048=(--model gpt2048) fsdp=(--hidden 4096) zero1=(--hidden 4096)
fi
torchrun() { "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"; }
failed=()

part() {  # part NAME COMMAND...: run it, keep its log, note a failure
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | grep -v -e '^W[0-9]\{4\} ' -e 'c10d_logger' | tee "$OUT/$name.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("$name")
}

for p in $PARTS; do
  case $p in
    gpt4096-dp4) part "$p" torchrun bench/megatron_compare.py "${gpt4096[@]}" --paired-only fp4,kept,fp8 \
                   --paired-steps "$PAIRED" --json "$OUT/$p.json" "${MEGATRON[@]}" ;;
    gpt4096-tp2) part "$p" torchrun bench/megatron_compare.py "${gpt4096[@]}" --paired-only fp4,kept,fp8 \
                   --paired-steps "$PAIRED" --json "$OUT/$p.json" "${MEGATRON[@]}" --tensor-model-parallel-size 2 ;;
    gpt2048-dp4) part "$p" torchrun bench/megatron_compare.py "${gpt2048[@]}" --paired-only fp4,kept \
                   --paired-steps "$PAIRED2048" --json "$OUT/$p.json" "${MEGATRON[@]}" ;;
    memory)
      for layout in dp4 tp2; do
        tp=()
        [[ $layout == tp2 ]] && tp=(--tensor-model-parallel-size 2)
        for mode in bf16 fp4 fp8; do
          part "memory-$layout-$mode" torchrun bench/megatron_compare.py "${gpt4096[@]}" --memory-only "$mode" \
            --steps 4 "${MEGATRON[@]}" "${tp[@]}"
        done
      done ;;
    fsdp2)
      for compute in bf16 fp8; do
        part "fsdp2-$compute" torchrun bench/fsdp.py "${fsdp[@]}" --rounds "$ROUNDS" --compute "$compute"
      done ;;
    zero1) part "$p" "$PY" bench/zero1_stack.py "${zero1[@]}" --nproc "$NPROC" --rounds "$ZERO1_ROUNDS" ;;
    llama) part "$p" env NPROC="$NPROC" ITERS="$LLAMA_ITERS" OUT="$OUT/llama" PY="$PY" \
             bash bench/megatron_layouts_gpu.sh llama-dp4 llama-tp2-dp2 llama-pp2-dp2 llama-ep2-dp2 ;;
    *) echo "one_node_gpu.sh: unknown part $p (see the list at the top of this file)" >&2
       failed+=("$p") ;;
  esac
done

echo "== summary ($OUT)"
grep -h -i -e 'verdict' -e 'peak' -e 'paired' "$OUT"/*.log 2>/dev/null | grep -v '^==' | cut -c1-200
if ((${#failed[@]})); then
  echo "FAILED parts: ${failed[*]}"
  exit 1
fi
echo "ALL PARTS RAN"
