#!/bin/bash
# Tensor parallelism on two GPUs (#34), one script, results into $OUT (run from the repository root):
# 0) the push all-reduce kernels on GPU 0 (two ranks by hand, bit-exact vs torch; the sm_90 compile test)
# 1) hwkv bench allreduce: us per call by size, every path vs NCCL, eager and in a CUDA graph, bit-exact
# 2) Llama-3-8B shape bf16, tp=1 vs tp=2 (custom all-reduce on): batch-1 decode, offline 128 x 512/128
#    at the default budget, MBU per GPU, the driver's host work per step, greedy tokens under the margin
#    rule against float32 HF
# 3) the tiny model in float32, tp=1 vs tp=2: greedy tokens identical, host work per step
# The checkpoint is drawn on GPU 1 in the background while 0) runs on GPU 0. Nothing filtered.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 HWKV_CUSTOM_ALLREDUCE=auto OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh  # ckpt_start / ckpt_wait
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import hwkv, hwkv_cuda, torch, triton; print('hwkv from', hwkv.__file__, hwkv_cuda.__file__, 'torch', torch.__version__, 'triton', triton.__version__)"
ckpt_start llama-8b bfloat16 1
echo "=== 0 push kernels on GPU 0"; date -u
CUDA_VISIBLE_DEVICES=0 timeout -k 5 30 python3 -m pytest -q -p no:cacheprovider backends/cuda/tests/test_allreduce_kernels.py 2>&1 | tail -n 30
echo "=== 1 allreduce microbench"; date -u
timeout -k 5 -s ABRT 35 python3 -m hwkv_cuda.bench.allreduce --world-size 2 --iters 50 --out $OUT/allreduce.json > $OUT/allreduce.log 2>&1; echo "rc=$?"; tail -n 70 $OUT/allreduce.log
ckpt_wait
# the engine runs take the custom all-reduce only if the microbench saw push, push_add and auto bit-exact at every size
# (else NCCL: the tp table, margin rule and host work still come out)
if python3 -c "import json,sys; r=json.load(open('$OUT/allreduce.json'))['rows']; sys.exit(not any(x.get('path')=='push' and x.get('exact') for x in r) or any(x.get('path') in ('push', 'push_add', 'auto') and not x.get('exact') for x in r) or any(x.get('push_spin_timeouts') for x in r))"; then
  echo "push all-reduce bit-exact in the microbench: HWKV_CUSTOM_ALLREDUCE=auto"
else
  echo "push all-reduce NOT seen bit-exact: engine runs on NCCL (HWKV_CUSTOM_ALLREDUCE=off)"; export HWKV_CUSTOM_ALLREDUCE=off
fi
echo "=== 2 llama-8b bf16 tp1 vs tp2"; date -u
timeout -k 5 -s ABRT 130 python3 -m hwkv.bench.tp --model llama-8b --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --reference hf --out $OUT/tp-llama8b.json > $OUT/tp-llama8b.log 2>&1; echo "rc=$?"; tail -n 80 $OUT/tp-llama8b.log
echo "=== 3 tiny fp32 tp1 vs tp2"; date -u
timeout -k 5 -s ABRT 50 python3 -m hwkv.bench.tp --model tiny --dtype float32 --workdir $W --tp 1,2 --decode 16,144 --decode-batch 1 --offline '' --check-tokens 48 --reference none --max-model-len 512 --max-num-seqs 8 --out $OUT/tp-tiny-f32.json > $OUT/tp-tiny-f32.log 2>&1; echo "rc=$?"; tail -n 50 $OUT/tp-tiny-f32.log
date -u
