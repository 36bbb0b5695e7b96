#!/bin/bash
# #35 on two GPUs, one script, 150 s: (1) cache-aware routing vs round-robin with 4 instances of the
# Llama-3.2-1B shape (random weights, bf16), two per GPU, 16 tenants of 2k-8k tokens; (2) cold restart
# at an 8k shared prefix on GPU 0: recompute, the persistent pool through the local holder (shared
# memory), over tcp (the result file is rewritten after each); (3) if time is left, the pool get
# throughput of this host, tcp vs holder mode. Needs both GPUs and the mooncake wheel.
# Run from the repository root with OUT set; BUDGET (s, default 148) bounds the whole script.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-c-out}
mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)
t0=$(date +%s)
left() { echo $(( ${BUDGET:-148} - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import hwkv; print('hwkv from', hwkv.__file__, 'commit', '$HWKV_COMMIT')"
echo "== routing: llama-1b, 4 instances (2 per GPU), 16 tenants of 2k-8k tokens"
timeout ${ROUTING_TIMEOUT:-85} python3 -m hwkv bench routing --model llama-1b --backend cuda --instances 4 \
  --devices 0,1 --system-len 2048-8192 --suffix-len 64 --requests 160 --concurrency 8 --max-tokens 4 \
  --workdir /dev/shm/hwkv-bench-models --start-timeout 70 --out-dir "$OUT" 2>&1 | tail -n 40
echo "routing rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
T=$(left); [ "$T" -gt 72 ] && T=72
if [ "$T" -gt 20 ]; then
  echo "== pool-restart: llama-1b, 8192-token prefix, GPU 0, via holder (shared memory) and tcp (limit $T s)"
  CUDA_VISIBLE_DEVICES=0 timeout $T python3 -m hwkv bench pool-restart --model llama-1b \
    --backend cuda --prompt-len 8192 --repeats 1 --capacity-mb 4096 --timeout 40 --via holder,tcp \
    --engine-args '{"enforce_eager": true}' --workdir /dev/shm/hwkv-bench-models --out-dir "$OUT" 2>&1 | tail -n 40
  echo "pool-restart rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
fi
T=$(left)
if [ "$T" -gt 12 ]; then
  echo "== holder get throughput on this host (tcp vs holder mode, 1/2/4 callers; limit $T s)"
  timeout $T python3 bench/gpu/holder_tput.py 2> "$OUT/holder_tput.stderr" | tail -n 12
  echo "tput rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s (its log: holder_tput.stderr)"
fi
