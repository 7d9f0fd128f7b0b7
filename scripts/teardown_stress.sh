#!/usr/bin/env bash
# Back-to-back gloo launches under CPU load, counting any that do not exit cleanly (exit status, or a C++
# abort such as "terminate called without an active exception" in a rank's output).
#   bash scripts/teardown_stress.sh                 # 50 launches at world size 4, every suite of run_suite.py
#   RUNS=20 NPROC=3 SUITES=cast,bad_input LOAD=2 bash scripts/teardown_stress.sh
# LOAD busy-loop processes run beside the job for the whole time (default: one per core). Prints one line per
# launch and a summary; exits non-zero if any launch failed or aborted. A rank that aborts prints its Python
# stacks (PYTHONFAULTHANDLER): "<no Python frame>" means it died in interpreter finalization.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
RUNS=${RUNS:-50}
NPROC=${NPROC:-4}
SUITES=${SUITES:-cast,bad_input,train}
LOAD=${LOAD:-$(nproc)}
LOG=${LOG:-$(mktemp -d)}
mkdir -p "$LOG"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONFAULTHANDLER=1
loaders=()
for _ in $(seq "$LOAD"); do
  ( while :; do :; done ) &
  loaders+=($!)
done
trap 'kill "${loaders[@]}" 2>/dev/null' EXIT
bad=0
for i in $(seq "$RUNS"); do
  out="$LOG/run$i.log"
  t0=$(date +%s)
  .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" tests/distributed/run_suite.py --backend gloo \
    --suites "$SUITES" > "$out" 2>&1
  rc=$?
  aborts=$(grep -c -e "terminate called" -e "Aborted" -e "SIGABRT" -e "core dumped" "$out")
  verdict=ok
  if [[ $rc -ne 0 || $aborts -ne 0 ]]; then verdict=FAIL; bad=$((bad + 1)); fi
  echo "launch $i/$RUNS: exit $rc, aborts $aborts, $(( $(date +%s) - t0 )) s: $verdict ($out)"
done
echo "teardown_stress: $bad of $RUNS launches failed or aborted (world size $NPROC, suites $SUITES, $LOAD busy loops)"
[[ $bad -eq 0 ]]
