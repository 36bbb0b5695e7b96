#!/bin/bash
# pool (#35), last batch (one GPU, <= 125 s): where a restarted instance's load time goes on the GPU host.
# 1. `hwkv bench pool-restart` at the Llama-3.2-1B shape, 8k prefix, holder and tcp: each pool run prints
#    its load's split (store get calls / waiting for the staging->device copies / rest of the TTFT);
# 2. the store alone with the connector's value shape: 32 segments of 16 KiB per 512 KiB value (1B, one
#    block per chunk), holder mode and tcp;
# 3. packed loads (pool config pack=true: one segment per value, scattered on the device), one engine
#    process per --via (--one-process: recompute, then the same prompt from the pool);
# 4. 256-token chunks (16 blocks per value: 32 segments of 256 KiB), --one-process.
# Run from the repository root with OUT set. Needs the mooncake wheel.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-batch3}
mkdir -p "$OUT"
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null); $(nproc) cores; $(df -h /dev/shm | tail -1)"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1 | head -2
RESTART=(python3 -m hwkv bench pool-restart --model llama-1b --backend cuda --prompt-len 8192 --repeats 1
         --capacity-mb 4096 --timeout 40 --via holder,tcp --engine-args '{"enforce_eager": true}'
         --workdir /dev/shm/hwkv-bench-models)
date -u +%T
echo "== 1. pool-restart llama-1b 8k, one block per chunk"
mkdir -p "$OUT/c16"
timeout 48 "${RESTART[@]}" --out-dir "$OUT/c16" 2>&1 | tail -n 20
echo "pool-restart c16 rc=${PIPESTATUS[0]}"
date -u +%T
echo "== 2. store gets of the connector's value shapes"
timeout 12 python3 bench/gpu/holder_tput.py 256 524288 32 2>&1 | tail -n 8
echo "holder_tput 1B-shape rc=${PIPESTATUS[0]}"
date -u +%T
echo "== 3. packed loads, one process per via"
mkdir -p "$OUT/packed"
timeout 32 "${RESTART[@]}" --one-process --pool-config '{"pack": true}' --out-dir "$OUT/packed" 2>&1 | tail -n 12
echo "packed rc=${PIPESTATUS[0]}"
date -u +%T
echo "== 4. 256-token chunks, one process per via"
mkdir -p "$OUT/c256"
timeout 30 "${RESTART[@]}" --one-process --chunk-size 256 --out-dir "$OUT/c256" 2>&1 | tail -n 12
echo "c256 rc=${PIPESTATUS[0]}"
date -u +%T
