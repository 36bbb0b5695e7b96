# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/s11-b1.sh   (<= 420 s)
# session 11, batch 1 (#36 fp8 decode): (A) one layer of the 1B shape at 32 x 32k, bf16 default and fp8 tile variants
# in one process - the K/V pipeline depth (num_stages; bt_ahead=1 loads the next tile's block ids one tile ahead so
# Triton keeps num_stages - 1 K/V tiles in flight, not (num_stages - 1) // 2); (T) the bt_ahead kernel tests compiled;
# (N) Nsight Compute of bt_ahead=1,num_stages=4 with warp-state and source counters (report kept);
# (E) the engine's kv-dtype bench with that variant (HWKV_CUDA_ATTN_CONFIG_FP8), to see the step ratio.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[s11] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 410 - ($(date +%s) - t0) )); }
say "A: 1B layer 32 x 32k"
V="default;num_stages=7;bt_ahead=1,num_stages=3;bt_ahead=1,num_stages=4;bt_ahead=1,num_stages=5"
V="$V;bt_ahead=1,num_stages=4,num_warps=8;bt_ahead=1,num_stages=3,block_n=64;bt_ahead=1,num_stages=4,split_target=8"
timeout -k 2 170 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --variants default --fp8-variants "$V" --out "$OUT/layer-1b.json" 2>&1 | cut -c1-400
echo "rc=${PIPESTATUS[0]}"
say "T: bt_ahead kernel tests (compiled)"
timeout -k 2 45 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8_kv.py \
  backends/cuda/tests/test_kernels.py -k "bt_ahead" 2>&1 | tee "$OUT/pytest.txt" | tail -n 4
say "N: ncu bt_ahead=1,num_stages=4"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
HWKV_CUDA_ATTN_CONFIG_FP8="bt_ahead=1,num_stages=4" timeout -k 2 70 "$NCU" --kernel-name decode_heads_kernel \
  --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section WarpStateStats --section SourceCounters --section LaunchStats --import-source no -o "$OUT/heads-bt4" \
  python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
  --kv-dtypes fp8 --fp8-variants default > "$OUT/ncu-run.txt" 2>&1
echo "rc=$?"; tail -n 3 "$OUT/ncu-run.txt"
timeout -k 2 20 "$NCU" --import "$OUT/heads-bt4.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
timeout -k 2 20 "$NCU" --import "$OUT/heads-bt4.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu-sass.csv" 2>&1
echo "details $(wc -l < "$OUT/ncu-details.txt") lines, sass $(wc -l < "$OUT/ncu-sass.csv") lines"
grep -E "Duration|DRAM Throughput|Memory Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Issued Ipc" \
  "$OUT/ncu-details.txt" | head -n 12
say "E: engine kv-dtype with bt_ahead=1,num_stages=4 ($(left) s left)"
HWKV_CUDA_ATTN_CONFIG_FP8="bt_ahead=1,num_stages=4" timeout -k 2 $(( $(left) - 5 )) python3 -m hwkv bench kv-dtype \
  --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --workdir /dev/shm/hwkv-fp8 \
  --out "$OUT/kv-dtype-bt4.json" > "$OUT/kv-dtype.log" 2>&1
echo "rc=$?"; grep -E "step|ratio|tok/s" "$OUT/kv-dtype.log" | tail -n 8
say done
