# hybrid (#38): GPT-OSS shape in bf16 on one GPU (cuda:0), stub mode over main's tree.
# Most important first: teacher-forced margin-rule counts (transformers bf16 vs hwkv bf16 against transformers
# float32 at every position, the CPU table's five seeds x 4 prompts), then greedy parity if time is left.
# Every result is written as it finishes.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hybrid-gptoss-out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-60}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) $(date -u +%FT%TZ)"
python -c "import hwkv; print('hwkv from', hwkv.__file__)"
t0=$(date +%s)
left() { echo $(( LIMIT - 3 - ($(date +%s) - t0) )); }
timeout $(( $(left) - 12 )) python -m hwkv_cuda.bench.teacher_forced --shape gpt-oss-small --backend cuda \
    --seeds 0,1,2,3,4 --prompts 4 --out "$OUT/gpt-oss-teacher-forced.json"
echo "teacher_forced rc=$? wall=$(( $(date +%s) - t0 ))s"
if [ "$(left)" -gt 15 ]; then
  timeout "$(left)" python -m hwkv_cuda.bench.hybrid_parity --shape gpt-oss-small --out "$OUT/gpt-oss-parity.json"
  echo "hybrid_parity rc=$? wall=$(( $(date +%s) - t0 ))s"
else
  echo "hybrid_parity skipped: $(left) s left"
fi
