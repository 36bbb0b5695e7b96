#!/usr/bin/env bash
# Tile/knob sweep of `hwkv bench attention`: one bench per HWKV_CUDA_ATTN_CONFIG value, rows prefixed
# with it ("" = defaults). Usage (device, repo root):
#   CONFIGS="|num_stages=1|block_n=128" bash backends/cuda/scripts/attn_sweep.sh --batches 1 --contexts 8192 ...
export PYTHONPATH=.:backends/cuda${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HWKV_PLUGIN_MODULES=${HWKV_PLUGIN_MODULES:-hwkv_cuda.plugin}  # `hwkv bench attention` comes from the cuda plugin
IFS='|' read -r -a cfgs <<< "${CONFIGS:-}"
[[ ${#cfgs[@]} -eq 0 ]] && cfgs=("")
for cfg in "${cfgs[@]}"; do
  HWKV_CUDA_ATTN_CONFIG=$cfg timeout "${SWEEP_S:-120}" python3 -m hwkv bench attention --peers sdpa "$@" 2>&1 \
    | grep -E "^\| (decode|prefill)|Error|copy bandwidth" | sed "s/^/[${cfg:-default}] /"
done
