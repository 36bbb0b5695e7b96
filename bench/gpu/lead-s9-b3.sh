# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/lead-s9-b3.sh   (<= 420 s)
# lead (#36) session 9 batch 3, over main: the final public-defaults figures, no engine argument anywhere.
#   1-3. python3 -m hwkv bench defaults --model llama-1b   (offline 256 x 512/256, then batch-1 decode 512 tokens;
#        three runs in the same lease, same GPU: each run's own roofline fraction and MBU)
#   4.   python3 -m hwkv bench defaults --model llama-8b --num-requests 128 --input-len 512 --output-len 128 --b1-tokens 0
#   5.   python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile
# The 8B random-weight checkpoint is written after the 1B runs (not beside them: their figures stay alone on the GPU).
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[lead] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
run() { local limit=$1 name=$2; shift 2; say "($limit s) $*"
  timeout -k 3 "$limit" "$@" --out "$OUT/$name.json" 2>&1 | grep -vE "^\s*$" | cut -c1-600 > "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}; grep -E "^\[defaults\]|^\[kv-dtype\] (torch|non-default)" "$OUT/$name.log" | cut -c1-300
  say "rc=$rc"; }
run 90 defaults-llama-1b python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def
run 70 defaults-llama-1b-r2 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def
run 70 defaults-llama-1b-r3 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def
ckpt_start llama-8b bfloat16 0 150; ckpt_wait
run 130 defaults-llama-8b python3 -m hwkv bench defaults --model llama-8b --workdir "$W" --num-requests 128 \
  --input-len 512 --output-len 128 --b1-tokens 0
run 100 kv-dtype python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --moved-bytes --profile --workdir /dev/shm/hwkv-fp8
say done
