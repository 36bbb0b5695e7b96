# real-gguf: #39 on the REAL SmolLM2-135M-Instruct Q4_1 GGUF (bench/real_model_gpu.py) alone, one GPU, <= 120 s.
# GGUF=path (98,362,432 bytes; the lead's run_batch.sh assembles it from two carried parts into $HWKV_GGUF).
# serve-gguf.sh ran this step and a structured bench in 120 s in call 1 (main 09915b9): the engine start on a fresh
# machine took 46 s and neither step finished, so this one runs the #39 step only, speed and host share first.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[real-gguf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
GGUF=${GGUF:-${HWKV_GGUF:-}}
say "commit $(cat COMMIT 2>/dev/null); gguf '$GGUF' $(stat -c %s "$GGUF" 2>&1)"
[ -f "$GGUF" ] || { say "no GGUF carried: nothing to do"; exit 2; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
cmd=(python3 bench/real_model_gpu.py --gguf "$GGUF" --out "$OUT/real-model-gpu-smollm2-gguf.json")
say "${cmd[*]}"
timeout -k 2 $(( ${LIMIT:-117} - ($(date +%s) - t0) )) "${cmd[@]}" 2>&1 | tail -n 80
say "rc=${PIPESTATUS[0]} done"
