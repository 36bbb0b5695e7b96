#!/bin/bash
# Tensor parallelism (#34), batch 2 of the session of 2026-11-28 evening (<= 200 s, 2 GPUs, alone): an A/B in one
# process, Llama-3-8B shape bf16, batch-1 decode and offline 128 x 512/128 at the default budget, tp=1 beside:
#   2                                    main's defaults
#   2:HWKV_TP_OVERLAP_TOKENS=4096        prefill in row halves, each all-reduce beside the other half's work (7c0813f)
#   2:HWKV_TP_FUSED_AR=1                 batch 1: the all-reduce inside the GEMVs, one NVLink arrival per call (165d102)
#   2:NCCL_MIN_NCHANNELS=32              prefill: NCCL's 128 MB all-reduces on more channels (256 GB/s measured)
#   2:<qkv, gate_up preload=2>           batch 1: the GEMVs after a push all-reduce load their first weight tile
#                                        before the PDL wait (HBM is idle while the all-reduce crosses NVLink)
# Most important first; the JSON holds what finished. Greedy tokens (32 x 4) of every run against tp=1's.
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh
gpu_env
T0=$SECONDS
gpu_header
env | grep HWKV_ || echo "no HWKV_ variable set"
ckpt_start llama-8b bfloat16 0 60; ckpt_wait; echo "ckpt at $((SECONDS - T0)) s"
PRE="HWKV_CUDA_DENSE_CONFIG_3072X4096=preload=2+HWKV_CUDA_DENSE_CONFIG_14336X4096=preload=2"
RUNS="1,2,2:HWKV_TP_OVERLAP_TOKENS=4096,2:HWKV_TP_FUSED_AR=1,2:NCCL_MIN_NCHANNELS=32,2:$PRE"
L=$((194 - (SECONDS - T0)))
timeout -k 2 -s ABRT $L python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp "$RUNS" --decode 16,144 \
  --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference none --out $OUT/tp-llama8b-b2.json \
  > $OUT/tp-llama8b-b2.log 2>&1; echo "rc=$?"
grep -v "^ \|^\[W\|^{\|^}" $OUT/tp-llama8b-b2.log | tail -n 40
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
date -u; echo "wall $((SECONDS - T0)) s"
