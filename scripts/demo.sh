#!/usr/bin/env bash
# Install hwkv and run the main job on the embedded default: a tiny model (written locally, no
# downloads) generated on the CPU reference backend, printing outputs and engine stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m hwkv generate --demo "$@"
