#!/bin/bash
# cuda certification under the current suite on ONE GPU, timed (the bar: <= 5 minutes wall on one
# H100 with no coverage dropped). Parallel workers share the one device (auto: min(12, cores / 2));
# each worker gets its share of the host's cores for torch's CPU ops (conformance/parallel.py).
# Run from the repository root with OUT set; the report lands in $OUT/certify. Pass --workers N to
# override. Uses device 0 only (another one-GPU script may run on the other GPU of the host).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/hwkv-certify-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null); $(nproc) cores"
python3 -c "import hwkv, hwkv_cuda; print('hwkv from', hwkv.__file__, '| hwkv_cuda from', hwkv_cuda.__file__)"
# the workers' logs and per-test times, in claim order (conformance/parallel.py)
export HWKV_CONFORMANCE_WORKDIR=${HWKV_CONFORMANCE_WORKDIR:-$OUT/certify-work}
echo "triton cache: ${TRITON_CACHE_DIR:-~/.triton/cache} ($(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' 2>/dev/null | wc -l) cubins before)"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout ${CERTIFY_TIMEOUT:-360} python3 -m hwkv conformance --backend cuda --certify \
  --report "$OUT/certify" "$@" 2>&1 | tail -n 60
echo "certify rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - t0 ))s"
echo "triton cache: $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' 2>/dev/null | wc -l) cubins after"
