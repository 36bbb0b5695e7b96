#!/usr/bin/env bash
# p2pdev GPU run C (issue #33): (1) tp=2 producer (GPUs 0,1) -> tp=1 consumer (GPU 1) over cuda_ipc, pull;
# greedy tokens scored by float32 HF logits under the conformance margin rule (Llama-3.2-1B shape, random
# bf16 weights; colocated = the same tp=2 engine alone); (2) the tcp staging baseline of run B's P/D workload.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export HWKV_COMMIT=${HWKV_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HWKV_BENCH_SERVER_LOGS="$OUT/server-logs"
W=/dev/shm/hwkv-models
step() { echo; echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
echo "commit $HWKV_COMMIT"

step "tp=2 producer (GPUs 0,1) -> tp=1 consumer (GPU 1), cuda_ipc pull, llama-1b bf16"
timeout -k 10 150 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0,1 --prefill-args "--tensor-parallel-size 2" --decode-devices 1 --protocol cuda_ipc \
  --server-args "--memory-fraction 0.4 --max-model-len 8192 --num-kv-blocks 4096" --mode pull \
  --input-len 2048 --range-ratio 0.5 --output-len 64 --num-prompts 16 --request-rate inf --warmup 2 \
  --check-tokens 32 --check-prompts 6 --reference hf --transfer-timeout 10 --startup-timeout 100 \
  --out-dir "$OUT" --tag hetero-tp2to1 2>&1 | tee "$OUT/hetero.log" | tail -30

step "the llama-8b bf16 checkpoint in $W (written once)"
timeout -k 5 80 python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -5

step "tcp staging baseline: llama-8b, producer GPU 0 -> consumer GPU 1, run B's workload"
timeout -k 10 140 python3 -m hwkv bench pd --model llama-8b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0 --decode-devices 1 --protocol tcp --skip-colocated --server-args "--num-kv-blocks 8192" \
  --mode pull --input-len 5000 --range-ratio 0.6 --output-len 128 --transfer-timeout 10 \
  --num-prompts 20 --request-rate 1,3 --warmup 4 --startup-timeout 100 --out-dir "$OUT" --tag tcp 2>&1 \
  | tee "$OUT/tcp.log" | tail -30
echo done $(date +%T)
