# serve-gguf: #39 on the REAL SmolLM2-135M-Instruct Q4_1 GGUF (bench/real_model_gpu.py), then the #37 structured cost
# with its real tokenizer and chat prompts; one GPU, <= 120 s. GGUF=path (98,362,432 bytes: more than this session's
# device carry of 64 MiB; zstd gives 92.8 MB) or a shared/*.gguf. Ran in session 5 call 1 (main 09915b9): the fresh
# engine start took 46 s and both steps were killed at their limits (bench/results/gguf-smollm2-call1-H200-*); real-gguf.sh
# runs the #39 step alone.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[serve-gguf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
GGUF=${GGUF:-$(ls shared/*.gguf 2>/dev/null | head -n 1)}
say "commit $(cat COMMIT 2>/dev/null); gguf '$GGUF' $(stat -c %s "$GGUF" 2>&1)"
[ -f "$GGUF" ] || { say "no GGUF carried: nothing to do"; exit 2; }
say "1: python3 bench/real_model_gpu.py --gguf $GGUF --hf-fp32-generate"
timeout -k 2 70 python3 bench/real_model_gpu.py --gguf "$GGUF" --hf-fp32-generate \
  --out "$OUT/real-model-gpu-smollm2-gguf.json" 2>&1 | tail -n 60
say "1 rc=${PIPESTATUS[0]}"
left=$(( 117 - ($(date +%s) - t0) ))
say "2 (limit ${left}s): python3 -m hwkv bench structured --model $GGUF --prompts chat --batch 64 --input-len 128 --output-len 128 --schemas records,records+inline --repeat 1"
timeout -k 2 $left python3 -m hwkv bench structured --model "$GGUF" --backend cuda --prompts chat --batch 64 \
  --input-len 128 --output-len 128 --schemas records,records+inline --repeat 1 --out-dir "$OUT" 2>&1 | tail -n 30
say "2 rc=${PIPESTATUS[0]}"
say done
