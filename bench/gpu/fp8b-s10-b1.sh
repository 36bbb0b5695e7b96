# usage (repository root, two GPUs): OUT=<dir> bash bench/gpu/fp8b-s10-b1.sh   (<= 170 s)
# fp8b (#36 FP8 KV decode, the transposed plain-Triton route) session 10 batch 1. First GPU run of
# hwkv_cuda/kernels/attention_fp8t.py (HWKV_CUDA_FP8T=1): keys in the MMA's M dimension, K and V^T tiles cast from
# e4m3 in registers for wgmma with A from registers (the CPU compile for sm_90 shows it: cp.async -> ld.shared in the
# dot-operand layout -> cvt -> wgmma {A regs}, 154 registers at block_n 128).
# (S) the sm_90 compile of the device's Triton (CPU only, beside the rest): wgmma with register A, registers.
# (A, GPU 0) one layer of the 1B shape at 32 x 32k: bf16 and fp8 at their default tiles vs the fp8t kernel at
#     15 tiles (keys per tile, stages, split targets and counts, the hand prefetch, per-row sums, 8 warps).
# (T, GPU 1) the fp8t kernel tests compiled; (B, GPU 1) the 8B shape (head 128), 32 x 32k, 4 tiles.
# (C, GPU 0) only if a fp8t tile beat the unified fp8 tile in A: the engine's decode step, bf16 vs fp8 with
#     HWKV_CUDA_FP8T=1 and that tile (python3 -m hwkv bench kv-dtype, the session-9 lead command).
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8b] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "S: sm_90 compile (CPU) in the background"
(timeout -k 2 100 python3 backends/cuda/scripts/fp8t_asm.py "$OUT/asm" > "$OUT/asm.log" 2>&1; echo "asm rc=$?" >> "$OUT/asm.log") &
ASM=$!
say "T+B on GPU 1 in the background"
(
  CUDA_VISIBLE_DEVICES=1 timeout -k 2 80 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8t.py \
    > "$OUT/pytest-fp8t.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest-fp8t.txt"
  CUDA_VISIBLE_DEVICES=1 timeout -k 2 40 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 \
    --heads 32/8 --head-size 128 --variants "default;block_n=64;split_target=8;num_stages=3" \
    --out "$OUT/fp8t-8b-32x32k.json" > "$OUT/fp8t-8b.log" 2>&1; echo "8b rc=$?" >> "$OUT/fp8t-8b.log"
) &
G1=$!
say "A: one layer, 1B shape, 32 x 32k (GPU 0)"
V="default;split_target=2;split_target=8;split_target=16;num_stages=3;num_stages=7;block_n=64;block_n=64,num_stages=7"
V="$V;block_n=256,num_stages=3;lacc=1;prefetch=1,num_stages=1;prefetch=1,lacc=1,num_stages=1;num_warps=8;splits=4;splits=6"
CUDA_VISIBLE_DEVICES=0 timeout -k 2 85 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 \
  --heads 32/8 --head-size 64 --variants "$V" --out "$OUT/fp8t-1b-32x32k.json" 2>&1 | cut -c1-400
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
say "best fp8t tile: $BEST"
if [[ $BEST != NONE ]]; then
  [[ $BEST == default ]] && BEST=""
  say "C: engine decode step, HWKV_CUDA_FP8T=1 HWKV_CUDA_FP8T_CONFIG='$BEST' (GPU 0)"
  CUDA_VISIBLE_DEVICES=0 HWKV_CUDA_FP8T=1 HWKV_CUDA_FP8T_CONFIG="$BEST" timeout -k 2 "$(( 165 - ($(date +%s) - t0) ))" \
    python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 \
    --profile --workdir /dev/shm/hwkv-fp8b --out "$OUT/kv-dtype-fp8t.json" > "$OUT/kv-dtype-fp8t.log" 2>&1
  echo "kv-dtype rc=$?"; grep "kv-dtype\]" "$OUT/kv-dtype-fp8t.log" | tail -n 12
  rm -rf /dev/shm/hwkv-fp8b
fi
wait $G1; wait $ASM
tail -n 5 "$OUT/pytest-fp8t.txt"; cut -c1-400 "$OUT/fp8t-8b.log"; cut -c1-500 "$OUT/asm.log" | grep -v Warn
say done
