#!/usr/bin/env bash
# p2pdev GPU run C (issue #33), 2 GPUs, <= 240 s:
#  (a) in the background, correctness only: backends/cuda/tests/test_ipc.py (probe fix, after-event ordering),
#      the tp=2 producer (GPUs 0,1) -> tp=1 consumer (GPU 1) over cuda_ipc, and a layerwise push GPU 0 -> 1
#      over cuda_ipc (writes ordered on the device after each layer's event): greedy tokens scored by
#      float32 HF logits under the conformance margin rule (Llama-3.2-1B shape, random bf16 weights);
#  (b) meanwhile the Llama-3-8B bf16 checkpoint is written; then, alone on both GPUs,
#  (c) P/D: colocated (GPU 0) vs producer GPU 0 -> consumer GPU 1 over cuda_ipc vs the same pair over tcp
#      staging (--baseline-protocol tcp), prompts 2k-8k, rates 1 and 3 req/s; all five servers start at once.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
export HWKV_COMMIT=${HWKV_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HWKV_BENCH_SERVER_LOGS="$OUT/server-logs"
W=/dev/shm/hwkv-models
step() { echo; echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -c "import hwkv, hwkv_cuda; print('hwkv from', hwkv.__file__, hwkv_cuda.__file__)"
echo "commit $HWKV_COMMIT"

step "the llama-1b bf16 checkpoint in $W (before the two checks that share it start)"
timeout -k 5 40 python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-1b', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -3

step "(a) test_ipc, tp=2 -> tp=1 over cuda_ipc, layerwise push over cuda_ipc: in the background"
( timeout -k 5 85 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 backends/cuda/tests/test_ipc.py \
    backends/cuda/tests/test_pin_host.py > "$OUT/test_ipc.txt" 2>&1; echo "rc=$?" >> "$OUT/test_ipc.txt" ) &
IPC=$!
( timeout -k 5 95 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
    --prefill-devices 0,1 --prefill-args "--tensor-parallel-size 2" --decode-devices 1 --protocol cuda_ipc \
    --server-args "--max-model-len 8192 --num-kv-blocks 4096" --mode pull --skip-colocated \
    --input-len 2048 --range-ratio 0.5 --output-len 32 --num-prompts 4 --request-rate inf --warmup 1 \
    --check-tokens 32 --check-prompts 4 --reference hf --transfer-timeout 10 --startup-timeout 90 \
    --out-dir "$OUT" --tag hetero-tp2to1 > "$OUT/hetero.log" 2>&1; echo "rc=$?" >> "$OUT/hetero.log" ) &
HET=$!
( timeout -k 5 95 python3 -m hwkv bench pd --model llama-1b --backend cuda --workdir $W --dtype bfloat16 \
    --prefill-devices 0 --decode-devices 1 --layerwise --protocol cuda_ipc \
    --server-args "--max-model-len 8192 --num-kv-blocks 4096" --skip-colocated \
    --input-len 2048 --range-ratio 0.5 --output-len 32 --num-prompts 4 --request-rate inf --warmup 1 \
    --check-tokens 32 --check-prompts 4 --reference hf --transfer-timeout 10 --startup-timeout 90 \
    --out-dir "$OUT" --tag layerwise > "$OUT/layerwise.log" 2>&1; echo "rc=$?" >> "$OUT/layerwise.log" ) &
LW=$!

step "(b) the llama-8b bf16 checkpoint in $W"
timeout -k 5 90 python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -5

step "waiting for (a)"
wait $IPC; tail -8 "$OUT/test_ipc.txt"
wait $HET; tail -14 "$OUT/hetero.log"
wait $LW; tail -14 "$OUT/layerwise.log"

step "(c) P/D llama-8b: colocated GPU 0 vs cuda_ipc GPU 0 -> GPU 1 vs tcp staging GPU 0 -> GPU 1"
LEFT=$(( 232 - SECONDS )); echo "$LEFT s left for (c)"
timeout -k 5 $LEFT python3 -m hwkv bench pd --model llama-8b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0 --decode-devices 1 --mode pull --baseline-protocol tcp \
  --input-len 5000 --range-ratio 0.6 --output-len 128 --server-args "--num-kv-blocks 8192" --transfer-timeout 10 \
  --num-prompts 10 --request-rate 1,3 --warmup 2 --startup-timeout 110 --out-dir "$OUT" --tag c 2>&1 \
  | tee "$OUT/pd.log" | tail -30
echo done $(date +%T)
