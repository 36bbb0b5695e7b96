# b1 (#36 batch-1 decode), session 8, GPU batch 3 (60 s): the final public-defaults figure at main -
# `hwkv bench defaults --model llama-1b` with no engine argument. Its offline part is cut to a few requests (the 1B
# offline figure is perf's); the batch-1 steady decode of 256 tokens is this figure. The engine start alone took
# 33-48 s in this session's calls, so nothing else runs.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "python3 -m hwkv bench defaults --model llama-1b --num-requests 4 --input-len 64 --output-len 8 --b1-tokens 256"
timeout -k 3 55 python3 -m hwkv bench defaults --model llama-1b --num-requests 4 --input-len 64 --output-len 8 \
  --b1-tokens 256 --out "$OUT/defaults-llama-1b.json"
echo "rc=$?"
step done
