#!/usr/bin/env bash
# ZeRO suites on 2 GPUs with NCCL, in one command (device kind nvidia-h200-x2):
#   bash bench/zero_gpu.sh            # results under ${OUT:-bench/out}
# 1. tests/distributed/run_suite.py (cast parity vs the CPU oracle, bad input, 60-step training parity with the
#    collective count) on 2 ranks, NCCL, CUDA kernels;
# 2. the cast suite on 2 CPU ranks (gloo), and a check that both gathered the same bytes (digests);
# 3. the main job (examples.train_lm) on 2 GPUs.
# Exit status is non-zero if any step fails; each step's output is also saved as a file.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python)}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONWARNINGS=ignore::FutureWarning
NPROC=${NPROC:-2}
status=0
step() {  # step NAME CMD...: run, tee the log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [[ $rc -eq 0 ]] || status=1
}
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" | tee "$OUT/device.txt"
step suites_nccl "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" tests/distributed/run_suite.py \
  --backend nccl --out "$OUT/zero_nccl_ws$NPROC.json"
step cast_gloo "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" tests/distributed/run_suite.py \
  --backend gloo --suites cast --out "$OUT/zero_gloo_ws$NPROC.json"
step same_bytes "$PY" - "$OUT/zero_nccl_ws$NPROC.json" "$OUT/zero_gloo_ws$NPROC.json" <<'PYEOF'
import json, sys
gpu, cpu = (json.load(open(p)) for p in sys.argv[1:3])
g, c = gpu["suites"]["cast"]["digests"], cpu["suites"]["cast"]["digests"]
diff = [k for k in c if g.get(k) != c[k]]
print(f"{len(c)} cast cases: GPU/NCCL and CPU/gloo digests", "identical" if not diff else f"DIFFER in {diff}")
print("nccl failures:", len(gpu["failures"]), "| train:", json.dumps(gpu["suites"].get("train", {}).get("ordered", {})))
sys.exit(1 if diff or gpu["failures"] or cpu["failures"] else 0)
PYEOF
step train_lm "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m examples.train_lm --no-progress
echo "zero_gpu.sh: $([[ $status -eq 0 ]] && echo ALL PASSED || echo FAILURES, see $OUT/*.log)"
exit $status
