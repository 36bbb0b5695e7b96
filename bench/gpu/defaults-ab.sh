# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/defaults-ab.sh   (~165 s, +100 s for the 8B step)
# fp8 (#36) batch 3 (one GPU), over main: the public defaults (no engine argument) NEW (main) against OLD (this
# session's changes turned off: torch.compile's elementwise kernels, full-width block-table copies, the 1B GEMV
# tiles of the old rule), one run; the attention of the workload's prefill/mixed/decode steps; then the 8B shape
# at main (optional, last).
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
say "NEW: python3 -m hwkv bench defaults --model llama-1b --b1-tokens 256 (main)"
timeout -k 2 60 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 256 \
  --out "$OUT/defaults-llama-1b-new.json" 2>&1 | grep -E "^\[defaults\]|Error|Traceback"
echo "rc=$?"
say "OLD: HWKV_CUDA_ELEMENTWISE=0 + graph_runner.COMPACT_MIN=2^62 + the old rule's 1B GEMV tiles (HWKV_CUDA_DENSE_CONFIG_<N>X<K>)"
( export HWKV_CUDA_ELEMENTWISE=0 \
    HWKV_CUDA_DENSE_CONFIG_3072X2048=block_n=8,block_k=2048,num_warps=4,num_stages=1,preload=1 \
    HWKV_CUDA_DENSE_CONFIG_2048X2048=block_n=8,block_k=2048,num_warps=4,num_stages=1,preload=1 \
    HWKV_CUDA_DENSE_CONFIG_16384X2048=block_n=4,block_k=2048,num_warps=4,num_stages=1,preload=1 \
    HWKV_CUDA_DENSE_CONFIG_2048X8192=block_n=4,block_k=2048,num_warps=8,num_stages=3,preload=0
  timeout -k 2 80 python3 -c "import sys; import hwkv.engine.graph_runner as g; g.COMPACT_MIN = 1 << 62; \
from hwkv.cli import main; sys.exit(main(sys.argv[1:]))" bench defaults --model llama-1b --workdir /dev/shm/hwkv-def \
    --b1-tokens 256 --out "$OUT/defaults-llama-1b-old.json" 2>&1 | grep -E "^\[defaults\]|Error|Traceback" )
echo "rc=$?"
say "P: attention of the offline workload's prefill, mixed and decode steps (backends/cuda/scripts/attn_step_probe.py)"
timeout -k 2 25 python3 backends/cuda/scripts/attn_step_probe.py "$OUT/prefill-probe.json" cuda 2>&1 | cut -c1-260 | tail -n 20
echo "rc=$?"
say "8B: python3 -m hwkv bench defaults --model llama-8b --num-requests 128 --input-len 512 --output-len 128 --b1-tokens 0 (optional)"
timeout -k 2 100 python3 -m hwkv bench defaults --model llama-8b --workdir /dev/shm/hwkv-models --num-requests 128 \
  --input-len 512 --output-len 128 --b1-tokens 0 --out "$OUT/defaults-llama-8b-new.json" 2>&1 | grep -E "^\[defaults\]|Error|Traceback"
echo "rc=$?"
say done
