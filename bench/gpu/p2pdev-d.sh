#!/usr/bin/env bash
# p2pdev GPU run D (issue #33), 2 GPUs, <= 200 s, most important first, results written as they finish:
#  (1) in the background, correctness only: the tp=2 producer (GPUs 0,1) -> tp=1 consumer (GPU 1) over cuda_ipc,
#      greedy tokens scored by float32 HF logits under the conformance margin rule (Llama-3.2-1B shape, random
#      bf16 weights), then backends/cuda/tests/test_ipc.py; meanwhile the Llama-3-8B bf16 checkpoint is written;
#  (2) alone on both GPUs: P/D colocated (GPU 0) vs producer GPU 0 -> consumer GPU 1 over cuda_ipc, then the same
#      pair over tcp staging (--baseline-protocol tcp; the main comparison's JSON is written before it runs),
#      prompts 2k-8k, rates 1 and 3 req/s; all five servers start at once.
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
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c "import hwkv, hwkv_cuda; print('hwkv from', hwkv.__file__, hwkv_cuda.__file__)"
echo "commit $HWKV_COMMIT"

step "(1) tp=2 -> tp=1 over cuda_ipc, then test_ipc: in the background"
( timeout -k 5 75 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
    --prefill-devices 0,1 --prefill-args "--tensor-parallel-size 2" --decode-devices 1 --protocol cuda_ipc \
    --server-args "--max-model-len 8192 --num-kv-blocks 4096" --mode pull --skip-colocated \
    --input-len 2048 --range-ratio 0.5 --output-len 32 --num-prompts 4 --request-rate inf --warmup 1 \
    --check-tokens 32 --check-prompts 4 --reference hf --transfer-timeout 10 --startup-timeout 60 \
    --out-dir "$OUT" --tag hetero-tp2to1 > "$OUT/hetero.log" 2>&1; echo "rc=$?" >> "$OUT/hetero.log"
  timeout -k 5 $(( 82 - SECONDS > 10 ? 82 - SECONDS : 10 )) python3 -m pytest -q -p no:cacheprovider -rs \
    --durations=5 backends/cuda/tests/test_ipc.py > "$OUT/test_ipc.txt" 2>&1; echo "rc=$?" >> "$OUT/test_ipc.txt" ) &
BG=$!

step "the llama-8b bf16 checkpoint in $W"
timeout -k 5 85 python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -5

step "waiting for (1)"
wait $BG; tail -14 "$OUT/hetero.log"; tail -8 "$OUT/test_ipc.txt"

step "(2) P/D llama-8b: colocated GPU 0 vs cuda_ipc GPU 0 -> GPU 1, then tcp staging GPU 0 -> GPU 1"
LEFT=$(( 196 - SECONDS )); echo "$LEFT s left for (2)"
timeout -k 3 $LEFT python3 -m hwkv bench pd --model llama-8b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0 --decode-devices 1 --mode pull --baseline-protocol tcp \
  --input-len 5000 --range-ratio 0.6 --output-len 128 --server-args "--num-kv-blocks 8192" --transfer-timeout 10 \
  --num-prompts 8 --request-rate 1,3 --warmup 2 --startup-timeout 90 --out-dir "$OUT" --tag d 2>&1 \
  | tee "$OUT/pd.log" | tail -40
echo done $(date +%T) ${SECONDS}s
