# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s8-b2b.sh   (<= 100 s)
# perf (#36) session 8 batch 2b, over main: the 1B public-defaults offline workload in ONE engine, two rounds, tokens
# compared: main (full-grid decode tile: one warp, 64 keys, head-major; rope of q and k in one launch) against rope in
# two launches (HWKV_CUDA_ROPE_QK=0), the elementwise kernels (RMSNorm, RoPE, SiLU-mul) with programmatic dependent
# launch (HWKV_CUDA_ELEMENTWISE_PDL=1) and four stages on the decode tile. rope2 and pdl must give main's tokens in
# 256/256 requests (the same bits).
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 2 (main, rope2, pdl, s4)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 96 python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 2 --out "$OUT" --variants '[{"name": "main"},
  {"name": "rope2", "env": {"HWKV_CUDA_ROPE_QK": "0"}},
  {"name": "pdl", "env": {"HWKV_CUDA_ELEMENTWISE_PDL": "1"}},
  {"name": "s4", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "num_stages=4"}}]' \
  2>&1 | cut -c1-600
echo "rc=${PIPESTATUS[0]}"
say done
