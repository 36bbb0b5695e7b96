#!/bin/bash
# #35 on two GPUs, one script, BUDGET seconds (default 118), two benches side by side, one GPU each:
# (1) GPU 1: cache-aware routing vs round-robin with 4 instances of the Llama-3.2-1B shape (random
#     weights, bf16) sharing that GPU, 16 tenants of 2k-8k tokens (the 4-instance workload; 4 servers
#     time-share one GPU, the same for both policies);
# (2) GPU 0: cold restart at an 8k shared prefix: recompute, the persistent pool through the local
#     holder (shared memory), over tcp (its result file is rewritten after each run).
# The two share the host's CPUs (32 cores). Needs the mooncake wheel. Run from the repository root with OUT set.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-c-out}
mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)
T=$(( ${BUDGET:-118} - 6 ))
t0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import hwkv; print('hwkv from', hwkv.__file__, 'commit', '$HWKV_COMMIT')"
echo "== (GPU 1) routing: llama-1b, 4 instances on one GPU, 16 tenants of 2k-8k tokens; (GPU 0) pool-restart 8k; limit $T s each"
( CUDA_VISIBLE_DEVICES=1 timeout $T python3 -m hwkv bench routing --model llama-1b --backend cuda --instances 4 \
    --system-len 2048-8192 --suffix-len 64 --requests 120 --concurrency 8 --max-tokens 4 \
    --workdir /dev/shm/hwkv-bench-models --start-timeout 70 --out-dir "$OUT" > "$OUT/routing.txt" 2>&1
  echo "routing rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/routing.txt" ) &
( CUDA_VISIBLE_DEVICES=0 timeout $T python3 -m hwkv bench pool-restart --model llama-1b --backend cuda \
    --prompt-len 8192 --repeats 1 --capacity-mb 4096 --timeout 40 --via holder,tcp \
    --engine-args '{"enforce_eager": true}' --workdir /dev/shm/hwkv-bench-models-restart --out-dir "$OUT" \
    > "$OUT/pool-restart.txt" 2>&1
  echo "pool-restart rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/pool-restart.txt" ) &
wait
echo "== routing"; tail -n 40 "$OUT/routing.txt"
echo "== pool-restart"; tail -n 40 "$OUT/pool-restart.txt"
