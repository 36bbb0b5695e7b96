# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/s11-b3.sh   (<= 400 s)
# session 11, batch 3 (#36 fp8 decode): the Gluon one-warp kernel (HWKV_CUDA_FP8G=1, kernels/attention_fp8g.py).
# (A) one layer of the 1B shape at 32 x 32k in one process: the fp8 default, bt_ahead=1,num_stages=4, and fp8g at
# several pipeline depths / split targets (rel_err_vs_same_cache: each row against the fp8 default's output);
# (T) test_fp8g.py compiled (the kernel against the reference oracle); (N) Nsight Compute of fp8g at its defaults;
# (E) the engine's kv-dtype bench with HWKV_CUDA_FP8G=1. V1B / V8B (the fp8 rows' variants of A / A2) default to
# batch 3's; bench/gpu/s11-b4.sh sets its own.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[s11] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 390 - ($(date +%s) - t0) )); }
G="HWKV_CUDA_FP8G=1+HWKV_CUDA_FP8G_CONFIG"
V=${V1B:-"default;bt_ahead=1,num_stages=4;$G=stages=4;$G=stages=3;$G=stages=5;$G=stages=6;$G=stages=4,split_target=6\
;$G=stages=4,split_target=8;$G=stages=4,split_target=14;$G=stages=3,split_target=14"}
say "A: 1B layer 32 x 32k"
timeout -k 2 120 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --kv-dtypes bf16,fp8 --variants default --fp8-variants "$V" --out "$OUT/layer-1b.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say "A2: 8B shape layer (head 128)"
timeout -k 2 60 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 128 \
  --kv-dtypes bf16,fp8 --variants default --fp8-variants "${V8B:-default;$G=stages=4;$G=stages=3}" \
  --out "$OUT/layer-8b.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say "T: test_fp8g.py (compiled)"
timeout -k 2 70 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8g.py 2>&1 \
  | tee "$OUT/pytest.txt" | tail -n 12
say "N: ncu fp8g (its defaults)"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
HWKV_CUDA_FP8G=1 timeout -k 2 60 "$NCU" --kernel-name fp8g_decode_kernel \
  --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section WarpStateStats --section SourceCounters --section LaunchStats --import-source no -o "$OUT/fp8g" \
  python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
  --kv-dtypes fp8 --fp8-variants default > "$OUT/ncu-run.txt" 2>&1
echo "rc=$?"; tail -n 2 "$OUT/ncu-run.txt" | cut -c1-300
timeout -k 2 20 "$NCU" --import "$OUT/fp8g.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
timeout -k 2 20 "$NCU" --import "$OUT/fp8g.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-sass.csv" 2>&1
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|excessive" \
  "$OUT/ncu-details.txt" | head -n 12
say "E: engine kv-dtype with HWKV_CUDA_FP8G=1 ($(left) s left)"
HWKV_CUDA_FP8G=1 timeout -k 2 $(( $(left) - 5 )) python3 -m hwkv bench kv-dtype \
  --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --workdir /dev/shm/hwkv-fp8 \
  --out "$OUT/kv-dtype-fp8g.json" > "$OUT/kv-dtype.log" 2>&1
echo "rc=$?"; grep -E "^\[kv-dtype\] (auto|fp8):" "$OUT/kv-dtype.log" | cut -c1-200
python3 -c "
import json; d=json.load(open('$OUT/kv-dtype-fp8g.json')); print({k:(v['decode']['step_ms'],v.get('first_divergence')) for k,v in d['runs'].items()}, d['ratios'])" 2>&1 | tail -n 2
say done
