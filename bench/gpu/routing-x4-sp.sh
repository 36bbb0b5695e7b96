#!/bin/bash
# pool (#35), one GPU, <= 120 s: cache-aware routing vs round-robin, 4 instances of the Llama-3.2-1B shape
# (random weights, bf16) time-sharing one H200, 16 tenants of 2k-8k tokens (+64), 120 requests at
# concurrency 8, both policies on the same servers in one run. Batch D (main 07a489e, default server
# options) gave TTFT p50 x1.59 (106.0 vs 66.5 ms) at a hit rate x2.62: cache-aware's hits waited out
# the 8k misses' prefill steps on their instance. The servers here cap a prefill chunk at 2,048 tokens
# and let a request whose whole rest fits a step start beside a partial one (ENGINE_ARGS, default
# --long-prefill-token-threshold 2048 --short-prefills-first), so a hit's 64 tokens run in the next step.
# Run from the repository root, OUT set.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-routing-sp}
mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)
echo "commit $HWKV_COMMIT; $(date -u +%T)"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1 | head -2
timeout "${LIMIT:-115}" python3 -m hwkv bench routing --model llama-1b --backend cuda --instances 4 \
  --system-len 2048-8192 --suffix-len 64 --requests 120 --concurrency 8 --max-tokens 4 \
  --policies "${POLICIES:-round_robin,cache_aware}" \
  --engine-args "${ENGINE_ARGS:---long-prefill-token-threshold 2048 --short-prefills-first}" \
  --workdir /dev/shm/hwkv-bench-models --start-timeout 60 --out-dir "$OUT" 2>&1 | tee "$OUT/routing.log" | tail -n 20
echo "routing rc=${PIPESTATUS[0]} ($(date -u +%T))"
