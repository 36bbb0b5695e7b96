# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s8-b1.sh   (<= 120 s: A 60, B 32, C 20)
# fp8 (#36 FP8 KV decode) session 8 batch 1, over main: where the fp8 decode step's time goes outside attention.
# (A) `hwkv bench kv-dtype` 1B 32 x 32k with --profile: the per-kernel GPU time of the bf16 and the fp8 decode
#     step (graph replay and eager forward), same run. (B) one attention layer over a pool of 8 GB a layer
#     (the engine's: the step's pages scattered over 2x more fp8 blocks than bf16) vs (C) a cache of exactly the
#     step's pages (last session's probe): does scattering cost fp8 more than bf16?
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "A: hwkv bench kv-dtype --model llama-1b --decode-batch 32 --decode-context 32768 --profile"
timeout -k 3 60 python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --profile --agree-prompts 2 --agree-tokens 16 --workdir /dev/shm/hwkv-fp8 \
  --out "$OUT/kv-dtype-profile.json" 2>&1 | cut -c1-3000
echo "rc=${PIPESTATUS[0]}"
F8="default;block_n=128,num_stages=5;split_target=32;num_warps=4"
say "B: one layer, pool 8 GB a layer (pages scattered as the engine's)"
timeout -k 2 32 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 20 --pool-gb 8 --variants "default;num_stages=5,head_major=1" --fp8-variants "$F8" \
  --out "$OUT/kv-decode-pool8.json"
echo "rc=$?"
say "C: one layer, a cache of the step's pages only"
timeout -k 2 $(( 117 - ($(date +%s) - t0) )) python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 \
  --heads 32/8 --head-size 64 --replays 20 --variants "default" --fp8-variants "default;split_target=32" \
  --out "$OUT/kv-decode-compact.json"
echo "rc=$?"
say done
