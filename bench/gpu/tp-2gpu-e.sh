#!/bin/bash
# Tensor parallelism (#34), the last batch of 2026-11-28 (run from the repository root, results into $OUT):
# 0) while the checkpoint is drawn on GPU 1: the decode GEMV tile sweep on GPU 0 at Llama-3-8B's shapes, tp=1 and a
#    tp=2 rank's (dense_probe --quick + one-tile K=4096/8192 preloads); the fastest tile per shape where it beats
#    the engine's own choice by >= 3 % is written as HWKV_CUDA_DENSE_CONFIG_<N>X<K> exports (dense-picks.sh)
# 1) the tiny model in float32, tp=1 vs tp=2: greedy tokens identical; the close (workers leave without an NCCL
#    teardown, the driver aborts while they are alive)
# 2) Llama-3-8B shape bf16, tp=1 vs tp=2 with those tiles (both sizes: the picks cover both sizes' shapes):
#    batch-1 decode, offline 128 x 512/128 at the default budget, greedy tokens vs tp=1 and under the margin rule
#    against float32 HF (the tiles change the bf16 sums), the close time
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh  # ckpt_start / ckpt_wait
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ckpt_start llama-8b bfloat16 1
echo "=== 0 dense GEMV tiles, 8B tp=1 and tp=2 shapes (GPU 0)"; date -u
CUDA_VISIBLE_DEVICES=0 timeout -k 5 110 python3 backends/cuda/scripts/dense_probe.py --model llama-8b-tp2,llama-8b --shapes qkv,o_proj,down,gate_up --quick --pick $OUT/dense-picks.sh --out $OUT/dense > $OUT/dense.log 2>&1; echo "rc=$?"; tail -n 70 $OUT/dense.log
ckpt_wait
echo "=== 1 tiny fp32 tp1 vs tp2"; date -u
timeout -k 5 -s ABRT 90 python3 -m hwkv.bench.tp --model tiny --dtype float32 --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 48 --reference none --max-model-len 512 --max-num-seqs 8 --out $OUT/tp-tiny-f32.json > $OUT/tp-tiny-f32.log 2>&1; echo "rc=$?"; tail -n 40 $OUT/tp-tiny-f32.log
echo "=== 2 llama-8b bf16 tp1 vs tp2 with the picked tiles"; date -u
[[ -s $OUT/dense-picks.sh ]] && source $OUT/dense-picks.sh; env | grep HWKV_CUDA_DENSE_CONFIG || echo "no tile picked: the engine's own"
timeout -k 5 -s ABRT 200 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference hf --out $OUT/tp-llama8b.json > $OUT/tp-llama8b.log 2>&1; echo "rc=$?"; tail -n 60 $OUT/tp-llama8b.log
date -u
