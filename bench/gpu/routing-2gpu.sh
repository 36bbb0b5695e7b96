#!/bin/bash
# Cache-aware routing vs round-robin at the Llama-3.2-1B shape (random weights, bf16): two hwkv serve
# instances, one per GPU, behind `hwkv proxy --instances` (one router per policy, same run).
# Run from the repository root with OUT set (results land there); needs both GPUs.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/hwkv-routing-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null
echo "== routing bench: llama-1b, 2 instances (GPU 0, GPU 1), 16 tenants of 2k-8k tokens"
timeout 210 python3 -m hwkv bench routing --model llama-1b --backend cuda --instances 2 --devices 0,1 \
  --system-len 2048-8192 --suffix-len 64 --requests 200 --concurrency 8 --max-tokens 4 \
  --workdir /dev/shm/hwkv-bench-models --start-timeout 120 --out-dir "$OUT" 2>&1 | tail -n 40
echo "routing rc=${PIPESTATUS[0]}"
