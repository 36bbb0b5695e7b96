#!/bin/bash
# Tensor parallelism (#34), batch 3 (the last) of the 2026-11-28 fifth session: the final figures at main's code
# defaults, no HWKV_ variable set (run from the repository root, results into $OUT):
# 1) while the 8B checkpoint is drawn on GPU 0: the tiny model in float32, tp=1 vs tp=2, every checked prompt
#    generated alone (the one-token path: fused decode ops, the tp=2 all-reduce as the defaults run it) - greedy
#    tokens identical; host work per step
# 2) Llama-3-8B shape bf16, tp=1 vs tp=2 in one process: batch-1 decode, offline 128 x 512/128 at the default budget,
#    greedy tokens (each prompt alone) vs tp=1 and under the margin rule against float32 HF, the close time
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh  # ckpt_start / ckpt_wait
T0=$SECONDS
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep HWKV_ || echo "no HWKV_ variable set"
ckpt_start llama-8b bfloat16 0 110
echo "=== 1 tiny fp32 tp1 vs tp2 (each prompt alone)"; date -u
timeout -k 5 -s ABRT 45 python3 -m hwkv.bench.tp --model tiny --dtype float32 --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 48 --check-alone --reference none --max-model-len 512 --max-num-seqs 8 --out $OUT/tp-tiny-f32.json > $OUT/tp-tiny-f32.log 2>&1; echo "rc=$?"; grep -v "^ " $OUT/tp-tiny-f32.log | tail -n 12; grep -A8 '"token_agreement"' $OUT/tp-tiny-f32.log
ckpt_wait; echo "at $((SECONDS - T0)) s"
echo "=== 2 llama-8b bf16 tp1 vs tp2, main's defaults"; date -u; LEFT=$((196 - (SECONDS - T0)))
timeout -k 5 -s ABRT $LEFT python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --check-alone --reference hf --out $OUT/tp-llama8b.json > $OUT/tp-llama8b.log 2>&1; echo "rc=$?"
grep -v "^ " $OUT/tp-llama8b.log | tail -n 20; python3 -c "
import json; d = json.load(open('$OUT/tp-llama8b.json')); print(json.dumps({k: d.get(k) for k in ('ratios', 'token_agreement', 'margin_rule')}, indent=1))
for r in d['runs']: print(r.get('label'), r.get('batch1'), r.get('offline'), r.get('custom_paths'), r.get('close_s'))" 2>&1 | tail -60
date -u; echo "wall $((SECONDS - T0)) s"
