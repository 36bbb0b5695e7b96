# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s9-b1.sh   (<= 115 s: A 80, B rest)
# fp8 (#36 FP8 KV decode) session 9 batch 1. Session 8's Nsight Compute run put the fp8 long-split tile at L1/shared
# 80% busy, DRAM 46%: V crosses shared memory three times a tile (cp.async of e4m3 rows, cast + 16-bit store,
# ldmatrix.trans) because V's contiguous dim is the PV dot's N, not its K. (A) one attention layer, 32 x 32k, 1B
# shape: fp8_unpack=8 reads V pages stored transposed ([H_kv, D, BS] inside a block: K-major for the PV dot, like
# K's tile for QK^T: cp.async, then the operand's own shared loads and a register cast), over a copy of the cache
# so transposed; tiles around the default (1 warp: P and the softmax stay in registers), bf16 beside. (B) Nsight
# Compute on the fastest fp8_unpack=8 variant. Also: does this Triton carry Gluon (idea d)?
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 112 - ($(date +%s) - t0) )); }
python3 -c "import triton; from triton.experimental import gluon; print('triton', triton.__version__, 'gluon', gluon.__name__)" 2>&1 | tail -n 1
say "A: one layer, V pages transposed (fp8_unpack=8)"
timeout -k 2 80 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 20 --variants "default" \
  --fp8-variants "default;fp8_unpack=8;fp8_unpack=8,num_stages=3;fp8_unpack=8,num_stages=7;fp8_unpack=8,num_warps=1;fp8_unpack=8,num_warps=1,split_target=32;fp8_unpack=8,num_warps=4;fp8_unpack=8,block_n=128;fp8_unpack=8,block_n=128,num_warps=4;fp8_unpack=8,block_n=32,num_warps=1,split_target=32;default" \
  --out "$OUT/kv-decode-vt.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
BEST=$(python3 - "$OUT/kv-decode-vt.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kv"] == "fp8" and r["fp8_unpack"] == 8
            and r["rel_err_vs_same_cache"] < 1e-2]
    print(min(rows, key=lambda r: r["us"])["variant"])
except Exception:
    print("fp8_unpack=8")
PY
)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [[ -n $NCU && $(left) -gt 15 ]]; then
  say "B: $NCU on the fp8 variant '$BEST'"
  timeout -k 2 $(( $(left) - 2 )) "$NCU" --kernel-name attention_kernel \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
    --kv-dtypes fp8 --fp8-variants "$BEST" > "$OUT/ncu-fp8-vt.txt" 2>&1
  echo "rc=$?"; grep -E "Duration|DRAM Throughput|L1/TEX Cache|Achieved Occupancy|Registers Per|Block Limit (Reg|Shared)|No Eligible|Shared Memory Config" "$OUT/ncu-fp8-vt.txt"
fi
say done
