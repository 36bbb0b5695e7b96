#!/bin/bash
# Tensor parallelism (#34) on two GPUs, one script (run from the repository root, results into $OUT):
# 0) while the checkpoint is drawn on GPU 1: the decode GEMV tile sweep at a tp=2 rank's Llama-3-8B shapes on GPU 0
#    (dense_probe --model llama-8b-tp2 --quick: the engine's choice per shape vs 12 tiles, PDL chains in a graph)
# 1) the tiny model in float32, tp=1 vs tp=2: greedy tokens identical, the driver's host work per step
# 2) Llama-3-8B shape bf16, tp=1 vs tp=2 (custom all-reduce, the default): batch-1 decode, offline 128 x 512/128
#    at the default budget, greedy tokens under the margin rule against float32 HF, the close (bounded), and
#    --profile: every rank's GPU time per step by kernel kind (batch-1 decode, the offline prefill and decode)
# 3) tp=2 on NCCL alone (HWKV_CUSTOM_ALLREDUCE=off): batch-1 decode and the offline run, the A/B of the custom
#    all-reduce (offline tp=2 was 9,363 tok/s on NCCL at 6d17dc2, 5,580 with the push path at ed3398d)
# 4) tp=2 batch-1 decode with the push all-reduce launched without PDL (HWKV_PUSH_PDL=0): the A/B of PDL
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh  # ckpt_start / ckpt_wait
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import hwkv, hwkv_cuda, torch; print('hwkv from', hwkv.__file__, hwkv_cuda.__file__, torch.__version__)"
ckpt_start llama-8b bfloat16 1
echo "=== 0 dense GEMV tiles at tp=2 shapes (GPU 0)"; date -u
CUDA_VISIBLE_DEVICES=0 timeout -k 5 110 python3 backends/cuda/scripts/dense_probe.py --model llama-8b-tp2 --quick --out $OUT/dense-tp2 > $OUT/dense-tp2.log 2>&1; echo "rc=$?"; tail -n 60 $OUT/dense-tp2.log
ckpt_wait
echo "=== 1 tiny fp32 tp1 vs tp2"; date -u
timeout -k 5 -s ABRT 60 python3 -m hwkv.bench.tp --model tiny --dtype float32 --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 48 --reference none --max-model-len 512 --max-num-seqs 8 --out $OUT/tp-tiny-f32.json > $OUT/tp-tiny-f32.log 2>&1; echo "rc=$?"; tail -n 50 $OUT/tp-tiny-f32.log
echo "=== 2 llama-8b bf16 tp1 vs tp2: table, margin rule, profile"; date -u
timeout -k 5 -s ABRT 240 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference hf --profile $OUT/prof --out $OUT/tp-llama8b.json > $OUT/tp-llama8b.log 2>&1; echo "rc=$?"; tail -n 400 $OUT/tp-llama8b.log
echo "=== 3 llama-8b tp2 on NCCL only: batch-1 and offline"; date -u
HWKV_CUSTOM_ALLREDUCE=off timeout -k 5 -s ABRT 80 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 0 --reference none --out $OUT/tp-llama8b-nccl.json > $OUT/tp-llama8b-nccl.log 2>&1; echo "rc=$?"; tail -n 30 $OUT/tp-llama8b-nccl.log
echo "=== 4 llama-8b tp2 batch-1, push all-reduce without PDL"; date -u
HWKV_PUSH_PDL=0 timeout -k 5 -s ABRT 80 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 0 --reference none --out $OUT/tp-llama8b-nopdl.json > $OUT/tp-llama8b-nopdl.log 2>&1; echo "rc=$?"; tail -n 30 $OUT/tp-llama8b-nopdl.log
date -u
