#!/bin/bash
# Cold restart with the persistent pool at the Llama-3.2-1B shape (random weights, bf16), 8k-token
# shared prefix: a real mooncake master + holder, engine processes on GPU 0 (one at a time).
# Needs the mooncake wheel on the device. Run from the repository root with OUT set.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/hwkv-pool-restart-out}
mkdir -p "$OUT"
echo "== pool-restart: llama-1b, 8192-token prefix"
timeout ${POOL_RESTART_TIMEOUT:-120} python3 -m hwkv bench pool-restart --model llama-1b --backend cuda \
  --prompt-len 8192 --repeats 1 --capacity-mb 4096 --timeout 60 --workdir /dev/shm/hwkv-bench-models \
  --out-dir "$OUT" 2>&1 | tail -n 30
echo "pool-restart rc=${PIPESTATUS[0]}"
