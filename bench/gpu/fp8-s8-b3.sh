# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s8-b3.sh   (<= 80 s: A 60, B rest)
# fp8 (#36 FP8 KV decode) session 8 batch 3, the final figures at main. (A) every row of the issue in one run:
# `hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes
# --profile` (decode step at the public-default forward, capacity, bytes per block, offload / P2P bytes per token,
# greedy divergence, per-kernel split of the step); (B) one attention layer at the default tiles, both caches.
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 77 - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "A: hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile"
timeout -k 3 60 python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --moved-bytes --profile --workdir /dev/shm/hwkv-fp8 --out "$OUT/kv-dtype-final.json" 2>&1 \
  | cut -c1-2500
echo "rc=${PIPESTATUS[0]}"
say "B: one attention layer at the default tiles, both caches"
timeout -k 2 $(( $(left) - 1 )) python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 \
  --head-size 64 --replays 20 --variants "default" --out "$OUT/kv-decode-final.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say done
