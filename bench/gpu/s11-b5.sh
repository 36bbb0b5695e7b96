# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/s11-b5.sh   (<= 330 s)
# session 11, batch 5 (#36): where should the Gluon fp8 decode (HWKV_CUDA_FP8G=1) be the default? (A) one layer of
# the 1B shape, batch 1 / 8 / 32 / 128 x context 1k / 8k / 32k: bf16 default, fp8 default, fp8g; (A2) the 8B shape
# (head 128) at batch 1 / 32 / 128 x 1k / 8k; (C) the conformance suite's fp8 sections with HWKV_CUDA_FP8G=1.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[s11] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
G="HWKV_CUDA_FP8G=1"
say "A: 1B layer shapes"
timeout -k 2 130 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 1,8,32,128 --context 1024,8192,32768 \
  --heads 32/8 --head-size 64 --kv-dtypes bf16,fp8 --variants default --fp8-variants "default;$G" \
  --out "$OUT/layer-1b-shapes.json" 2>&1 | grep -v '"kv": "bf16"' | cut -c1-200
echo "rc=${PIPESTATUS[0]}"
say "A2: 8B layer shapes"
timeout -k 2 70 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 1,32,128 --context 1024,8192 \
  --heads 32/8 --head-size 128 --kv-dtypes bf16,fp8 --variants default --fp8-variants "default;$G" \
  --out "$OUT/layer-8b-shapes.json" 2>&1 | grep -v '"kv": "bf16"' | cut -c1-200
echo "rc=${PIPESTATUS[0]}"
say "C: conformance -k fp8 with HWKV_CUDA_FP8G=1"
HWKV_CUDA_FP8G=1 timeout -k 2 110 python3 -m hwkv conformance --backend cuda -k fp8 --report "$OUT/conf" \
  > "$OUT/conformance.log" 2>&1
echo "conformance rc=$?"; tail -n 6 "$OUT/conformance.log"
say done
