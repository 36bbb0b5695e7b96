#!/bin/bash
# pool (#35), one GPU, <= 120 s: cache-aware routing vs round-robin with 4 instances of the Llama-3.2-1B
# shape (random weights, bf16) time-sharing one GPU, 16 tenants of 2k-8k tokens (+64), 120 requests at
# concurrency 8, in one run: round_robin and cache_aware (POLICIES; cache_aware:W adds --load-weight W).
# The servers take a 2,048-token step budget (ENGINE_ARGS): at the default 8,192 (batch D, main 07a489e:
# TTFT p50 x1.59) a hit that arrives while its instance prefills an 8k miss waits for that whole step;
# does a smaller budget help the hits more than round-robin's misses? (On the CPU it did not:
# docs/routing.md.) Both policies run on the same servers. Run from the repository root, OUT set.
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
  --policies "${POLICIES:-round_robin,cache_aware}" --engine-args "${ENGINE_ARGS:---max-num-batched-tokens 2048}" --workdir /dev/shm/hwkv-bench-models --start-timeout 60 \
  --out-dir "$OUT" 2>&1 | tee "$OUT/routing.log" | tail -n 20
echo "routing rc=${PIPESTATUS[0]} ($(date -u +%T))"
