#!/usr/bin/env bash
# fp8 batch 3 (one H200, final figures at main's defaults): A) the engine A/B of issue #36's FP8 rows;
# B) one decode-attention layer at 32 x 32k (1B shape), both caches at their default tiles.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8-b3] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "A hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes"
timeout -k 2 62 python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 \
  --moved-bytes --workdir /dev/shm/hwkv-kvd --out "$OUT/kv-dtype-llama-1b.json"
echo "rc=$?"
say "B kernel 1B shape 32 x 32k: defaults, and fp8 neighbours of the new tile (overrides on top of it)"
T="fp8_unpack=7,head_major=1"  # every variant spelled out: an override also reaches the plan's first pick
F8="default;$T,block_n=64,num_stages=5,num_warps=2,split_target=32;$T,block_n=64,num_stages=6,num_warps=2,split_target=16"
F8="$F8;$T,block_n=32,num_stages=5,num_warps=2,split_target=32;$T,block_n=64,num_stages=5,num_warps=4,split_target=16"
F8="$F8;$T,block_n=64,num_stages=5,num_warps=1,split_target=32"
timeout -k 2 30 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 15 --variants default --fp8-variants "$F8" --out "$OUT/kv-decode-1b-32x32k.json"
echo "rc=$?"
say done
