# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/s11-b2.sh   (<= 200 s)
# session 11, batch 2 (#36 fp8 decode): (A) one layer of the 1B shape at 32 x 32k, fp8 tile variants in one process:
# heads_outer=1 builds K as [keys, H_kv, D] and V as [D, H_kv, keys] (then permuted) so a quarter-warp's 16-byte V
# pieces are consecutive rows of one page (batch 1's Nsight Compute: V loads at 2x their ideal L2 sectors, 8-way
# shared-store conflicts); (T) their kernel tests compiled; (N) Nsight Compute of heads_outer=1,bt_ahead=1,num_stages=4.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[s11] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "A: 1B layer 32 x 32k"
V="default;bt_ahead=1,num_stages=4;heads_outer=1,bt_ahead=1,num_stages=4;heads_outer=1,bt_ahead=1,num_stages=3"
V="$V;heads_outer=1,num_stages=5;heads_outer=1,bt_ahead=1,num_stages=4,num_warps=8"
timeout -k 2 110 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --kv-dtypes fp8 --fp8-variants "$V" --out "$OUT/layer-1b.json" 2>&1 | cut -c1-330
echo "rc=${PIPESTATUS[0]}"
say "T: kernel tests (compiled)"
timeout -k 2 40 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8_kv.py \
  backends/cuda/tests/test_kernels.py -k "heads_outer" 2>&1 | tee "$OUT/pytest.txt" | tail -n 3
say "N: ncu heads_outer=1,bt_ahead=1,num_stages=4"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
HWKV_CUDA_ATTN_CONFIG_FP8="heads_outer=1,bt_ahead=1,num_stages=4" timeout -k 2 60 "$NCU" --kernel-name decode_heads_kernel \
  --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section WarpStateStats --section SourceCounters --import-source no -o "$OUT/heads-ho" \
  python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
  --kv-dtypes fp8 --fp8-variants default > "$OUT/ncu-run.txt" 2>&1
echo "rc=$?"
timeout -k 2 20 "$NCU" --import "$OUT/heads-ho.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
timeout -k 2 20 "$NCU" --import "$OUT/heads-ho.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-sass.csv" 2>&1
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|excessive" \
  "$OUT/ncu-details.txt" | head -n 12
say done
