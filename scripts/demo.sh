#!/usr/bin/env bash
# Install hwkv and run the main job on the embedded default: a tiny model (written locally, no
# downloads) generated on the CPU reference backend, printing outputs and engine stats.
# The model is cached in ~/.cache/hwkv/demo-llama ($XDG_CACHE_HOME/hwkv/demo-llama), written
# atomically; torch runs on one thread (the model is tiny) unless --threads N / OMP_NUM_THREADS.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m hwkv generate --demo "$@"
