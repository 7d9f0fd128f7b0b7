#!/usr/bin/env bash
# Create (or reuse) ./.venv with everything the tests and the demo need. Idempotent: a stamp file records the
# hash of the requirements, so a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FP4_DIST_VENV:-.venv}
PY=${PYTHON:-python3}
MCORE="megatron-core==0.19.2"
stamp="$VENV/.fp4_dist-stamp"
want=$(cat requirements/cpu.txt setup.cfg scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
echo "[bootstrap] creating $VENV (first run installs torch, megatron-core, cupy, mpich: a few minutes)" >&2
"$PY" -m venv "$VENV"
# pip's notes about this machine's local package mirrors are noise; its errors still show and still fail the run.
pip() { PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v -e '^WARNING: Location' -e 'BuildBackendWarning' || true; }; }
pip install --upgrade pip setuptools wheel
# pip byte-compiles one file after another; compileall below does the same on every core (a third of the time).
pip install --no-compile -r requirements/cpu.txt
# megatron-core >= 0.17 declares Python >= 3.12 but runs on 3.11; its sdist builds here (its wheel is cp312-only).
pip install --no-compile --no-deps --ignore-requires-python --no-binary megatron-core "$MCORE"
pip install --no-deps -e .
# Every process imports these; without .pyc files (PYTHONDONTWRITEBYTECODE, read-only trees) each would compile them.
"$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" >/dev/null 2>&1 || true
echo "$want" > "$stamp"
echo "[bootstrap] ready: $VENV" >&2
