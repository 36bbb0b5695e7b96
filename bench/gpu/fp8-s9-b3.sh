# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s9-b3.sh   (<= 108 s: A 58, B rest)
# fp8 (#36 FP8 KV decode) session 9, the engine's figures after the layout change: fp8 caches store V pages
# transposed ([H_kv, D, block_size], hwkv.interfaces.kv_quant), every fp8 read takes V as K-major [D, keys] tiles,
# and the long-split fp8 decode tile is one warp with 8 splits (batches 1-2: same-run A/B over a transposed copy). (A) the issue's rows in one run, both caches: `hwkv bench kv-dtype
# --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile` (decode step,
# capacity, bytes, offload / P2P bytes per token, greedy divergence, per-kernel split); (B) one attention layer,
# 32 x 32k: the default tiles of both caches and fp8 tiles around the default.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 106 - ($(date +%s) - t0) )); }
say "A: hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile"
timeout -k 3 58 python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --moved-bytes --profile --workdir /dev/shm/hwkv-fp8 --out "$OUT/kv-dtype.json" 2>&1 \
  | cut -c1-2500
echo "rc=${PIPESTATUS[0]}"
say "B: one attention layer, default tiles and fp8 tiles around them"
timeout -k 2 $(( $(left) - 1 )) python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 \
  --head-size 64 --replays 20 --variants "default" \
  --fp8-variants "${FP8_VARIANTS:-default;split_target=7;default}" --out "$OUT/kv-decode.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say done
