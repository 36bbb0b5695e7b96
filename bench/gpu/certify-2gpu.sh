#!/bin/bash
# cuda certification with --devices 2 (needs both GPUs): the multi-device section runs on two GPUs -
# collectives through NCCL (1 element .. 32 MiB, every declared dtype, under graph capture), the
# Communicator / Device.custom_all_reduce contract, the tensor-parallel engine (tp=2 tokens vs the
# reference under the margin rule), device-direct transfer (cuda_ipc) from GPU 0 to GPU 1 and back - and
# workers spread over both devices.
# Run from the repository root with OUT set; the report lands in $OUT/certify-2gpu.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/hwkv-certify-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
nvidia-smi topo -m | head -n 4
echo "commit $(git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null); $(nproc) cores"
# the workers' logs and per-test times, in claim order (conformance/parallel.py)
export HWKV_CONFORMANCE_WORKDIR=${HWKV_CONFORMANCE_WORKDIR:-$OUT/certify-2gpu-work}
echo "triton cache: ${TRITON_CACHE_DIR:-~/.triton/cache} ($(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' 2>/dev/null | wc -l) cubins before)"
t0=$(date +%s)
timeout ${CERTIFY_TIMEOUT:-230} python3 -m hwkv conformance --backend cuda --certify --devices 2 --report "$OUT/certify-2gpu" "$@" \
  2>&1 | tail -n 60
echo "certify --devices 2 rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - t0 ))s"
echo "triton cache: $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' 2>/dev/null | wc -l) cubins after"
