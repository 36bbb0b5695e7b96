#!/usr/bin/env bash
# One device call: GPU pytest, correctness + tile sweep, then `hwkv bench attention` (and conformance
# when the suite exists). Usage (device machine, repo root): bash backends/cuda/scripts/gpu_check.sh [bench-args]
set -o pipefail
OUT=${OUT:-/tmp/hwkv-out}; mkdir -p "$OUT"
export PYTHONPATH=.:backends/cuda${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HWKV_PLUGIN_MODULES=${HWKV_PLUGIN_MODULES:-hwkv_cuda.plugin}  # the cuda backend and its benches, uninstalled
STEPS=${STEPS:-pytest,check,sweep,bench}
failed=()
# status of the first command of the last pipeline (tee/grep/tail after it always succeed)
note() { local rc=${PIPESTATUS[0]}; [[ $rc -ne 0 ]] && failed+=("$1 (rc=$rc)"); return 0; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ $STEPS == *pytest* ]]; then
  timeout ${PYTEST_S:-240} python3 -m pytest -q -p no:cacheprovider backends/cuda/tests 2>&1 | tee "$OUT/pytest.log" | tail -3
  note pytest
fi
args=""; [[ $STEPS == *check* ]] && args="check"; [[ $STEPS == *sweep* ]] && args="$args sweep"
[[ $STEPS == *quickcheck* ]] && args="quickcheck${args#check}"
if [[ -n $args ]]; then
  timeout ${CHECK_S:-240} python3 backends/cuda/scripts/gpu_check.py $args --out "$OUT" 2>&1 | tee "$OUT/check.log" \
    | grep -E "BEST|FAIL|correctness|Error|error|Traceback"
  note check
fi
if [[ $STEPS == *bench* ]]; then
  timeout ${BENCH_S:-330} python3 -m hwkv bench attention --out "$OUT/attention.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^|"
  note bench
fi
if [[ $STEPS == *conformance* ]]; then
  # entry points need installed dists; offline device: no deps, no build isolation
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda 2>&1 | grep -v WARNING | tail -3
  # warm Triton's kernel cache with the same suite on 12 workers (xdist), then the certify run
  timeout ${WARM_S:-180} python3 -m pytest -q -p no:cacheprovider conformance --backend cuda -n 12 2>&1 \
    | tee "$OUT/conf-warm.log" | tail -3
  timeout ${CONF_S:-240} python3 -m hwkv conformance --backend cuda --certify --report "$OUT/conf" 2>&1 \
    | tee "$OUT/conf.log" | grep -vE "^\.+ +\[" | tail -40
  note conformance
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "FAILED steps: ${failed[*]}" >&2
  exit 1
fi
