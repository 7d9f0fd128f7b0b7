#!/usr/bin/env bash
# Run the whole test suite (unit + multi-rank distributed + Megatron-Core integration) in ./.venv.
# GPU tests are skipped without CUDA; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
# The suite starts several hundred processes that import the checkout's own modules; without .pyc files
# (PYTHONDONTWRITEBYTECODE) each compiles them again: half a second of a Megatron rank's start-up. Compiled once here.
.venv/bin/python -m compileall -q -j 0 fp4_dist examples bench tests >/dev/null 2>&1 || true
# The whole suite unless the arguments name test paths of their own (e.g. `bash scripts/test.sh tests/unit -x`).
where=(tests)
for a in "$@"; do [[ "$a" != -* && -e "${a%%::*}" ]] && where=(); done
# One worker per core (pytest-xdist): the multi-process tests are bound by their ranks' start-up, the rest by one
# core; their ranks are forked from a process that has imported torch and Megatron-Core already
# (tests/distributed/forked_ranks.py; FP4_DIST_TEST_FORK=0: torchrun), and a launch several tests read is made once
# whichever worker asks first (tests/distributed/shared.py). Tests go out two at a time as workers free up
# (--maxschedchunk 2): the longest come first, by the seconds tests/durations.json records (tests/conftest.py;
# `bash scripts/test.sh --record-durations tests/durations.json` records them again), and xdist's default first
# batch, a quarter of the suite per worker, would hand them all to one worker.
# FP4_DIST_TEST_WORKERS=0: one process.
exec .venv/bin/python -m pytest "${where[@]}" -ra --durations=15 -n "${FP4_DIST_TEST_WORKERS:-auto}" \
  --maxschedchunk 2 "$@"
