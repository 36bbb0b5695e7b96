#!/usr/bin/env bash
# Install everything the tests need, certify the CPU-runnable backends, run the test suite.
# This is the README's test command and exactly what CI runs (.ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
# A fresh virtualenv per run (unless PYTHON names an interpreter, or HWKV_TEST_VENV=0): a test
# dependency that no extra declares fails here, as it would on a user's machine.
if [[ -z "${PYTHON:-}" && "${HWKV_TEST_VENV:-1}" != 0 ]]; then
  VENV=${HWKV_TEST_VENV_DIR:-.venv-test}
  rm -rf "$VENV" && python3 -m venv "$VENV" || { echo "could not create the virtualenv $VENV" >&2; exit 1; }
  export PATH="$PWD/$VENV/bin:$PATH" VIRTUAL_ENV="$PWD/$VENV"
  export PYTHON="$PWD/$VENV/bin/python"
fi
PY=${PYTHON:-python3}
# Small tensor ops dominate the suite; one intra-op thread avoids oversubscribing CI's 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# set-up installs Mooncake and libibverbs: a Mooncake test that would skip is a broken set-up here
export HWKV_REQUIRE_MOONCAKE=${HWKV_REQUIRE_MOONCAKE:-1}
# ... and so does the real model (the real-model tier: tests/model/test_real_model.py)
export HWKV_REQUIRE_REAL_MODEL=${HWKV_REQUIRE_REAL_MODEL:-1}
bash scripts/setup.sh --dev || { echo "setup failed" >&2; exit 1; }

fail=0
# Conformance: the reference and the toy vendor backend must certify (all PASS / NOT_SUPPORTED).
for b in cpu toy; do
  "$PY" -m hwkv conformance --backend "$b" --certify --report "reports/conformance-$b" || fail=1
done

# Two workers (pytest-xdist; HWKV_TEST_WORKERS overrides, 0 = in this process): most tests wait on
# subprocesses, sockets or one intra-op thread, so 2 cores run two at once (a clean clone here, the
# pytest part: 1,265 s in one process, 936 s with two).
"$PY" -m pytest -q -p no:cacheprovider -n "${HWKV_TEST_WORKERS:-2}" --durations=25 \
  tests backends/cuda/tests backends/ascend/tests
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
[[ $fail -ne 0 ]] && { echo "conformance certification failed (see reports/)" >&2; exit 1; }
exit $rc
