# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s7-b2.sh   (<= 120 s: AB 80, G 36 at most)
# perf (#36) session 7 batch 2, over main: (AB) the 1B public-defaults offline workload in ONE engine, cuBLAS vs the
# split-K linear (HWKV_CUDA_GEMM=1) for the narrow projections, two rounds, tokens compared; (G) the split-K tiles
# against cuBLAS per projection at 256/128 tokens (1B) and 128 (8B).
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 2 (base vs HWKV_CUDA_GEMM=1)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 80 python3 backends/cuda/scripts/offline_ab.py --model llama-1b \
  --workdir /dev/shm/hwkv-def --rounds 2 --out "$OUT" 2>&1 | cut -c1-400
echo "rc=${PIPESTATUS[0]}"
say "G: backends/cuda/scripts/gemm_probe.py --shapes 1b --tokens 256,128"
timeout -k 2 36 python3 backends/cuda/scripts/gemm_probe.py --shapes 1b,8b --tokens 256,128 --out "$OUT/gemm-probe.json" \
  2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line); print(r['shape'], r['proj'], r['m'], '|', r['variant'], '|', r.get('us') and round(r['us'], 2), '| x', r.get('vs_cublas') and round(r['vs_cublas'], 3), '| err', r.get('rel_err'), r.get('note', ''), r.get('error', ''))
    except Exception:
        print(line.rstrip()[:300])
"
say done
