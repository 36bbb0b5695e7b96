#!/bin/bash
# Tensor parallelism (#34), the lead's final call of 2026-11-28 (<= 80 s, run first and alone): main's defaults at
# tp=2, Llama-3-8B shape bf16, batch-1 decode and offline 128 x 512/128. Batch 3 measured half of batch 2's speed
# with a process of its engine-loop step left behind (stuck in symmetric memory's rendezvous, now never tried):
# what is on the GPUs is listed before and after. Main's defaults run first and alone in their engine; with the
# time left a second engine of the same process (the start-up that hung in batches 2 and 3, fixed since) runs the
# all-reduce inside the decode GEMVs: its batch-1 figure is the clean A/B batch 3 could not give (printed as it
# goes; the JSON holds what finished). Workers exit with their driver, so nothing is left for the next step.
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh
gpu_env
T0=$SECONDS
gpu_header
ps -eo pid,etime,pcpu,args | grep -E "hwkv|python" | grep -v grep | cut -c1-160
env | grep HWKV_ || echo "no HWKV_ variable set"
ckpt_start llama-8b bfloat16 0 40; ckpt_wait; echo "at $((SECONDS - T0)) s"
L=$((74 - (SECONDS - T0)))
timeout -k 2 -s ABRT $L python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 2,2:HWKV_TP_FUSED_AR=1 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 0 --reference none --out $OUT/tp-llama8b-final.json > $OUT/tp-llama8b-final.log 2>&1; echo "rc=$?"
grep -v "^ \|^\[W\|^{\|^}" $OUT/tp-llama8b-final.log | tail -n 14
sleep 2; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
date -u; echo "wall $((SECONDS - T0)) s"
