# hybrid (#38): the pool connector with KV-cache groups on one GPU (cuda:0), stub mode over main's tree.
# Most important first: the staged (device) path on the Gemma-3-1B shape - bytes loaded vs the grouped
# expectation and vs one group, the margin rule against HF float32, a lost full-group chunk (partial
# load) recomputed; then the packed path if time is left. Every result is written as it finishes.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hybrid-pool-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-118}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) $(date -u +%H:%M:%S)"
python -c "import hwkv; print('hwkv from', hwkv.__file__)"
t0=$(date +%s)
timeout $((LIMIT - 8)) python -m hwkv_cuda.bench.hybrid_pool --shape gemma3-1b --modes staged,packed \
    --prompts 4 --prompt-len 600 --tokens 16 --out "$OUT/hybrid-pool.json"
echo "hybrid_pool rc=$? wall=$(( $(date +%s) - t0 ))s $(date -u +%H:%M:%S)"
