#!/bin/bash
# Tensor parallelism (#34), batch 2 of the 2026-11-28 fifth session: the row-parallel all-reduce inside the decode
# GEMVs (HWKV_TP_FUSED_AR=1) against main's push kernel in one process: Llama-3-8B shape bf16 at tp=2, batch-1
# decode, greedy tokens of every checked prompt generated alone (the one-token path the fused ops take), so the
# fused run's tokens must equal the push run's (the same sums); then preload=2 (batch 1) and NCCL's settings (offline).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh
T0=$SECONDS
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep HWKV_ || echo "no HWKV_ variable set"
echo "=== checkpoint (GPU 0, background) beside the GPU test of the fused all-reduce (tiny bf16, tp=2: same tokens as the push kernel)"
ckpt_start llama-8b bfloat16 0 110
HWKV_PLUGIN_MODULES=hwkv_cuda.plugin timeout -k 5 -s ABRT 100 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_tp_cuda.py -k push_kernel > $OUT/test-fused.log 2>&1; echo "test rc=$?"; tail -n 15 $OUT/test-fused.log
ckpt_wait; echo "at $((SECONDS - T0)) s"
echo "=== llama-8b bf16 tp=2: push kernel (main), all-reduce in the GEMVs, + preload=2, + MLP halves, + NCCL settings"
date -u; LEFT=$((232 - (SECONDS - T0)))
# one process, five tp=2 engines, each against the first (main's defaults; tp=1 is call 1's and batch 3's): the fused
# all-reduce (batch 1; offline unaffected: the fused path is one-token forwards only), then with qkv, gate_up and
# down's first weight tile loaded before the wait (preload=2, one token only: batch 1), then the fused all-reduce with
# the prefill's MLP in two row halves whose all-reduces overlap the other half's MLP (forwards of >= 4096 tokens:
# offline), then with NCCL's channels, buffer and protocol raised (the 128 MB prefill all-reduces: offline; the
# logits' 256 KB all-gather is NCCL's too). Tokens of each checked prompt generated alone (the one-token path): the fused runs' must equal the
# push run's (the same sums). The JSON is saved after every run.
PEEL="block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=2"
timeout -k 5 -s ABRT $LEFT python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 2,2:HWKV_TP_FUSED_AR=1,2:HWKV_TP_FUSED_AR=1+HWKV_CUDA_DENSE_CONFIG_3072X4096=$PEEL+HWKV_CUDA_DENSE_CONFIG_14336X4096=$PEEL+HWKV_CUDA_DENSE_CONFIG_4096X7168=$PEEL,2:HWKV_TP_FUSED_AR=1+HWKV_TP_OVERLAP_TOKENS=4096,2:HWKV_TP_FUSED_AR=1+NCCL_MIN_NCHANNELS=32+NCCL_BUFFSIZE=8388608+NCCL_PROTO=Simple --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --check-alone --reference none --out $OUT/tp-llama8b-fused.json > $OUT/tp-llama8b-fused.log 2>&1; echo "rc=$?"
grep -v "^ " $OUT/tp-llama8b-fused.log | tail -n 30; python3 -c "
import json; d = json.load(open('$OUT/tp-llama8b-fused.json')); print(json.dumps({k: d.get(k) for k in ('ratios', 'token_agreement')}, indent=1))
for r in d['runs']: print(r.get('label'), r.get('batch1'), r.get('offline'), r.get('custom_paths'))" 2>&1 | tail -60
date -u; echo "wall $((SECONDS - T0)) s"
