# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/fp8b-s10-b2.sh   (<= 150 s)
# fp8b (#36 FP8 KV decode, the transposed plain-Triton route) session 10 batch 2. Batch 1 (one H200, 4d674c0+4c8ecc4,
# one layer of the 1B shape at 32 x 32k): bf16 515 us, fp8 unified 393 us, the transposed kernel 571 us at its
# default (block_n 128, 4 warps, 5 stages, 3 splits), 490 with per-key-row softmax sums (lacc=1: no cross-warp sum
# per tile), 540 with 3 stages; splits, 64/256 keys, 7 stages, 8 warps, the hand prefetch all slower.
# (T) the kernel tests compiled on the GPU (batch 1 ran them in the interpreter: no second GPU in the slot).
# (A) one layer, 1B shape, 32 x 32k: lacc=1 (now the default) with 3/4 stages, 256 keys, a register cap of 128
#     (4 programs per SM instead of 3), and the one- and two-warp transposed tiles (mma.sync, the softmax down the
#     keys inside one warp: no cross-warp reduction at one warp), beside bf16 and the unified fp8 tile.
# (B) the 8B shape (head 128), 32 x 32k. (C) only if a transposed tile beat the unified fp8 tile in A: the engine's
#     decode step, bf16 vs fp8 with HWKV_CUDA_FP8T=1 and that tile (python3 -m hwkv bench kv-dtype).
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8b] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "T: pytest backends/cuda/tests/test_fp8t.py (compiled)"
timeout -k 2 50 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8t.py > "$OUT/pytest-fp8t.txt" 2>&1
echo "pytest rc=$?"; tail -n 3 "$OUT/pytest-fp8t.txt"
say "A: one layer, 1B shape, 32 x 32k"
V="default;num_stages=3;num_stages=4;block_n=256,num_stages=3;maxnreg=128;num_stages=3,maxnreg=128"
V="$V;num_warps=1,block_n=64,splits=8;num_warps=1,block_n=64,splits=4;num_warps=1,block_n=64,num_stages=3,splits=8"
V="$V;num_warps=2,block_n=64,splits=6;num_warps=2,block_n=64,num_stages=3,splits=6"
V="$V;num_warps=2,block_n=128,num_stages=3,splits=6;lacc=0,num_stages=3"
timeout -k 2 60 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --variants "$V" --out "$OUT/fp8t-1b-32x32k.json" 2>&1 | cut -c1-330
echo "rc=${PIPESTATUS[0]}"
say "B: 8B shape (head 128), 32 x 32k"
timeout -k 2 25 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 --heads 32/8 --head-size 128 \
  --variants "default;num_stages=3;num_warps=1,block_n=64,splits=8" --out "$OUT/fp8t-8b-32x32k.json" 2>&1 | cut -c1-330
echo "rc=${PIPESTATUS[0]}"
BEST=$(python3 - "$OUT/fp8t-1b-32x32k.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"][0]
    print(s["best"][5:] if s["speedup_vs_fp8_unified"] > 1.0 else "NONE")
except Exception:
    print("NONE")
PY
)
say "best transposed tile if it beat the unified one: $BEST"
if [[ $BEST != NONE ]]; then
  [[ $BEST == default ]] && BEST=""
  say "C: engine decode step, HWKV_CUDA_FP8T=1 HWKV_CUDA_FP8T_CONFIG='$BEST'"
  HWKV_CUDA_FP8T=1 HWKV_CUDA_FP8T_CONFIG="$BEST" timeout -k 2 "$(( 145 - ($(date +%s) - t0) ))" \
    python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 \
    --profile --workdir /dev/shm/hwkv-fp8b --out "$OUT/kv-dtype-fp8t.json" > "$OUT/kv-dtype-fp8t.log" 2>&1
  echo "kv-dtype rc=$?"; grep "kv-dtype\]" "$OUT/kv-dtype-fp8t.log" | tail -n 12
  rm -rf /dev/shm/hwkv-fp8b
fi
say done
