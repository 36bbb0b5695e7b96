# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s8-b3.sh   (<= 100 s)
# perf (#36) session 8 batch 3, over main: the final public-defaults figures (no engine argument): Llama-3.2-1B shape
# offline 256 x 512 / 256 first (the bar), then the Llama-3-8B shape offline 128 x 512 / 128, then the 1B again with
# the time left (a repeat: both 1B figures are reported). The 8B random-weight checkpoint is written in the background
# (same GPU) while the first 1B runs.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
W=/dev/shm/hwkv-models
(timeout -k 5 60 python3 -c "
import argparse, time; t = time.time()
from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', dtype='bfloat16', workdir='$W')), 'written in', round(time.time() - t, 1), 's')
" > "$OUT/write.log" 2>&1; echo "write rc=$?" >> "$OUT/write.log") &
WRITER=$!
say "1B: python3 -m hwkv bench defaults --model llama-1b --b1-tokens 0 (the 8B checkpoint is being written)"
timeout -k 2 45 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 0 \
  --out "$OUT/defaults-llama-1b.json" 2>&1 | grep -vE "^\s*$" | cut -c1-400
echo "rc=${PIPESTATUS[0]}"
wait "$WRITER"; tail -n 3 "$OUT/write.log"
grep -q "write rc=0" "$OUT/write.log" || rm -rf "$W"
left=$(( 96 - ($(date +%s) - t0) )); [ "$left" -gt 5 ] || left=5; [ "$left" -lt 62 ] || left=62
say "8B (${left}s): python3 -m hwkv bench defaults --model llama-8b --num-requests 128 --input-len 512 --output-len 128 --b1-tokens 0"
timeout -k 2 "$left" python3 -m hwkv bench defaults --model llama-8b --workdir "$W" --num-requests 128 --input-len 512 \
  --output-len 128 --b1-tokens 0 --out "$OUT/defaults-llama-8b.json" 2>&1 | grep -vE "^\s*$" | cut -c1-400
echo "rc=${PIPESTATUS[0]}"
left=$(( 97 - ($(date +%s) - t0) ))
if [ "$left" -gt 24 ]; then
  say "1B again (${left}s): python3 -m hwkv bench defaults --model llama-1b --b1-tokens 0"
  timeout -k 2 "$left" python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 0 \
    --out "$OUT/defaults-llama-1b-repeat.json" 2>&1 | grep -vE "^\s*$" | cut -c1-400
  echo "rc=${PIPESTATUS[0]}"
fi
say done
