#!/bin/bash
# pool (#35), one GPU, <= 120 s: cache-aware routing vs round-robin with 4 instances of the Llama-3.2-1B
# shape (random weights, bf16) time-sharing one GPU, 16 tenants of 2k-8k tokens (+64), 120 requests at
# concurrency 8, three policies in one run: round_robin, cache_aware (longest prefix first) and
# cache_aware:1 (prefix weighed against queued work, --load-weight 1). Run from the repository root, OUT set.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-routing-lw}
mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)
echo "commit $HWKV_COMMIT; $(date -u +%T)"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1 | head -2
timeout "${LIMIT:-115}" python3 -m hwkv bench routing --model llama-1b --backend cuda --instances 4 \
  --system-len 2048-8192 --suffix-len 64 --requests 120 --concurrency 8 --max-tokens 4 \
  --policies round_robin,cache_aware,cache_aware:1 --workdir /dev/shm/hwkv-bench-models --start-timeout 60 \
  --out-dir "$OUT" 2>&1 | tee "$OUT/routing.log" | tail -n 20
echo "routing rc=${PIPESTATUS[0]} ($(date -u +%T))"
