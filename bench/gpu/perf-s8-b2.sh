# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s8-b2.sh   (<= 120 s: AB ~70, P ~30, G the rest)
# perf (#36) session 8 batch 2, over main: (AB) the 1B public-defaults offline workload in ONE engine: main (the
# one-warp 64-key decode tile for full unsplit grids) against the tile before it and variants around it
# (HWKV_CUDA_ATTN_CONFIG_DECODE) and the model's linears under cuBLASLt (HWKV_CUDA_BLASLT=1), two rounds, tokens compared, plus one profiled pass of main for the GPU's idle
# between kernels; (P) one layer of the decode attention around the new tile and the FMA decode kernel (fma), each row checked against float32
# attention, at 256 x 544/640/768 and 64 x 4096 keys; (G) cuBLAS vs cuBLASLt at the 1B projections at 256 tokens.
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 2 --gaps (main, old decode tile, variants)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 72 python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 2 --gaps --out "$OUT" --variants '[{"name": "main"},
  {"name": "old-tile", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "block_n=128,num_warps=4"}},
  {"name": "w1-hm", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "head_major=1"}},
  {"name": "lt", "env": {"HWKV_CUDA_BLASLT": "1"}},
  {"name": "w2-s5-hm", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "num_warps=2,num_stages=5,head_major=1"}}]' \
  2>&1 | cut -c1-600
echo "rc=${PIPESTATUS[0]}"
say "P: backends/cuda/scripts/attn_step_probe.py (decode 256 x 544/640/768, 64 x 4096)"
HWKV_PROBE_CASES="decode 256,decode 64" \
HWKV_PROBE_DECODE="block_n=128,num_warps=4;fma=1,block_n=32,num_warps=4;fma=2,block_n=32,num_warps=2;num_stages=4;head_major=1;block_n=32;block_n=32,num_stages=4;prefetch=1,block_n=32;num_stages=2;block_n=128;num_warps=2" \
  timeout -k 2 $(( 104 - ($(date +%s) - t0) )) python3 backends/cuda/scripts/attn_step_probe.py "$OUT/attn-decode-probe.json" 2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
        print(r['case'], '|', r['variant'], '|', r.get('us') and round(r['us'], 1), 'us |', r.get('kv_TBps') and round(r['kv_TBps'], 2), 'TB/s |', r.get('block_n'), r.get('num_warps'), r.get('num_stages'), 'hm', r.get('head_major'), 'pf', r.get('prefetch'), '| err', r.get('rel_err_vs_default'), 'vs fp32', r.get('rel_err_vs_fp32'), r.get('error', ''))
    except Exception:
        print(line.rstrip()[:300])
"
say "G: backends/cuda/scripts/gemm_probe.py --shapes 1b --tokens 256 --sweep '' (cuBLAS, cuBLASLt, the split-K rule)"
timeout -k 2 $(( 117 - ($(date +%s) - t0) )) python3 backends/cuda/scripts/gemm_probe.py --shapes 1b --tokens 256 --sweep "" \
  --out "$OUT/gemm-probe.json" 2>&1 | cut -c1-300
say done
