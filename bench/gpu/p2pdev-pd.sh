#!/usr/bin/env bash
# p2pdev GPU run B (issue #33): test_ipc on the GPUs (in the background), then P/D (producer GPU 0, consumer
# GPU 1, pull, protocol auto = cuda_ipc first) vs one colocated engine on GPU 0: Llama-3-8B shape bf16 random
# weights, prompts 2k-8k, rates 1 and 3. Pools bounded (--num-kv-blocks 8192 = 16 GiB each, every setup):
# run A's default pools (~110 GB on H200) made each p2p server pin a host mirror as large for the tcp
# fallback, and the disaggregated half ran out of time.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export HWKV_COMMIT=${HWKV_COMMIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export HWKV_BENCH_SERVER_LOGS="$OUT/server-logs"
W=/dev/shm/hwkv-models
step() { echo; echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
free -g | head -2
echo "commit $HWKV_COMMIT"

step "cuda_ipc tests in the background (two processes; same GPU and GPU0->GPU1; every copy method)"
( timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -rs --durations=5 backends/cuda/tests/test_ipc.py backends/cuda/tests/test_pin_host.py \
    > "$OUT/test_ipc.txt" 2>&1; echo "rc=$?" >> "$OUT/test_ipc.txt" ) &
IPC=$!

step "the llama-8b bf16 checkpoint in $W (written once)"
timeout -k 5 80 python3 -c "
import argparse; from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', workdir='$W', dtype='bfloat16')))" 2>&1 | tail -5

step "P/D: producer GPU 0 -> consumer GPU 1 (pull, protocol auto) vs colocated on GPU 0"
timeout -k 15 215 python3 -m hwkv bench pd --model llama-8b --backend cuda --workdir $W --dtype bfloat16 \
  --prefill-devices 0 --decode-devices 1 --mode pull --input-len 5000 --range-ratio 0.6 --output-len 128 \
  --server-args "--num-kv-blocks 8192" --transfer-timeout 10 \
  --num-prompts 20 --request-rate 1,3 --warmup 4 --startup-timeout 120 --out-dir "$OUT" --tag b 2>&1 \
  | tee "$OUT/pd.log" | tail -40
step "test_ipc"
wait $IPC; tail -25 "$OUT/test_ipc.txt"
echo done $(date +%T)
