#!/bin/bash
# Tensor parallelism (#34), batch 3 of the evening session of 2026-11-28 (<= 150 s, 2 GPUs, alone): main's defaults,
# no HWKV_ variable set - Llama-3-8B shape bf16, tp=1 vs tp=2 in one process: batch-1 decode, offline 128 x 512/128
# at the default budget, greedy tokens (32 x 4) of both against each other and the margin rule against HF float32.
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh
gpu_env
T0=$SECONDS
gpu_header
env | grep -E "HWKV_|NCCL_" || echo "no HWKV_/NCCL_ variable set"
ckpt_start llama-8b bfloat16 0 60; ckpt_wait; echo "ckpt at $((SECONDS - T0)) s"
L=$((144 - (SECONDS - T0)))
timeout -k 2 -s ABRT $L python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 \
  --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference hf --out $OUT/tp-llama8b-b3.json \
  > $OUT/tp-llama8b-b3.log 2>&1; echo "rc=$?"
grep -v "^ \|^\[W\|^{\|^}" $OUT/tp-llama8b-b3.log | tail -n 30
python3 -c "import json; d = json.load(open('$OUT/tp-llama8b-b3.json')); print(json.dumps({k: d.get(k) for k in ('ratios', 'token_agreement', 'margin_rule')}))"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
date -u; echo "wall $((SECONDS - T0)) s"
