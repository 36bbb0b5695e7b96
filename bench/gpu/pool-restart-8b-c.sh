#!/bin/bash
# pool (#35), one GPU, LIMIT s (default 145), needs the mooncake wheel. Call 1 (main 8b3214a,
# pool-restart-8b-b.sh): the 8B load is bound by the store calls - one get call at a time, served by
# one holder thread (one memcpy stream, ~6 GB/s): bf16 x1.22, fp8 KV x2.03 (goal x4); session 5 saw
# no gain from more callers on one client (one connection to the holder?). Now a load's get can run
# as load_parallel concurrent calls on one client and/or over load_clients holder-mode clients (each
# its own shared memory, staging and connection); the holder has 16 service threads; 1 GiB of staging
# holds 30 of the 8B's 33.5 MB chunks. The measured run uses 8 clients; A/B in ONE process per dtype
# (best of two each): 1 (the old path: one call per half of the staging), 4/8/16 calls on one client,
# c4/c8 clients, c8p2; tokens checked against the device-cache hit. 1. 8B checkpoint (~25 s); 2. bf16; 3. the raw holder throughput
# (bench/gpu/holder_tput.py, 32 x 16 MiB values of 32 segments: 1/4/8 callers on one holder-mode
# client vs spread over 4/8 clients, each its own shared memory and connection); 4. fp8 KV.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-8b-c}
mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)
T0=$(date +%s)
left() { echo $(( ${LIMIT:-145} - ($(date +%s) - T0) - $1 )); }
echo "commit $HWKV_COMMIT; $(date -u +%T); $(nproc) cores"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1 | head -2
W=/dev/shm/hwkv-pool-models
timeout -k 5 "$(left 5)" python3 -c "
import argparse, time; t = time.time()
from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', dtype='bfloat16', workdir='$W')), 'written in', round(time.time() - t, 1), 's')
" 2>&1 | tail -n 3; echo "write rc=${PIPESTATUS[0]}"
R=(python3 -m hwkv bench pool-restart --backend cuda --repeats 1 --capacity-mb 4096 --via holder --one-process
   --workdir "$W" --model llama-8b --prompt-len 7905 --suffix-len 32 --chunk-size 256 --staging-mb 1024 --timeout 60
   --holder-threads 16 --pool-config '{"load_parallel": 1, "load_clients": 8}' --ab-parallel "${AB:-1,4,8,16,c4,c8,c8p2}")
echo "== 2. llama-8b bf16, 7,937-token prompt, 256-token chunks, holder, load_parallel A/B ($(date -u +%T))"
mkdir -p "$OUT/8b-bf16"
timeout "$(left 1)" "${R[@]}" --engine-args '{"enforce_eager": true}' --out-dir "$OUT/8b-bf16" 2>&1 | tee "$OUT/8b-bf16.log" | tail -n 12
echo "8b-bf16 rc=${PIPESTATUS[0]} ($(date -u +%T))"
if [[ $(left 0) -ge 52 ]]; then
  echo "== 3. raw holder throughput: callers on one client vs one client each ($(left 0) s left)"
  HOLDER_THREADS=16 PARS=1,4,8 CLIENTS=1,4,8 NO_TCP=1 timeout 20 python3 bench/gpu/holder_tput.py 32 16777216 32 2>&1 \
    | grep -v "^[IWE][0-9]" | tee "$OUT/holder_tput.log" | tail -n 9
fi
if [[ $(left 0) -ge 40 ]]; then
  echo "== 4. llama-8b fp8 KV, as 2 ($(left 0) s left)"
  mkdir -p "$OUT/8b-fp8"
  timeout "$(left 1)" "${R[@]}" --engine-args '{"enforce_eager": true, "kv_cache_dtype": "fp8"}' \
    --out-dir "$OUT/8b-fp8" 2>&1 | tee "$OUT/8b-fp8.log" | tail -n 12
  echo "8b-fp8 rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
