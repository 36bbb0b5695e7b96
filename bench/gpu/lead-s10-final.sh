# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/lead-s10-final.sh   (<= 480 s)
# lead (#36) session 10, the final figures over main, public defaults (no engine argument anywhere):
#   1. python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile
#   2. (RUN_CERT=1) bash bench/gpu/certify-1gpu.sh   (= hwkv conformance --backend cuda --certify, one GPU)
#   3. (RUN_1B=1) python3 -m hwkv bench defaults --model llama-1b            (offline 256 x 512/256 + batch-1 decode)
#   4. (RUN_8B=1) python3 -m hwkv bench defaults --model llama-8b --num-requests 128 --input-len 512 --output-len 128 --b1-tokens 0
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[lead] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
run() { local limit=$1 name=$2; shift 2; say "($limit s) $*"
  timeout -k 3 "$limit" "$@" --out "$OUT/$name.json" 2>&1 | grep -vE "^\s*$" | cut -c1-600 > "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}; grep -E "^\[defaults\]|^\[kv-dtype\]" "$OUT/$name.log" | cut -c1-300 | tail -n 30
  say "rc=$rc"; }
run 110 kv-dtype python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --moved-bytes --profile --workdir /dev/shm/hwkv-fp8
rm -rf /dev/shm/hwkv-fp8
# the 8B checkpoint is written beside the certification (saves ~30 s; the certification's wall is no bar here)
[[ ${RUN_8B:-0} == 1 ]] && ckpt_start llama-8b bfloat16 0 100
if [[ ${RUN_CERT:-0} == 1 ]]; then
  say "certify (one GPU)"
  HWKV_CONFORMANCE_WORKDIR=/tmp/certwork CERTIFY_TIMEOUT=${CERT_S:-230} bash bench/gpu/certify-1gpu.sh
fi
if [[ ${RUN_1B:-0} == 1 ]]; then
  run 90 defaults-llama-1b python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def
fi
if [[ ${RUN_8B:-0} == 1 ]]; then
  ckpt_wait
  run 130 defaults-llama-8b python3 -m hwkv bench defaults --model llama-8b --workdir "$W" --num-requests 128 \
    --input-len 512 --output-len 128 --b1-tokens 0
  rm -rf "$W"
fi
say done
