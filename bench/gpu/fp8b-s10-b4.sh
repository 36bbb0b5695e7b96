# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/fp8b-s10-b4.sh   (<= 150 s)
# fp8b (#36) last request: is the transposed one-warp tile (HWKV_CUDA_FP8T=1, 786 vs 887 us at the 8B shape in batch 2)
# a default for head 128? (A) one layer, 8B shape (32/8 heads of 128), 32 x 32k, same process: bf16, fp8 default,
# fp8t default (one warp, 64 keys, 8 splits) and 4 / 16 splits, 3 stages, two warps; (A2) the same with the unified
# kernel's one-warp tile forced at head 128 (HWKV_CUDA_ATTN_CONFIG_FP8), which may be what wins there.
# (T) the kernel tests compiled. (C) python3 -m hwkv conformance --backend cuda -k fp8 with HWKV_CUDA_FP8T=1 (the
# route forced on every fp8 decode of the suite, head 64).
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8b] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "A: 8B shape layer"
V="default;splits=4;splits=16;num_stages=3;num_warps=2,block_n=64,splits=8"
timeout -k 2 30 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 --heads 32/8 --head-size 128 \
  --variants "$V" --out "$OUT/fp8t-8b-32x32k.json" 2>&1 | cut -c1-300
echo "rc=${PIPESTATUS[0]}"
say "A2: 8B shape, the unified one-warp tile forced"
HWKV_CUDA_ATTN_CONFIG_FP8="fp8_unpack=7,num_warps=1,block_n=64,num_stages=5,split_target=15,head_major=1" \
  timeout -k 2 20 python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 --heads 32/8 --head-size 128 \
  --variants "default" --out "$OUT/fp8t-8b-unified1w.json" 2>&1 | cut -c1-300
echo "rc=${PIPESTATUS[0]}"
say "C: conformance -k fp8 with HWKV_CUDA_FP8T=1"
HWKV_CUDA_FP8T=1 timeout -k 2 70 python3 -m hwkv conformance --backend cuda -k fp8 --report "$OUT/conf" \
  > "$OUT/conformance.log" 2>&1
echo "conformance rc=$?"; tail -n 6 "$OUT/conformance.log"
say "T: pytest backends/cuda/tests/test_fp8t.py (compiled)"
timeout -k 2 "$(( 145 - ($(date +%s) - t0) ))" python3 -m pytest -q -x -p no:cacheprovider \
  backends/cuda/tests/test_fp8t.py > "$OUT/pytest-fp8t.txt" 2>&1
echo "pytest rc=$?"; tail -n 3 "$OUT/pytest-fp8t.txt"
say done
