# serve (#39 then #37), batch 3, one GPU (cuda:0), <= 100 s. Results are written as they finish.
# 1. #39: SmolLM2-135M's shape (random weights; the real GGUF cannot ride) through cuda in bf16: margin rule vs
#    HF fp32, exact agreement with HF bf16, prompt_logprobs, offline + batch-1 vs HF generate, batch-1 host share.
# 2. #37: structured-output cost at batch 64 on the same checkpoint (synthetic 49k tokenizer): free vs records
#    (mask worker, numpy host rows), records+gil (0.2 ms GIL switch interval), records+t16 (16 mask threads), records+inline; per-part mask times.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[serve] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda, llguidance; print(hwkv.__file__, hwkv_cuda.__file__, llguidance.__version__)' 2>&1 | tail -n 2)"
nvidia-smi -L 2>&1 | tail -n 2; nproc
W=/dev/shm/hwkv-serve-models
say "1: python3 bench/real_model_gpu.py --shape --workdir $W --tokens 48 --offline-requests 64 --offline-tokens 128 --b1-tokens 192"
timeout -k 2 52 python3 bench/real_model_gpu.py --shape --workdir $W --tokens 48 --offline-requests 64 \
  --offline-tokens 128 --b1-tokens 192 --out "$OUT/real-model-gpu-smollm2-shape.json" 2>&1 | tail -n 60
say "1 rc=${PIPESTATUS[0]}"
left=$(( 97 - ($(date +%s) - t0) ))
say "2 (limit ${left}s): python3 -m hwkv bench structured --model $W/smollm2-135m-shape --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records,records+gil,records+t16,records+inline --repeat 1 --workdir $W"
timeout -k 2 $left python3 -m hwkv bench structured --model $W/smollm2-135m-shape --backend cuda --batch 64 \
  --input-len 128 --output-len 128 --schemas records,records+gil,records+t16,records+inline --repeat 1 --workdir $W \
  --out-dir "$OUT" 2>&1 | tail -n 40
say "2 rc=${PIPESTATUS[0]}"
say done
