#!/bin/bash
# The cuda certification twice on one host with two GPUs (run from the repository root, OUT set):
# 1. one GPU (CUDA_VISIBLE_DEVICES=0) from an EMPTY Triton cache - a vendor's first run, every kernel
#    compiled; the time the bar (<= 5 min on one GPU) is about. Report: $OUT/certify.
# 2. --devices 2 on both GPUs, reusing the cache run 1 filled (the compiles are not timed twice);
#    adds the multi-device section (NCCL collectives, tp=2 engine, cuda_ipc transfer). Report:
#    $OUT/certify-2gpu.
# Both reports keep the workers' per-test times in claim order ($OUT/*-work/times-*.txt).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
TRITON_CACHE_DIR=$(mktemp -d /tmp/hwkv-certify-triton-XXXXXX)
export TRITON_CACHE_DIR
echo "== $(date -u +%T) one GPU, empty Triton cache"
CERTIFY_TIMEOUT=${T1:-310} CUDA_VISIBLE_DEVICES=0 bash bench/gpu/certify-1gpu.sh
echo "== $(date -u +%T) two GPUs (--devices 2), cache of run 1"
CERTIFY_TIMEOUT=${T2:-145} bash bench/gpu/certify-2gpu.sh
echo "== $(date -u +%T) done"
