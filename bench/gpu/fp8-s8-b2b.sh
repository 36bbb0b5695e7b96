# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s8-b2b.sh   (<= 100 s: A 45, B rest)
# fp8 (#36 FP8 KV decode) session 8 batch 2b, over main. Nsight Compute (batch 2) put the fp8 long-split tile at
# 138 registers (6 programs of 2 warps per SM, 18.75% occupancy) with L1/shared 80% busy and DRAM 46%: (A) one
# attention layer, 32 x 32k, the default tile under a register cap (maxnreg) and one-warp tiles with many programs,
# bf16 beside it; (B) Nsight Compute on the fastest fp8 variant of A (occupancy, L1 vs DRAM).
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 97 - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
say "A: one layer, register caps and one-warp tiles"
timeout -k 2 45 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 20 --variants "default" \
  --fp8-variants "default;maxnreg=128;maxnreg=112;maxnreg=96;num_stages=4,maxnreg=96;num_warps=1,block_n=32,split_target=32;num_warps=1,block_n=32,split_target=32,maxnreg=128;num_warps=1,block_n=32,num_stages=7,split_target=32;maxnreg=80,num_stages=3" \
  --out "$OUT/kv-decode-maxnreg.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
BEST=$(python3 - "$OUT/kv-decode-maxnreg.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kv"] == "fp8" and r["rel_err_vs_same_cache"] < 1e-2]
    print(min(rows, key=lambda r: r["us"])["variant"])
except Exception:
    print("default")
PY
)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [[ -n $NCU && $BEST != default && $(left) -gt 15 ]]; then
  say "B: $NCU on the fp8 variant '$BEST'"
  HWKV_CUDA_ATTN_CONFIG_FP8="$BEST" timeout -k 2 $(( $(left) - 2 )) "$NCU" --kernel-name attention_kernel \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats \
    python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
    --kv-dtypes fp8 > "$OUT/ncu-fp8-best.txt" 2>&1
  echo "rc=$?"; grep -E "Duration|DRAM Throughput|L1/TEX Cache|Achieved Occupancy|Registers Per|Block Limit (Reg|Shared)|No Eligible" "$OUT/ncu-fp8-best.txt"
fi
say done
