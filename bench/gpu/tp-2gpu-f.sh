#!/bin/bash
# Tensor parallelism (#34): main's defaults after batch 3 (the decode GEMV tiles of M1_TILES in the code, no
# override; the NCCL abort bounded at 1 s): Llama-3-8B shape bf16 tp=1 vs tp=2, batch-1 decode and offline
# 128 x 512/128 at the default budget, greedy tokens vs tp=1, the close time; then the A/B of preloaded tiles for
# the two GEMVs that follow a push all-reduce at tp=2 (qkv, gate_up: second in the sweep's chains, but a
# preloaded weight tile streams during the all-reduce in the engine). Results into $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep HWKV_ || echo "no HWKV_ variable set"
echo "=== llama-8b bf16 tp1 vs tp2, main's defaults"; date -u
timeout -k 5 -s ABRT 170 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference none --out $OUT/tp-llama8b.json > $OUT/tp-llama8b.log 2>&1; echo "rc=$?"; tail -n 60 $OUT/tp-llama8b.log
echo "=== llama-8b tp2 batch-1, qkv and gate_up preloaded"; date -u
HWKV_CUDA_DENSE_CONFIG_3072X4096=block_n=4,block_k=1024,num_warps=4,num_stages=1,preload=1 HWKV_CUDA_DENSE_CONFIG_14336X4096=block_n=4,block_k=2048,num_warps=4,num_stages=1,preload=1 timeout -k 5 -s ABRT 80 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 0 --reference none --out $OUT/tp-llama8b-preload.json > $OUT/tp-llama8b-preload.log 2>&1; echo "rc=$?"; tail -n 30 $OUT/tp-llama8b-preload.log
date -u
