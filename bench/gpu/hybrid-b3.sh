# hybrid (#38) batch 3, one GPU (cuda:0), stub mode over main's tree; two small jobs side by side (no timings):
# (1) GPT-OSS shape in bf16, teacher-forced margin-rule counts, transformers bf16 vs hwkv bf16 against
#     transformers float32 at every position (seeds written as they end);
# (2) P/D with KV-cache groups pulled over cuda_ipc in token-ordered parts on the Qwen2 window shape (a full and a
#     window-128 group): bytes, tokens, margin rule, then a consumer whose third part fails.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hybrid-b3-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-60}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
t0=$(date +%s)
timeout $((LIMIT - 4)) python -m hwkv_cuda.bench.teacher_forced --shape gpt-oss-small --backend cuda \
    --seeds 0,1,2,3,4 --prompts 4 --out "$OUT/gpt-oss-teacher-forced.json" > "$OUT/teacher-forced.log" 2>&1 &
tf=$!
timeout $((LIMIT - 4)) python -m hwkv_cuda.bench.hybrid_pd --shape qwen2-window --setups pull:cuda_ipc \
    --prompts 4 --prompt-len 600 --tokens 32 --fail-part 3 --part-tokens 128 --out "$OUT/hybrid-pd-parts.json" > "$OUT/hybrid-pd.log" 2>&1 &
pd=$!
wait $tf; echo "teacher_forced rc=$? wall=$(( $(date +%s) - t0 ))s"
wait $pd; echo "hybrid_pd rc=$? wall=$(( $(date +%s) - t0 ))s"
grep -v "Loading weights\|Writing model" "$OUT/teacher-forced.log" | tail -n 12
grep -v "Loading weights\|Writing model" "$OUT/hybrid-pd.log" | tail -n 12
