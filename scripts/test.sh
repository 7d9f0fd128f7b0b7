#!/usr/bin/env bash
# Run the whole test suite (unit + multi-rank distributed + Megatron-Core integration) in ./.venv.
# GPU tests are skipped without CUDA; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
# The whole suite unless the arguments name test paths of their own (e.g. `bash scripts/test.sh tests/unit -x`).
where=(tests)
for a in "$@"; do [[ "$a" != -* && -e "${a%%::*}" ]] && where=(); done
exec .venv/bin/python -m pytest "${where[@]}" -ra --durations=15 "$@"
