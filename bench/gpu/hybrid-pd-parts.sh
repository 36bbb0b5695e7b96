# hybrid (#38): P/D with KV-cache groups on one GPU (cuda:0), stub mode over main's tree - the load copied in
# token-ordered parts: the Gemma-3-1B shape pulled over cuda_ipc (bytes = grouped expectation, tokens = plain
# engine, margin rule), then a fresh consumer whose third read part fails (kept tokens, hit, tokens, pools).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hybrid-pd-parts-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-60}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
t0=$(date +%s)
timeout $((LIMIT - 3)) python -m hwkv_cuda.bench.hybrid_pd --shape gemma3-1b --setups pull:cuda_ipc \
    --prompts 4 --prompt-len 3000 --tokens 32 --fail-part 3 --out "$OUT/hybrid-pd-parts.json"
echo "hybrid_pd rc=$? wall=$(( $(date +%s) - t0 ))s"
