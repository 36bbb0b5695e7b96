#!/bin/bash
# (session 10: written for the mailbox; never run - no two-GPU kind was lent after the lead's call 1. The next
# two-GPU run of #34: bash bench/gpu/tpoff-s10-2gpu.sh with OUT set.)
# tpoff two-GPU request (#34 offline at tp=2), 180 s: the engine A/B with tp=1 for the ratio (three 8B engines,
# ~30-45 s each, checkpoint ~30 s, then a short probe): the copy-engine all-reduce (HWKV_CE_ALLREDUCE=2: one-shot by
# DMA on a side stream, the sum fused into the next RMSNorm, beside the other prefill row half's GEMMs) has never run
# on two GPUs (its device mechanics passed on one GPU, batch 2). Main's decode attention is two warps at head 128 now.
#   2:CE2+halves | 2: NCCL, no halves (main's defaults) | 1 (the ratio's reference)
source bench/gpu/lib.sh; gpu_env; gpu_header
T0=$SECONDS
W=/dev/shm/hwkv-models
ckpt_start llama-8b bfloat16 0 60; ckpt_wait; echo "ckpt at $((SECONDS - T0)) s"
RUNS="2:HWKV_CE_ALLREDUCE=2+HWKV_TP_OVERLAP_TOKENS=4096,2:HWKV_CE_ALLREDUCE=0+HWKV_TP_OVERLAP_TOKENS=0,1"
L=$((150 - (SECONDS - T0)))
timeout -k 2 -s ABRT $L python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp "$RUNS" --decode-batch '' \
  --offline 128:512:128 --check-tokens 32 --reference none --out $OUT/tp-llama8b-ce.json \
  > $OUT/tp-llama8b-ce.log 2>&1; echo "tp rc=$?"
grep -v "^ \|^\[W\|^{\|^}" $OUT/tp-llama8b-ce.log | grep -v "^frame\|^Search\|^CUDA kernel\|^Compile with\|Loading" | tail -n 40
L=$((176 - (SECONDS - T0)))
[ $L -gt 12 ] && { timeout -k 2 $L python3 bench/gpu/ce_probe.py --modes 2 --norm --out $OUT/ce-probe.json > $OUT/ce-probe.log 2>&1
  echo "probe rc=$?"; grep "^rank" $OUT/ce-probe.log | tail -n 12; }
date -u; echo "wall $((SECONDS - T0)) s"
