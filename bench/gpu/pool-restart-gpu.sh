#!/bin/bash
# Cold restart with the persistent pool at the Llama-3.2-1B shape (random weights, bf16), 8k-token
# shared prefix: a real mooncake master + holder, engine processes on GPU 0 (one at a time): recompute,
# the pool through the holder on this host (shared memory), the pool over tcp.
# Needs the mooncake wheel on the device. Run from the repository root with OUT set.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-restart-out}
mkdir -p "$OUT"
MODEL=${MODEL:-llama-1b}
echo "== pool-restart: $MODEL, 8192-token prefix"
timeout ${POOL_RESTART_TIMEOUT:-120} python3 -m hwkv bench pool-restart --model "$MODEL" --backend cuda \
  --prompt-len 8192 --repeats 1 --capacity-mb 4096 --timeout 60 --via holder,tcp \
  --engine-args '{"enforce_eager": true}' --workdir /dev/shm/hwkv-bench-models --out-dir "$OUT" 2>&1 | tail -n 30
echo "pool-restart rc=${PIPESTATUS[0]}"
