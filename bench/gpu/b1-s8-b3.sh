# b1 (#36 batch-1 decode), session 8, GPU batch 3 (70 s): the final public-defaults figure at main -
# `hwkv bench defaults --model llama-1b` with no engine argument (a short offline part; the batch-1 steady decode
# of 256 tokens is the figure), then what time is left: the same-run A/B of this session's batch-1 changes off.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "python3 -m hwkv bench defaults --model llama-1b --num-requests 32 --input-len 128 --output-len 32 --b1-tokens 256"
timeout -k 5 58 python3 -m hwkv bench defaults --model llama-1b --num-requests 32 --input-len 128 --output-len 32 \
  --b1-tokens 256 --out "$OUT"
echo "rc=$?"
step done
