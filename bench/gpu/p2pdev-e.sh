#!/usr/bin/env bash
# p2pdev GPU run E (issue #33), 2 GPUs, <= 215 s, most important first, results written as they finish.
# Run D (main 07a489e) showed both P/D bars; this run fills what its limit cut:
#  phase 1 (t=0..~105 s, correctness only, side by side on both GPUs):
#   (a) tp=2 producer (GPUs 0,1) -> tp=1 consumer (GPU 1) over cuda_ipc, greedy tokens of 4 prompts scored by
#       float32 HF logits under the conformance margin rule (Llama-3.2-1B shape, random bf16 weights);
#   (d) layerwise push over cuda_ipc, producer GPU 0 -> consumer GPU 1, same token check;
#   (c) backends/cuda/tests/test_ipc.py, after the Llama-3-8B bf16 checkpoint is written;
#  phase 2 (alone): (b) P/D llama-8b, producer GPU 0 -> consumer GPU 1, cuda_ipc and then tcp staging in one run
#   (colocated vs cuda_ipc is run D's), prompts 2k-8k, rate 3 req/s.
set -u
C0=$(cat COMMIT 2>/dev/null || cat ../../COMMIT 2>/dev/null || true)
[ -d hwkv ] || cd ../..  # run from the repository root (the carried main tree)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
export HWKV_COMMIT=${HWKV_COMMIT:-${C0:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HWKV_BENCH_SERVER_LOGS="$OUT/server-logs"
W=/dev/shm/hwkv-models
step() { echo; echo "=== $* ($(date +%T), ${SECONDS}s)"; }
ckpt() { timeout -k 5 "$2" python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='$1', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -5; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c "import hwkv, hwkv_cuda; print('hwkv from', hwkv.__file__, hwkv_cuda.__file__)"
echo "commit $HWKV_COMMIT"

step "the llama-1b bf16 checkpoint"; ckpt llama-1b 40
CHECK="--check-tokens 32 --check-prompts 4 --reference hf --transfer-timeout 10 --startup-timeout 80"
S1="--max-model-len 8192 --num-kv-blocks 4096 --max-num-seqs 8"
step "(a) tp=2 -> tp=1 over cuda_ipc with the margin rule: in the background"
( timeout -k 5 110 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
    --prefill-devices 0,1 --prefill-args "--tensor-parallel-size 2" --decode-devices 1 --protocol cuda_ipc \
    --server-args "$S1" --mode pull --skip-colocated --input-len 2048 --range-ratio 0.5 --output-len 32 \
    --num-prompts 4 --request-rate inf --warmup 1 $CHECK --out-dir "$OUT" --tag e-hetero-tp2to1
  echo "rc=$? at ${SECONDS}s" ) > "$OUT/hetero.log" 2>&1 &
BGA=$!
step "(d) layerwise push over cuda_ipc GPU 0 -> GPU 1 with the margin rule: in the background"
( timeout -k 5 100 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
    --prefill-devices 0 --decode-devices 1 --protocol cuda_ipc --layerwise \
    --server-args "$S1" --mode push --skip-colocated --input-len 2048 --range-ratio 0.5 --output-len 32 \
    --num-prompts 4 --request-rate inf --warmup 1 $CHECK --out-dir "$OUT" --tag e-layerwise
  echo "rc=$? at ${SECONDS}s" ) > "$OUT/layerwise.log" 2>&1 &
BGD=$!

step "the llama-8b bf16 checkpoint in $W"; ckpt llama-8b 60
step "(c) backends/cuda/tests/test_ipc.py"
timeout -k 5 $(( 100 - SECONDS > 20 ? 100 - SECONDS : 20 )) python3 -m pytest -q -p no:cacheprovider -rs \
  --durations=8 backends/cuda/tests/test_ipc.py > "$OUT/test_ipc.txt" 2>&1; echo "rc=$? at ${SECONDS}s" >> "$OUT/test_ipc.txt"
tail -15 "$OUT/test_ipc.txt"
step "waiting for (a) and (d)"
wait $BGA; wait $BGD
echo "--- (a)"; tail -25 "$OUT/hetero.log"; echo "--- (d)"; tail -25 "$OUT/layerwise.log"

step "(b) P/D llama-8b GPU 0 -> GPU 1: cuda_ipc, then tcp staging, one run"
LEFT=$(( 212 - SECONDS )); echo "$LEFT s left for (b)"
timeout -k 3 $LEFT python3 -m hwkv bench pd --model llama-8b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0 --decode-devices 1 --mode pull --protocol cuda_ipc --baseline-protocol tcp --skip-colocated \
  --input-len 5000 --range-ratio 0.6 --output-len 128 --server-args "--num-kv-blocks 8192" --transfer-timeout 10 \
  --num-prompts 8 --request-rate 3 --warmup 1 --startup-timeout 80 --out-dir "$OUT" --tag e-tcp-baseline 2>&1 \
  | tee "$OUT/pd.log" | tail -40
echo done $(date +%T) ${SECONDS}s
